"""passes.stages.Stages: each stage is a copy taken when recorded, built into a GraphModule on
lookup; a no-op pass shares the previous stage's copy, any change gets its own."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.stages import Stages
from tests.unit.passes.graphs import Builder, aten


def _gm() -> fx.GraphModule:
    """x -> neg -> relu"""
    b = Builder()
    return b.finish(b.op(aten.relu.default, b.op(aten.neg.default, b.input("x", 3))))


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _relu(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.target is aten.relu.default)


def test_a_stage_shows_the_graph_as_it_was_recorded() -> None:
    """Rewrites after a recording (new node, changed target, moved node, new meta value)
    do not show in it; every stage is its own runnable GraphModule."""
    gm, stages = _gm(), Stages()
    stages.record("a", gm)
    relu = _relu(gm)
    with gm.graph.inserting_after(relu):
        e = gm.graph.call_function(aten.exp.default, (relu,))
    e.meta.update(relu.meta)
    relu.replace_all_uses_with(e, delete_user_cb=lambda u: u is not e)
    gm.recompile()
    stages.record("b", gm)
    relu.target = aten.sigmoid.default
    stages.record("c", gm)
    relu.meta["unit"] = 3
    stages.record("d", gm)
    stages["final"] = gm
    assert list(stages) == ["a", "b", "c", "d", "final"] and stages.recordings() == 4
    assert _targets(stages["a"]) == [aten.neg.default, aten.relu.default]
    assert _targets(stages["b"]) == [aten.neg.default, aten.relu.default, aten.exp.default]
    assert _targets(stages["c"]) == _targets(stages["d"]) == _targets(gm)
    assert "unit" not in _relu_like(stages["c"]).meta and _relu_like(stages["d"]).meta["unit"] == 3
    assert stages["final"] is gm
    x = torch.tensor([-1.0, 0.5, 2.0])
    assert torch.equal(stages["a"](x)[0], torch.relu(-x))
    assert torch.equal(stages["c"](x)[0], torch.exp(torch.sigmoid(-x)))


def _relu_like(gm: fx.GraphModule) -> fx.Node:
    return [n for n in gm.graph.nodes if n.op == "call_function"][1]


def test_an_unchanged_graph_shares_the_copy_but_not_the_module() -> None:
    gm, stages = _gm(), Stages()
    stages.record("a", gm)
    stages.record("b", gm)  # a no-op pass
    assert stages.recordings() == 1
    a, b = stages["a"], stages["b"]
    assert a is not b and a.graph is not b.graph and stages["a"] is a  # built once, cached
    _relu(a).target = aten.exp.default  # a user editing one stage does not edit the other
    assert _targets(b) == [aten.neg.default, aten.relu.default]


def test_moving_a_node_or_changing_an_argument_is_a_change() -> None:
    gm, stages = _gm(), Stages()
    stages.record("a", gm)
    relu = _relu(gm)
    relu.args = (relu.args[0],) + tuple(relu.args[1:])  # same content, new tuple: still the same graph
    stages.record("same", gm)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    relu.args = (x,)
    stages.record("arg", gm)
    neg = next(n for n in gm.graph.nodes if n.target is aten.neg.default)
    neg.prepend(relu)  # order: relu(x) before neg
    stages.record("moved", gm)
    assert stages.recordings() == 3
    assert [n.name for n in stages["arg"].graph.nodes][1:3] == ["neg_default", "relu_default"]
    assert [n.name for n in stages["moved"].graph.nodes][1:3] == ["relu_default", "neg_default"]
