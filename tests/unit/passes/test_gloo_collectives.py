"""passes.gloo_collectives: a 2-rank sum/avg reduce-scatter becomes an all-to-all and a local sum."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from passes import collectives as C
from passes.gloo_collectives import reduce_scatter_as_all_to_all
from passes.invariants import check_invariants, fingerprint
from passes.meta import Phase, Role
from tests.unit.passes.graphs import Builder, assert_untouched, aten, clone_gm, run_ranks


def _rs_graph(w: int, op: str = "avg", dtype: torch.dtype = torch.float32) -> fx.GraphModule:
    """
    g -> mul(g, 3) -> reduce_scatter(op, W) -> wait -> relu
    """
    b = Builder(group="0", world_size=w)
    b.phase = Phase.BACKWARD
    g = b.input("g", 6 * w, 5, role=Role.GRAD, dtype=dtype)
    y = b.reduce_scatter(b.op(aten.mul.Tensor, g, 3.0), op=op)
    return b.finish(b.op(aten.relu.default, y))


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_two_rank_reduce_scatter_becomes_all_to_all_and_sum(op, dtype):
    """
    before: reduce_scatter(x, op, 2) -> wait -> relu
    after:  all_to_all_single(x, [n/2]*2, [n/2]*2) -> wait -> view [2, n/2, 5] -> sum(0) [-> div 2] -> relu
    Same results bit for bit on two simulated ranks; one collective at the same place.
    """
    gm = _rs_graph(2, op, dtype)
    ref = clone_gm(gm)
    assert reduce_scatter_as_all_to_all(gm) is gm
    (coll,) = C.collectives(gm.graph)
    assert C.kind_of(coll) is C.Kind.ALL_TO_ALL and C.group_size_of(coll) == 2
    assert coll.args[1] == coll.args[2] == [6, 6]
    assert C.bytes_of(coll) == C.bytes_of(C.collectives(ref.graph)[0])
    assert coll.meta["val"].shape == (12, 5)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.sum.dim_IntList in targets and (aten.div.Tensor in targets) == (op == "avg")
    check_invariants(gm)
    torch.manual_seed(0)
    per_rank = [[(torch.randn(12, 5) * 7).to(dtype)] for _ in range(2)]
    want, got = run_ranks(ref, per_rank), run_ranks(gm, per_rank)
    for r in range(2):
        assert got[r][0].dtype == dtype and torch.equal(got[r][0], want[r][0])


def test_other_world_sizes_and_ops_are_untouched():
    """W=3: the summation order differs from gloo's; max/min/product: not a sum."""
    assert_untouched(reduce_scatter_as_all_to_all, _rs_graph(3))
    assert_untouched(reduce_scatter_as_all_to_all, _rs_graph(2, op="max"))


def test_the_fingerprint_keeps_order_and_group():
    gm = _rs_graph(2)
    before = fingerprint(clone_gm(gm))
    after = fingerprint(reduce_scatter_as_all_to_all(gm))
    assert [(e[0], e[4]) for e in after] == [(e[0], e[4]) for e in before]
    assert after[0][1] == "all_to_all" and after[0][2] == before[0][2]
