"""passes.shm_collectives: collectives of groups with shared memory become their spmd_shm twins."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import collectives as C
from passes.invariants import check_invariants, fingerprint
from passes.memory import estimate_peak_memory
from passes.meta import Phase, Role
from passes.shm_collectives import restore_gloo, shared_memory_collectives
from tests.unit.passes.graphs import Builder, aten, clone_gm


def _graph(w: int, group: str = "0") -> fx.GraphModule:
    """
    p -> all_gather -> wait -> mm(x, .t) -> g -> reduce_scatter(avg) -> wait -> mul
                                            g -> all_reduce(sum) -> wait -> relu
    """
    b = Builder(group=group, world_size=w)
    p = b.input("p", 4, 8, role=Role.PARAM)
    x = b.input("x", 3, 8)
    full = b.all_gather(p)
    h = b.op(aten.mm.default, x, b.op(aten.t.default, full))
    b.phase = Phase.BACKWARD
    g = b.op(aten.mm.default, b.op(aten.t.default, h), x)
    y = b.reduce_scatter(g, op="avg")
    z = b.all_reduce(b.op(aten.mul.Tensor, g, 2.0), op="sum")
    return b.finish(b.op(aten.mul.Tensor, y, 2.0), b.op(aten.relu.default, z))


def test_two_ranks_every_collective_runs_through_shared_memory():
    """Only the targets change: names, arguments, waits, the fingerprint (kinds, groups, bytes, order)."""
    gm = _graph(2)
    ref = clone_gm(gm)
    assert shared_memory_collectives(gm, groups={"0": 2}) is gm
    colls = C.collectives(gm.graph)
    assert [C.is_shared_memory(c) for c in colls] == [True, True, True]
    assert [c.name for c in colls] == [c.name for c in C.collectives(ref.graph)]
    assert [str(c.args) for c in colls] == [str(c.args) for c in C.collectives(ref.graph)]
    assert fingerprint(gm) == fingerprint(ref)
    check_invariants(gm)


def test_reductions_of_more_ranks_and_other_groups_stay_on_gloo():
    """W=3: the all-gather moves bytes (exact), the reductions' order would differ from gloo's."""
    gm = _graph(3)
    shared_memory_collectives(gm, groups={"0": 3})
    assert [(C.kind_of(c).value, C.is_shared_memory(c)) for c in C.collectives(gm.graph)] == [
        ("all_gather", True),
        ("reduce_scatter", False),
        ("all_reduce", False),
    ]
    other = _graph(2, group="7")
    assert shared_memory_collectives(other, groups={"0": 2}) is other
    assert not any(C.is_shared_memory(c) for c in C.collectives(other.graph))


def test_an_integer_reduction_stays_on_gloo():
    """The transport's avg divides in place: integer reductions keep gloo's semantics."""
    b = Builder(group="0", world_size=2)
    b.phase = Phase.BACKWARD
    n = b.input("n", 4, role=Role.GRAD, dtype=torch.int64)
    gm = b.finish(b.all_reduce(n, op="sum"))
    assert shared_memory_collectives(gm, groups={"0": 2}) is gm
    assert not any(C.is_shared_memory(c) for c in C.collectives(gm.graph))


def test_no_groups_is_a_no_op():
    gm = _graph(2)
    before = gm.code
    assert shared_memory_collectives(gm, groups={}) is gm and gm.code == before


def test_inputs_are_not_held_to_the_wait():
    """
    g -> mul -> all_reduce -> big = mul(g, 3) -> wait -> add(wait, big)

    A gloo all-reduce holds its input (the mul) until the wait, so it is live next to ``big``; a
    shared-memory one has read it when it returns: the estimate frees it before ``big``."""
    b = Builder(group="0", world_size=2)
    b.phase = Phase.BACKWARD
    g = b.input("g", 64, 64, role=Role.GRAD)
    b.all_reduce(b.op(aten.mul.Tensor, g, 2.0), op="sum")
    gm = b.finish()
    (coll,) = C.collectives(gm.graph)
    wait = C.wait_of(coll)
    with gm.graph.inserting_after(coll):
        big = gm.graph.call_function(aten.mul.Tensor, (g, 3.0))
    big.meta["val"] = coll.meta["val"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        total = gm.graph.call_function(aten.add.Tensor, (wait, big))
    total.meta["val"] = coll.meta["val"]
    out.args = (total,)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    held = estimate_peak_memory(gm).peak_bytes
    shared_memory_collectives(gm, groups={"0": 2})
    assert estimate_peak_memory(gm).peak_bytes == held - 64 * 64 * 4


def test_fake_kernels_give_the_functional_shapes():
    x = torch.empty(6, 5, device="meta")
    s = torch.ops.spmd_shm
    assert s.all_gather_into_tensor(x, 2, "0").shape == (12, 5)
    assert s.reduce_scatter_tensor(x, "sum", 2, "0").shape == (3, 5)
    assert s.all_reduce(x, "sum", "0").shape == (6, 5)
    assert s.all_to_all_single(x, [3, 3], [3, 3], "0").shape == (6, 5)
    assert s.broadcast(x, 0, "0").shape == (6, 5)


def test_restore_gloo_undoes_the_rewrite_of_the_groups_named():
    """A group whose transport could not be made runs on gloo again: the graph's code is the one
    before the rewrite (same nodes, same order)."""
    gm = _graph(2)
    before = gm.code
    shared_memory_collectives(gm, groups={"0": 2})
    assert gm.code != before
    assert restore_gloo(gm, {"7"}) is gm and gm.code != before  # another group: untouched
    restore_gloo(gm, {"0"})
    assert gm.code == before
    assert not any(C.is_shared_memory(c) for c in C.collectives(gm.graph))
