"""passes.driver.run_passes: the bookkeeping every pass gets for free."""

from __future__ import annotations

import pytest
import torch.fx as fx

from passes.driver import NamedPass, PassFailure, copy_graph_module, run_passes
from passes.invariants import InvariantViolation, check_invariants
from passes.meta import Role
from passes.stages import Stages
from tests.unit.passes.graphs import Builder, aten


def _gm() -> fx.GraphModule:
    """x -> neg -> relu"""
    b = Builder()
    return b.finish(b.op(aten.relu.default, b.op(aten.neg.default, b.input("x", 3, role=Role.INPUT))))


def _add_exp(gm: fx.GraphModule) -> fx.GraphModule:
    """A real rewrite: out = exp(out)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    (res,) = out.args[0]
    with gm.graph.inserting_before(out):
        e = gm.graph.call_function(aten.exp.default, (res,))
    e.meta.update(res.meta)
    out.args = ((e,),)
    gm.recompile()
    return gm


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_records_a_copy_of_the_graph_after_each_pass():
    recorded = Stages()
    passes = [NamedPass(name="identity", fn=lambda gm: gm), NamedPass(name="exp", fn=_add_exp)]
    out = run_passes(_gm(), passes, record=recorded.record)
    assert list(recorded) == ["identity", "exp"]
    assert _targets(recorded["identity"]) == [aten.neg.default, aten.relu.default]
    assert (
        _targets(recorded["exp"]) == _targets(out) == [aten.neg.default, aten.relu.default, aten.exp.default]
    )
    assert recorded["exp"] is not out  # a copy: later passes cannot rewrite history


def test_disabled_passes_are_skipped():
    called = []

    def spy(name):
        def fn(gm):
            called.append(name)
            return gm

        return NamedPass(name=name, fn=fn)

    recorded: dict[str, fx.GraphModule] = {}
    run_passes(_gm(), [spy("a"), spy("b"), spy("c")], disabled={"b"}, record=recorded.__setitem__)
    assert called == ["a", "c"] and list(recorded) == ["a", "c"]


def test_a_failing_pass_is_named_with_the_ones_before_it():
    def boom(gm):
        raise ValueError("no such node")

    passes = [
        NamedPass(name="first", fn=lambda gm: gm),
        NamedPass(name="skipped", fn=lambda gm: gm),
        NamedPass(name="second", fn=_add_exp),
        NamedPass(name="boom", fn=boom),
        NamedPass(name="never", fn=lambda gm: pytest.fail("ran after a failure")),
    ]
    with pytest.raises(PassFailure) as info:
        run_passes(_gm(), passes, disabled=["skipped"])
    err = info.value
    assert err.pass_name == "boom" and err.ran_before == ["first", "second"]
    assert "'boom'" in str(err) and "first, second" in str(err) and "no such node" in str(err)
    assert isinstance(err.__cause__, ValueError)


def test_a_pass_must_return_a_graph_module():
    with pytest.raises(PassFailure, match=r"'returns_graph'.*returned Graph, expected a GraphModule"):
        run_passes(_gm(), [NamedPass(name="returns_graph", fn=lambda gm: gm.graph)])


def test_checker_runs_after_every_pass_and_blames_the_pass_that_broke_the_graph():
    seen = []

    def check(gm, name):
        seen.append(name)
        check_invariants(gm)

    def drop_val(gm):
        next(n for n in gm.graph.nodes if n.op == "call_function").meta.pop("val")
        return gm

    passes = [NamedPass(name="fine", fn=_add_exp), NamedPass(name="drop_val", fn=drop_val)]
    with pytest.raises(PassFailure) as info:
        run_passes(_gm(), passes, check=check)
    assert seen == ["fine", "drop_val"]
    assert info.value.pass_name == "drop_val" and info.value.ran_before == ["fine"]
    assert isinstance(info.value.__cause__, InvariantViolation)


def test_copy_graph_module_is_independent():
    gm = _gm()
    copy = copy_graph_module(gm)
    _add_exp(gm)
    assert len(_targets(copy)) == 2 and len(_targets(gm)) == 3


def test_rebuilt_graph_modules_keep_gm_meta():
    """``fx.GraphModule(gm, graph)`` starts with an empty ``meta``; every copy or rebuild of a
    step's GraphModule (the driver's, the frontend's lazy and plain copies) keeps ``gm.meta``."""
    from spmd.frontend.tracing import copy_graph_module as frontend_copy

    gm = _gm()
    gm.meta["note"] = "kept"
    for copy in (copy_graph_module(gm), frontend_copy(gm), frontend_copy(gm, lazy=True)):
        assert copy.meta == {"note": "kept"}
        assert copy.meta is not gm.meta
