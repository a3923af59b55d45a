"""collective-buffer: no buffer of an issued collective is written or freed before its wait.

Hand-built graphs break the rule the three ways a pass or the eager runtime could (an
in-place write, a buffer taken by reuse_dead_buffers, a free by the runtime) and are caught;
the real pipeline's final graphs for the test and benchmark models keep it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import spmd
from benchmarks.bench import models as bench_models
from passes import collectives as C
from passes.invariants import INPUT_HELD, InvariantViolation, check_collective_buffers, check_invariants
from passes.meta import Phase, Role
from passes.reuse import REUSED, reuse_dead_buffers
from spmd.backend.runtime import check_final_graph
from spmd.errors import PassError
from tests import models
from tests.unit.passes.graphs import Builder, aten, c10d


def _issued(b: Builder, x: fx.Node) -> fx.Node:
    """all_to_all_single(x) issued, its wait not yet placed; returns the collective."""
    b.phase = Phase.BACKWARD
    n = x.meta["val"].shape[0] // 2
    return b.op(c10d.all_to_all_single.default, x, [n, n], [n, n], "0", role=Role.COMM)


def _rules(gm: fx.GraphModule) -> set[str]:
    with pytest.raises(InvariantViolation) as info:
        check_invariants(gm)
    return info.value.rules


def test_an_in_place_write_before_the_wait_is_caught() -> None:
    """x = mul(g, 3) -> a2a(x) -> add_(x, 1) -> wait: the thread still sends x."""
    b = Builder()
    g = b.input("g", 8, 3, role=Role.GRAD)
    x = b.op(aten.mul.Tensor, g, 3.0)
    coll = _issued(b, x)
    write = b.op(aten.add_.Tensor, x, 1.0)
    wait = b.op(c10d.wait_tensor.default, coll, role=Role.COMM)
    gm = b.finish(wait, write)
    ((node, msg),) = check_collective_buffers(gm)
    assert node == write.name and f"writes {x.name} in place" in msg and coll.name in msg and wait.name in msg
    assert _rules(gm) == {"collective-buffer"}


def test_the_same_write_after_the_wait_passes() -> None:
    b = Builder()
    g = b.input("g", 8, 3, role=Role.GRAD)
    x = b.op(aten.mul.Tensor, g, 3.0)
    coll = _issued(b, x)
    wait = b.op(c10d.wait_tensor.default, coll, role=Role.COMM)
    write = b.op(aten.add_.Tensor, x, 1.0)
    gm = b.finish(wait, write)
    assert check_collective_buffers(gm) == []
    check_invariants(gm)


def test_an_in_place_all_reduce_of_an_in_flight_buffer_is_caught() -> None:
    """x -> all_gather(x) -> all_reduce_(view of x) -> waits: the all-reduce writes the gather's input."""
    b = Builder()
    g = b.input("g", 8, 3, role=Role.GRAD)
    x = b.op(aten.mul.Tensor, g, 3.0)
    b.phase = Phase.BACKWARD
    gather = b.op(c10d.all_gather_into_tensor.default, x, 2, "0", role=Role.COMM)
    v = b.op(aten.view.default, x, [24])
    ar = b.op(c10d.all_reduce_.default, v, "sum", "0", role=Role.COMM)
    w1 = b.op(c10d.wait_tensor.default, ar, role=Role.COMM)
    w2 = b.op(c10d.wait_tensor.default, gather, role=Role.COMM)
    found = check_collective_buffers(b.finish(w1, w2))
    assert [n for n, _ in found] == [ar.name] and "the in-place collective" in found[0][1]


def test_reuse_before_the_wait_is_caught_and_reuse_dead_buffers_does_not_make_it() -> None:
    """x = mul(g, 3) -> a2a(x) -> y = mul(x, x) -> wait: x's last reader is y, before the wait.

    reuse_dead_buffers would once have written y into x (x "dies" at y); the process group
    still sends x until the wait."""
    b = Builder()
    g = b.input("g", 8, 3, role=Role.GRAD)
    x = b.op(aten.mul.Tensor, g, 3.0)
    coll = _issued(b, x)
    y = b.op(aten.mul.Tensor, x, x)
    wait = b.op(c10d.wait_tensor.default, coll, role=Role.COMM)
    gm = b.finish(wait, y)
    assert reuse_dead_buffers(gm) is gm and REUSED not in y.meta  # not taken: in flight
    # The rewrite the pass used to make, by hand: y = mul.out(x, x, out=x).
    y.target = aten.mul.out
    y.kwargs = {"out": x}
    y.meta["val"] = x.meta["val"]
    y.meta[REUSED] = x.name
    ((node, msg),) = check_collective_buffers(gm)
    assert node == y.name and "reuse_dead_buffers made" in msg and coll.name in msg


def test_the_same_op_after_the_wait_is_reused() -> None:
    """... -> wait -> y = mul(x, x): x is no longer in flight, and reuse takes it."""
    b = Builder()
    g = b.input("g", 8, 3, role=Role.GRAD)
    x = b.op(aten.mul.Tensor, g, 3.0)
    coll = _issued(b, x)
    wait = b.op(c10d.wait_tensor.default, coll, role=Role.COMM)
    y = b.op(aten.mul.Tensor, x, x)
    gm = reuse_dead_buffers(b.finish(wait, y))
    assert y.meta.get(REUSED) == x.name
    assert check_collective_buffers(gm) == []


def test_a_free_before_the_wait_is_caught_where_the_process_group_does_not_hold_the_input() -> None:
    """x = mul(g, 3) -> a2a(x) -> wait: the runtime drops x right after the issue. Safe only
    because the process group holds an all-to-all's input (INPUT_HELD, measured; see
    tests/dist/test_collective_refs.py): for a collective that did not, x would be freed."""
    b = Builder()
    g = b.input("g", 8, 3, role=Role.GRAD)
    x = b.op(aten.mul.Tensor, g, 3.0)
    coll = _issued(b, x)
    other = b.op(aten.relu.default, g)  # something runs while the all-to-all is in flight
    wait = b.op(c10d.wait_tensor.default, coll, role=Role.COMM)
    gm = b.finish(wait, other)
    assert coll.target in INPUT_HELD and check_collective_buffers(gm) == []
    ((node, msg),) = check_collective_buffers(gm, input_held=frozenset())
    assert node == coll.name and f"frees {x.name} after {coll.name}" in msg and wait.name in msg
    # A placeholder's buffer is never freed by the runtime.
    b2 = Builder()
    g2 = b2.input("g", 8, 3, role=Role.GRAD)
    c2 = _issued(b2, g2)
    gm2 = b2.finish(b2.op(c10d.wait_tensor.default, c2, role=Role.COMM), b2.op(aten.relu.default, g2))
    assert check_collective_buffers(gm2, input_held=frozenset()) == []


def test_check_final_graph_refuses_a_violation() -> None:
    b = Builder()
    g = b.input("g", 8, 3, role=Role.GRAD)
    x = b.op(aten.mul.Tensor, g, 3.0)
    coll = _issued(b, x)
    write = b.op(aten.add_.Tensor, x, 1.0)
    gm = b.finish(b.op(c10d.wait_tensor.default, coll, role=Role.COMM), write)
    with pytest.raises(PassError, match="collective-buffer"):
        check_final_graph(gm)


# ------------------------------------------------------------------ the real pipeline's graphs


@pytest.fixture
def fake_two_ranks(monkeypatch):
    """World size 2 under the fake process group, with the gloo-only rewrites on (the passes
    are graph transforms; which backend runs the graph does not change what they do)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import spmd.pipeline

    monkeypatch.setattr(spmd.pipeline, "all_gloo", lambda gm: True)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()
    from spmd.parallel import sharding

    sharding._DEFAULT_MESHES.clear()


def _bench_gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], object]:
    spec = bench_models.get("gpt", quick=True)
    return spec.build(), spec.batch(torch.Generator().manual_seed(0)), spec.loss


CASES = [
    ("tinygpt", "fully_shard", False),
    ("llama", "fully_shard", True),
    ("bench_gpt", "replicate", False),
]


@pytest.mark.parametrize(("name", "style", "carry"), CASES)
def test_the_pipeline_keeps_the_invariant(fake_two_ranks, name: str, style: str, carry: bool) -> None:
    """The final graphs of the test and benchmark models, with every buffer-touching pass that
    applies: all-to-all reduce-scatters (fully_shard), in-place all-reduces (replicate),
    reuse_dead_buffers, and (carry) a gather in flight across calls."""
    if name == "bench_gpt":
        model, batch, loss = _bench_gpt()

        def step_fn(model, opt, x, y):
            out = loss(model(x), y)  # type: ignore[operator]
            out.backward()
            opt.step()
            opt.zero_grad()
            return out
    else:
        model, batch, step_fn = models.build(name), models.batches(name, 1)[0], models.train_step
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile(
        parallel_mode=spmd.DataParallel(style), cross_step_prefetch=carry, check_invariants=True
    )(step_fn)
    gm = step.lower(model, opt, *batch)["final"]
    kinds = {C.kind_of(c) for c in C.collectives(gm.graph)}
    targets = {n.target for n in gm.graph.nodes}
    if style == "fully_shard":
        assert C.Kind.ALL_TO_ALL in kinds and C.Kind.REDUCE_SCATTER not in kinds
    else:
        assert c10d.all_reduce_.default in targets
    if name != "llama":
        assert any(REUSED in n.meta for n in gm.graph.nodes)  # the logits' buffers are reused
    assert check_collective_buffers(gm) == []
