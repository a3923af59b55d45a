"""passes.dedup: identical collectives become one; anything that would change a result does not."""

from __future__ import annotations

import operator

import pytest
import torch

from passes import collectives as C
from passes.dedup import dedup_collectives
from passes.invariants import check_invariants
from passes.meta import Phase, Role
from tests.unit.passes.graphs import Builder, assert_untouched, aten, c10d, clone_gm, colls, flat, inputs_for


def _index(gm, node):
    return list(gm.graph.nodes).index(node)


def _same_results(before, after, world):
    args = inputs_for(before)
    ref, out = flat(before(*[a.clone() for a in args])), flat(after(*[a.clone() for a in args]))
    assert [o.shape for o in out] == [r.shape for r in ref]
    if world.real:
        assert all(torch.equal(o, r) for o, r in zip(out, ref))


def test_tied_weight_gathered_twice_is_gathered_once(world):
    """
    p -> all_gather -> wait1 -> mm(x, wait1.t()) -> y1
    p -> all_gather -> wait2 -> mm(y1, wait2.t()) -> y2        (lm_head tied to the embedding)
    after: one all_gather; y2 reads wait1
    """
    b = Builder(group=world.group, world_size=world.size)
    p = b.input("p", 4 // world.size, 4, module="emb")
    x = b.input("x", 2, 4, role=Role.INPUT)
    w1 = b.all_gather(p)
    y1 = b.op(aten.mm.default, x, b.op(aten.t.default, w1))
    w2 = b.all_gather(p)
    y2 = b.op(aten.mm.default, y1, b.op(aten.t.default, w2))
    gm = b.finish(y2)
    ref = clone_gm(gm)

    out = dedup_collectives(gm)

    assert out is gm
    assert colls(gm) == ["all_gather"]
    assert w2 not in gm.graph.nodes and y2.args[1].args[0] is w1
    check_invariants(gm)
    _same_results(ref, gm, world)


def test_kept_wait_moves_before_the_first_use_of_the_duplicate(world):
    """
    p -> ag1 ; p -> ag2 -> wait2 -> relu ; ag1 -> wait1 -> add(wait1, relu)
    after: ag1 -> wait1 -> relu ... add        (wait1 moved up to just before relu)
    """
    b = Builder(group=world.group, world_size=world.size)
    p = b.input("p", 3)
    ag1 = b.op(c10d.all_gather_into_tensor.default, p, world.size, world.group, role=Role.COMM)
    w2 = b.all_gather(p)
    r = b.op(aten.relu.default, w2)
    w1 = b.op(C.WAIT, ag1, role=Role.COMM)
    y = b.op(aten.add.Tensor, w1, r)
    gm = b.finish(y)
    ref = clone_gm(gm)

    dedup_collectives(gm)

    assert colls(gm) == ["all_gather"]
    assert r.args == (w1,)
    assert _index(gm, ag1) < _index(gm, w1) < _index(gm, r) < _index(gm, y)
    check_invariants(gm)
    _same_results(ref, gm, world)


def test_same_gradient_reduced_twice_is_reduced_once(world):
    """g -> all_reduce -> wait1 -> neg ; g -> all_reduce -> wait2 -> exp   (backward)"""
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    g = b.input("g", 4, 2, role=Role.GRAD)
    y1 = b.op(aten.neg.default, b.all_reduce(g))
    y2 = b.op(aten.exp.default, b.all_reduce(g))
    gm = b.finish(y1, y2)
    ref = clone_gm(gm)

    dedup_collectives(gm)

    assert colls(gm) == ["all_reduce"]
    assert y1.args[0] is y2.args[0]
    check_invariants(gm)
    _same_results(ref, gm, world)


def test_three_copies_become_one():
    """g -> reduce_scatter x3 -> wait x3 -> stack"""
    b = Builder()
    g = b.input("g", 4, role=Role.GRAD)
    waits = [b.reduce_scatter(g) for _ in range(3)]
    y = b.op(aten.stack.default, waits)
    gm = b.finish(y)
    dedup_collectives(gm)
    assert colls(gm) == ["reduce_scatter"]
    assert y.args[0] == [waits[0]] * 3
    check_invariants(gm)


@pytest.mark.parametrize(
    "second",
    [
        pytest.param(dict(op="sum"), id="reduce-op"),
        pytest.param(dict(group="other"), id="group"),
    ],
)
def test_different_non_tensor_args_are_not_duplicates(second):
    """g -> all_reduce(avg, "0") ; g -> all_reduce(<other op or group>)"""
    b = Builder()
    g = b.input("g", 4, role=Role.GRAD)
    gm = b.finish(b.all_reduce(g), b.all_reduce(g, **second))
    assert_untouched(dedup_collectives, gm)
    assert colls(gm) == ["all_reduce", "all_reduce"]


def test_different_inputs_are_not_duplicates():
    """a -> all_gather ; b -> all_gather   (same shapes, different tensors)"""
    b = Builder()
    gm = b.finish(b.all_gather(b.input("a", 3)), b.all_gather(b.input("b", 3)))
    assert colls(dedup_collectives(gm)) == ["all_gather", "all_gather"]


def test_forward_and_backward_gathers_stay_apart():
    """
    p -> all_gather (forward) -> wait -> mul ; p -> all_gather (backward) -> wait -> mul
    Reshard-after-forward on purpose: merging would keep the gathered p alive across the step.
    """
    b = Builder()
    p = b.input("p", 3)
    y = b.op(aten.mul.Tensor, b.all_gather(p), 2.0)
    b.phase = Phase.BACKWARD
    z = b.op(aten.mul.Tensor, b.all_gather(p), y)
    gm = b.finish(z)
    assert_untouched(dedup_collectives, gm)
    assert colls(gm) == ["all_gather", "all_gather"]


def test_input_written_between_the_two_is_not_a_duplicate():
    """p -> all_reduce ; p.add_(1) ; p -> all_reduce   (the second sends different values)"""
    b = Builder()
    p = b.input("p", 3)
    w1 = b.all_reduce(p)
    b.op(aten.add_.Scalar, p, 1.0)
    gm = b.finish(w1, b.all_reduce(p))
    assert_untouched(dedup_collectives, gm)
    assert colls(gm) == ["all_reduce", "all_reduce"]


def test_view_of_input_written_between_is_caught_through_the_storage():
    """p -> all_reduce ; p.view(3).mul_(2) ; p -> all_reduce"""
    b = Builder()
    p = b.input("p", 3, 1)
    w1 = b.all_reduce(p)
    b.op(aten.mul_.Tensor, b.op(aten.view.default, p, [3]), 2.0)
    gm = b.finish(w1, b.all_reduce(p))
    assert colls(dedup_collectives(gm)) == ["all_reduce", "all_reduce"]


def test_result_written_in_place_is_not_shared():
    """g -> all_reduce -> wait1 -> mul_(2) ; g -> all_reduce -> wait2   (sharing would double wait2)"""
    b = Builder()
    g = b.input("g", 3, role=Role.GRAD)
    w1 = b.all_reduce(g)
    b.op(aten.mul_.Tensor, w1, 2.0)
    gm = b.finish(w1, b.all_reduce(g))
    assert_untouched(dedup_collectives, gm)
    assert colls(gm) == ["all_reduce", "all_reduce"]


def test_coalesced_duplicates_merge_output_by_output(world):
    """
    [a, c] -> all_reduce_coalesced -> getitem 0, 1 -> wait, wait -> add
    [a, c] -> all_reduce_coalesced -> getitem 0, 1 -> wait, wait -> mul
    after: one coalesced all-reduce, both consumers read its waits
    """
    b = Builder(group=world.group, world_size=world.size)
    a, c = b.input("a", 3), b.input("c", 3)
    first = b.coalesced(c10d.all_reduce_coalesced.default, [a, c], "sum", world.group)
    y = b.op(aten.add.Tensor, *first)
    second = b.coalesced(c10d.all_reduce_coalesced.default, [a, c], "sum", world.group)
    z = b.op(aten.mul.Tensor, *second)
    gm = b.finish(y, z)
    ref = clone_gm(gm)

    dedup_collectives(gm)

    assert colls(gm) == ["all_reduce"]
    assert z.args == tuple(first)
    assert sum(n.target is operator.getitem for n in gm.graph.nodes) == 2
    check_invariants(gm)
    _same_results(ref, gm, world)


def test_broadcast_duplicates_merge():
    """buf -> broadcast(src 0) -> wait ; buf -> broadcast(src 0) -> wait ; buf -> broadcast(src 1) -> wait"""
    b = Builder()
    buf = b.input("buf", 3, role=Role.BUFFER)
    waits = []
    for src in (0, 0, 1):
        coll = b.op(c10d.broadcast.default, buf, src, "0", role=Role.COMM)
        waits.append(b.op(C.WAIT, coll, role=Role.COMM))
    gm = b.finish(*waits)
    dedup_collectives(gm)
    assert [C.kind_of(n).value for n in C.collectives(gm.graph)] == ["broadcast", "broadcast"]
    assert [n.args[1] for n in C.collectives(gm.graph)] == [0, 1]
    check_invariants(gm)


def test_nothing_to_do_returns_the_same_untouched_module():
    """p -> all_gather -> wait ; g -> all_reduce -> wait"""
    b = Builder()
    gm = b.finish(b.all_gather(b.input("p", 3)), b.all_reduce(b.input("g", 3, role=Role.GRAD)))
    assert_untouched(dedup_collectives, gm)
