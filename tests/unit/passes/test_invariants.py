"""passes.invariants: each rule fires on a graph that breaks it, and only then."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from passes import collectives as C
from passes.invariants import InvariantViolation, check_invariants, describe, fingerprint
from passes.meta import PHASE, RESHARD, ROLE, Phase, Role
from tests.unit.passes.graphs import Builder, aten, c10d


def _violations(gm: fx.GraphModule) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as info:
        check_invariants(gm)
    return info.value


def _valid() -> tuple[Builder, fx.GraphModule]:
    """p -> all_gather -> wait -> mul ; [g, h] -> all_reduce_coalesced -> getitem x2 -> wait x2"""
    b = Builder()
    p, g, h = b.input("p", 2, 3), b.input("g", 4, role=Role.GRAD), b.input("h", 1, role=Role.GRAD)
    full = b.all_gather(p)
    y = b.op(aten.mul.Tensor, full, full)
    b.phase = Phase.BACKWARD
    waits = b.coalesced(c10d.all_reduce_coalesced.default, [g, h], "avg", "0")
    return b, b.finish(y, *waits)


def test_a_valid_graph_passes():
    _, gm = _valid()
    check_invariants(gm)


def test_in_place_ops_that_return_nothing_need_no_val():
    """[p] -> _foreach_add_(1.0)   (returns nothing: make_fx records no value)"""
    b = Builder()
    p = b.input("p", 3)
    node = b.op(aten._foreach_add_.Scalar, [p], 1.0, role=Role.UPDATE)
    assert "val" not in node.meta
    check_invariants(b.finish(p))


def test_collective_without_wait():
    """x -> all_reduce -> (no wait) -> add"""
    b = Builder()
    x = b.input("x", 3)
    coll = b.op(c10d.all_reduce.default, x, "sum", "0", role=Role.COMM)
    y = b.op(aten.add.Tensor, coll, x)
    err = _violations(b.finish(y))
    assert err.rules == {"one-wait-per-output", "only-wait-reads"}
    assert coll.name in str(err) and y.name in str(err)


def test_collective_with_two_waits():
    """x -> all_reduce -> wait, wait"""
    b = Builder()
    w1 = b.all_reduce(b.input("x", 3))
    w2 = b.op(C.WAIT, w1.args[0], role=Role.COMM)
    err = _violations(b.finish(w1, w2))
    assert err.rules == {"one-wait-per-output"}
    assert "has 2 waits" in str(err)


def test_result_read_besides_its_wait():
    """x -> all_gather -> wait ; all_gather -> clone (reads the unfinished buffer)"""
    b = Builder()
    wait = b.all_gather(b.input("x", 3))
    early = b.op(aten.clone.default, wait.args[0])
    err = _violations(b.finish(wait, early))
    assert err.rules == {"only-wait-reads"}
    assert err.violations[0].node == early.name


def test_coalesced_output_without_getitem_or_with_unwaited_getitem():
    """[a, b] -> all_reduce_coalesced -> getitem 0 -> add (no wait); output 1 never taken"""
    b = Builder()
    a, c = b.input("a", 3), b.input("c", 3)
    coll = b.graph.call_function(c10d.all_reduce_coalesced.default, ([a, c], "sum", "0"))
    coll.meta.update(a.meta)
    coll.meta["val"] = [a.meta["val"], c.meta["val"]]
    coll.meta[ROLE] = Role.COMM
    item = b.op(operator.getitem, coll, 0, role=Role.COMM)
    y = b.op(aten.add.Tensor, item, a)
    err = _violations(b.finish(y))
    assert err.rules == {"one-wait-per-output", "only-wait-reads"}
    assert "output 1 is taken by 0 getitems" in str(err)


def test_wait_before_its_collective():
    """x -> wait -> all_reduce   (built in order, then the wait moved up)"""
    b = Builder()
    wait = b.all_reduce(b.input("x", 3))
    gm = b.finish(wait)
    wait.args[0].prepend(wait)
    err = _violations(gm)
    assert {"wait-after-collective", "lint"} <= err.rules


def test_wait_on_something_that_is_not_a_collective():
    """x -> clone -> wait"""
    b = Builder()
    x = b.input("x", 3)
    wait = b.op(C.WAIT, b.op(aten.clone.default, x), role=Role.COMM)
    err = _violations(b.finish(wait))
    assert err.rules == {"wait-after-collective"} and "not a collective" in str(err)


def test_missing_val():
    """x -> relu (its meta["val"] dropped)"""
    b = Builder()
    y = b.op(aten.relu.default, b.input("x", 3))
    del y.meta["val"]
    err = _violations(b.finish(y))
    assert err.rules == {"val"} and y.name in str(err)


@pytest.mark.parametrize("key", [ROLE, PHASE])
def test_missing_or_untyped_role_and_phase(key):
    """x -> relu (ROLE or PHASE dropped) -> neg (ROLE or PHASE a plain string)"""
    b = Builder()
    y = b.op(aten.relu.default, b.input("x", 3))
    z = b.op(aten.neg.default, y)
    del y.meta[key]
    z.meta[key] = "activation" if key == ROLE else "forward"
    err = _violations(b.finish(z))
    assert err.rules == {"role-phase"}
    assert {v.node for v in err.violations} == {y.name, z.name}


def test_collective_val_that_does_not_match_the_op():
    """p -> all_gather(W=2) whose val claims the input shape ; x -> all_reduce whose wait claims float16"""
    b = Builder(world_size=2)
    ag_wait = b.all_gather(b.input("p", 2, 3))
    ag_wait.args[0].meta["val"] = b.mode.from_tensor(torch.empty(2, 3))
    ar_wait = b.all_reduce(b.input("x", 4))
    ar_wait.meta["val"] = b.mode.from_tensor(torch.empty(4, dtype=torch.float16))
    err = _violations(b.finish(ag_wait, ar_wait))
    assert err.rules == {"val"}
    assert {v.node for v in err.violations} == {ag_wait.args[0].name, ag_wait.name, ar_wait.name}


def test_every_violation_is_listed():
    """three unwaited all_reduces: three violations in one error"""
    b = Builder()
    x = b.input("x", 3)
    for _ in range(3):
        b.op(c10d.all_reduce.default, x, "sum", "0", role=Role.COMM)
    err = _violations(b.finish(x))
    assert len(err.violations) == 3 and str(err).startswith("3 graph invariant violation(s)")


def _resharded(backward_reads_forward_gather: bool, flag: bool = True) -> fx.GraphModule:
    """p (resharded) -> all_gather -> wait -> t -> mm(x, .)            forward
    g -> mm(g, W) where W = t of the forward gather (the bug) or
                        t of a second all_gather of p (FULL_SHARD) backward"""
    b = Builder()
    p, x, g = b.input("p", 2, 4), b.input("x", 3, 4, role=Role.INPUT), b.input("g", 3, 4, role=Role.INPUT)
    p.meta[RESHARD] = flag
    w = b.op(aten.t.default, b.all_gather(p))
    y = b.op(aten.mm.default, x, w)
    b.phase = Phase.BACKWARD
    if not backward_reads_forward_gather:
        w = b.op(aten.t.default, b.all_gather(p))
    dx = b.op(aten.mm.default, g, b.op(aten.t.default, w))
    return b.finish(y, dx)


def test_backward_reading_a_forward_gather_of_a_resharded_parameter():
    """With reshard after forward, backward must gather again, not read forward's copy
    (activation checkpointing's recompute, once labelled forward, did)."""
    check_invariants(_resharded(backward_reads_forward_gather=False))
    check_invariants(_resharded(backward_reads_forward_gather=True, flag=False))  # SHARD_GRAD_OP
    err = _violations(_resharded(backward_reads_forward_gather=True))
    assert err.rules == {"reshard"}
    assert len(err.violations) == 1 and "backward" in str(err) and "resharded after forward" in str(err)


def test_describe_names_kind_shape_module_and_node():
    b = Builder(world_size=4)
    p = b.input("p", 2, 3, module="layers.0.fc")
    wait = b.all_gather(p)
    b.finish(wait)
    text = describe(wait.args[0])
    assert "all_gather" in text and "float32[2, 3]" in text and "'layers.0.fc'" in text
    assert wait.args[0].name in text
    assert "float32[8, 3]" in describe(wait) and "p" in describe(p)


def test_fingerprint_lists_collectives_in_order():
    _, gm = _valid()
    assert fingerprint(gm) == [
        (0, "all_gather", ((2, 3),), ("torch.float32",), "0", None, 2),
        (1, "all_reduce_coalesced", ((4,), (1,)), ("torch.float32", "torch.float32"), "0", "avg", None),
    ]


def test_fingerprint_differs_when_order_group_or_op_differs():
    """x -> all_reduce(sum) ; y -> all_reduce(sum), in both orders, on two groups, with two ops"""

    def build(order: str, group: str = "0", op: str = "sum") -> fx.GraphModule:
        b = Builder(group=group)
        nodes = {"x": b.input("x", 3), "y": b.input("y", 5)}
        return b.finish(*[b.all_reduce(nodes[k], op) for k in order])

    base = fingerprint(build("xy"))
    assert fingerprint(build("xy")) == base
    assert fingerprint(build("yx")) != base
    assert fingerprint(build("xy", group="1")) != base
    assert fingerprint(build("xy", op="avg")) != base


def test_a_traced_step_satisfies_the_invariants():
    """The tracer's own graph (world size 1, foreach AdamW: in-place ops with no value) passes."""
    import spmd
    from tests import models

    model = models.build("mlp")
    opt = models.make_optimizer("adamw_foreach", model)
    step = spmd.compile(check_invariants=True)(models.train_step)
    step(model, opt, *models.batches("mlp", 1)[0])
    check_invariants(step.graphs["final"])
    check_invariants(step.graphs["traced"])
