"""passes.inplace: an all-reduce of a buffer nothing else reads reduces it in place."""

from __future__ import annotations

import torch.fx as fx

from passes import collectives as C
from passes.inplace import inplace_all_reduce
from passes.invariants import check_invariants, fingerprint
from passes.memory import estimate_peak_memory
from passes.meta import Phase, Role
from tests.unit.passes.graphs import Builder, assert_untouched, aten, check_same_results, clone_gm


def _scaled_reduce(world, *, other_reader: bool = False) -> fx.GraphModule:
    """
    g -> mul(g, 0.5) -> all_reduce(sum) -> wait -> relu      [other_reader: mul also read by neg]
    """
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    g = b.input("g", 64, role=Role.GRAD)
    scaled = b.op(aten.mul.Tensor, g, 0.5)
    w = b.all_reduce(scaled, op="sum")
    outs = [b.op(aten.relu.default, w)]
    if other_reader:
        outs.append(b.op(aten.neg.default, scaled))
    return b.finish(*outs)


def test_a_dead_fresh_buffer_is_reduced_in_place(world):
    """
    before: mul -> all_reduce(mul) -> wait      after: mul -> all_reduce_(mul) -> wait
    Same fingerprint (the order check sees one all-reduce), one 64-float buffer less.
    """
    gm = _scaled_reduce(world)
    ref = clone_gm(gm)
    assert inplace_all_reduce(gm) is gm
    (coll,) = C.collectives(gm.graph)
    assert coll.target is C._c10d.all_reduce_.default and C.is_inplace(coll)
    assert C.kind_of(coll) is C.Kind.ALL_REDUCE
    assert coll.meta["val"] is coll.args[0].meta["val"]  # it returns its input
    check_invariants(gm)
    assert fingerprint(gm) == fingerprint(ref)
    before, after = estimate_peak_memory(ref).by_phase, estimate_peak_memory(gm).by_phase
    assert before["backward"].allocated_bytes - after["backward"].allocated_bytes == 64 * 4
    check_same_results(ref, gm, world)


def test_a_buffer_read_elsewhere_stays_functional(world):
    assert_untouched(inplace_all_reduce, _scaled_reduce(world, other_reader=True))


def test_a_placeholder_or_a_view_stays_functional(world):
    """The reduction may not write the caller's tensor, nor through a view another tensor."""
    b = Builder(group=world.group, world_size=world.size)
    g = b.input("g", 8, 8, role=Role.GRAD)
    w1 = b.all_reduce(g, op="sum")
    w2 = b.all_reduce(b.op(aten.t.default, b.op(aten.mul.Tensor, g, 2.0)), op="sum")
    assert_untouched(inplace_all_reduce, b.finish(w1, w2))


def test_a_reduce_scatter_result_is_reduced_in_place(world):
    """hybrid_shard: the replicate-group all-reduce of a reduce-scatter's (dead) output."""
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    rs = b.reduce_scatter(b.input("g", 4 * world.size, role=Role.GRAD))
    w = b.all_reduce(rs)
    gm = b.finish(b.op(aten.relu.default, w))
    ref = clone_gm(gm)
    inplace_all_reduce(gm)
    assert [C.is_inplace(c) for c in C.collectives(gm.graph)] == [False, True]
    check_invariants(gm)
    check_same_results(ref, gm, world)
