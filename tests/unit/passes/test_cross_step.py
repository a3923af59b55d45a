"""passes.cross_step: the step's leading all-gather moves to the end of the previous call.

``_step`` is a one-unit train step as the partitioner and the pipeline leave it::

    p -> pad -> AG -> W -> h = mul(x, W) ; (backward) g -> AR -> WR ; (optimizer) add_(p, WR) ; return h
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from passes import collectives as C
from passes.cross_step import (
    CARRIED,
    carried_outputs,
    carried_placeholders,
    carry_first_gathers,
    check_carried,
    issue_module,
)
from passes.invariants import InvariantViolation, check_invariants
from passes.meta import Phase, Role
from tests.unit.passes.graphs import Builder, assert_untouched, aten, clone_gm, colls, inputs_for


def _step(
    world_size: int = 2, group: str = "0", *, update: bool = True, batch_dependent: bool = False
) -> fx.GraphModule:
    b = Builder(group=group, world_size=world_size)
    x = b.input("x", 4 * world_size, role=Role.INPUT)
    p = b.input("p", 3, module="layers.0")
    src = b.op(aten.add.Tensor, p, b.op(aten.sum.default, x)) if batch_dependent else p
    w = b.all_gather(b.op(aten.constant_pad_nd.default, src, [0, 1]))
    h = b.op(aten.mul.Tensor, x, w)
    b.phase = Phase.BACKWARD
    g = b.all_reduce(b.op(aten.narrow.default, h, 0, 0, 3))
    if update:
        b.phase = Phase.OPTIMIZER
        b.op(aten.add_.Tensor, p, g, role=Role.UPDATE)
    return b.finish(h)


def test_moves_the_first_gather_after_the_update_and_carries_it():
    """
    after: carried_gather_0 -> W -> mul ; AR WR ; add_(p) ; pad' AG' ; return (h, AG')
    """
    gm = _step()
    assert carry_first_gathers(gm) is gm
    (ph,) = carried_placeholders(gm)
    (out,) = carried_outputs(gm)
    assert ph.meta[CARRIED] == out.meta[CARRIED] == 0
    assert [u.target for u in ph.users] == [C.WAIT]
    assert colls(gm) == ["all_reduce", "all_gather"]  # the gather is now the step's last collective
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    update = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
    assert order[out] > order[update]
    assert list(gm.graph.output_node().args[0])[-1] is out
    check_invariants(gm)


def test_issue_module_gathers_what_the_step_would(world):
    """Two calls of the rewritten step (the first fed by ``issue_module``, the second by the first's
    carried output) compute what two calls of the original step compute."""
    before = _step(world.size, world.group)
    after = carry_first_gathers(clone_gm(before))
    issue = issue_module(after)
    args = inputs_for(before)
    ref_args, new_args = [a.clone() for a in args], [a.clone() for a in args]
    ref = [before(*ref_args)[0] for _ in range(2)]
    carried = issue(*new_args)
    got = []
    for _ in range(2):
        *outs, carried_out = after(*new_args, *carried)
        got.append(outs[0])
        carried = [carried_out]
    torch.ops._c10d_functional.wait_tensor(carried[0])
    if world.real:
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        assert torch.equal(ref_args[1], new_args[1])  # the parameter after two updates
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in ref]


@pytest.mark.parametrize(
    "kwargs", [{"update": False}, {"batch_dependent": True}], ids=["no-update (eval)", "batch-dependent"]
)
def test_no_op_when_not_carriable(kwargs):
    assert_untouched(carry_first_gathers, _step(**kwargs))


def test_no_op_when_the_first_collective_is_not_a_gather():
    b = Builder()
    x = b.input("x", 8, role=Role.INPUT)
    p = b.input("p", 4)
    r = b.all_reduce(x)
    w = b.all_gather(p)
    b.phase = Phase.OPTIMIZER
    b.op(aten.add_.Tensor, p, b.op(aten.narrow.default, r, 0, 0, 4), role=Role.UPDATE)
    assert_untouched(carry_first_gathers, b.finish(b.op(aten.mul.Tensor, r, w)))


def test_checker_catches_a_write_after_the_carried_gather():
    gm = carry_first_gathers(_step())
    (out,) = carried_outputs(gm)
    update = next(n for n in gm.graph.nodes if n.target is aten.add_.Tensor)
    pad = out.args[0]
    update.prepend(pad)
    update.prepend(out)  # now issued before the update of what it sends
    gm.recompile()
    assert any("writes what the carried gather" in msg for _, msg in check_carried(gm))
    with pytest.raises(InvariantViolation) as err:
        check_invariants(gm)
    assert "carried" in err.value.rules
