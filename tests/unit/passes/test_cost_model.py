"""passes.cost_model on hand-built graphs: overlap shows, formulas are what they say.

The profile below is made up (round numbers, one of each kind) so a matmul and a gather
take comparable times; the tests assert orderings and relations, not times.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from passes import collectives as C
from passes.cost_model import (
    DeviceProfile,
    GroupInfo,
    causal_share,
    collective_time,
    compute_time,
    estimate_step_time,
    free_time,
    interpolate,
    node_bytes,
    node_flops,
    op_class,
)
from passes.meta import Role
from passes.shm_collectives import shared_memory_collectives
from tests.unit.passes.graphs import Builder, aten

PROFILE = DeviceProfile(
    name="test",
    peak_flops={"fp32": 1e9},
    memory_bandwidth=1e10,
    intra_node_bandwidth=1e7,
    inter_node_bandwidth=1e6,
    intra_node_latency_s=1e-5,
    inter_node_latency_s=1e-4,
    gpus_per_node=2,
)
GROUPS = {"0": GroupInfo(size=2, spans_nodes=False)}


def _gather_then_matmul(prefetch: bool):
    """Prefetched:  ag(p) ; mm(x, x) ; wait ; add(wait, mm)
    At first use:  mm(x, x) ; ag(p) ; wait ; add(wait, mm)"""
    b = Builder(world_size=2)
    x = b.input("x", 256, 256)
    p = b.input("p", 128, 256)
    if prefetch:
        wait = b.all_gather(p)
        mm = b.op(aten.mm.default, x, x)
        mm.append(wait)
    else:
        mm = b.op(aten.mm.default, x, x)
        wait = b.all_gather(p)
    out = b.op(aten.add.Tensor, wait, mm)
    return b.finish(out)


def test_prefetched_gather_hides_behind_compute_and_a_late_one_is_exposed() -> None:
    early = estimate_step_time(_gather_then_matmul(True), PROFILE, GROUPS)
    late = estimate_step_time(_gather_then_matmul(False), PROFILE, GROUPS)
    # Same work either way.
    assert early.compute_s == pytest.approx(late.compute_s)
    assert early.comm_s == pytest.approx(late.comm_s) and early.comm_s > 0
    # The matmul outlasts the gather here, so issued before it the gather is hidden entirely.
    assert early.compute_s > early.comm_s
    assert early.exposed_comm_s == 0
    assert early.step_s == pytest.approx(early.compute_s)
    # Issued at first use, all of it is on the critical path.
    assert late.exposed_comm_s == pytest.approx(late.comm_s)
    assert late.step_s == pytest.approx(late.compute_s + late.comm_s)
    assert early.step_s < late.step_s


def test_communication_that_shares_the_compute_resources_does_not_hide() -> None:
    """With comm_compute_overlap=0 (a CPU whose cores run gloo's threads too) the prefetched
    gather costs as much as an exposed one; in between, in between."""
    serial = DeviceProfile(**{**PROFILE.to_dict(), "comm_compute_overlap": 0.0})
    half = DeviceProfile(**{**PROFILE.to_dict(), "comm_compute_overlap": 0.5})
    gm = _gather_then_matmul(True)
    full = estimate_step_time(gm, PROFILE, GROUPS)
    none = estimate_step_time(gm, serial, GROUPS)
    mid = estimate_step_time(gm, half, GROUPS)
    assert none.step_s == pytest.approx(full.compute_s + full.comm_s)
    assert full.step_s < mid.step_s < none.step_s


def test_a_shared_memory_gather_runs_on_the_compute_stream_as_two_copies() -> None:
    """Through shared memory (passes.shm_collectives) the prefetched gather does not overlap the
    matmul: it is priced on the compute stream, two copies of its bytes at memory bandwidth, and
    its wait is never exposed."""
    gm = _gather_then_matmul(True)
    gloo = estimate_step_time(gm, PROFILE, GROUPS)
    shared_memory_collectives(gm, groups={"0": 2})
    est = estimate_step_time(gm, PROFILE, GROUPS)
    gathered = 256 * 256 * 4
    assert est.comm_s == pytest.approx(4 * gathered / PROFILE.memory_bandwidth)
    assert est.exposed_comm_s == 0
    assert est.step_s == pytest.approx(gloo.compute_s + est.comm_s)


def test_a_calibrated_shared_memory_collective_takes_its_call_and_its_measured_rate() -> None:
    gm = _gather_then_matmul(True)
    plain = estimate_step_time(gm, PROFILE, GROUPS)
    shared_memory_collectives(gm, groups={"0": 2})
    prof = _with(shm_call_s=1e-4, shm_bandwidth_by_kind={"all_gather": 1e9})
    est = estimate_step_time(gm, prof, GROUPS)
    assert est.comm_s == pytest.approx(1e-4 + 256 * 256 * 4 / 1e9)
    assert est.step_s == pytest.approx(plain.compute_s + est.comm_s)
    assert DeviceProfile.from_dict(prof.to_dict()) == prof


def test_collectives_on_different_groups_run_side_by_side_and_on_one_group_in_turn() -> None:
    """ag(p) on group 0, ag(q) on group 0 or 1, then both used: two groups' streams overlap
    (NCCL's per-communicator streams, gloo's per-group threads); one group's run in turn."""

    def two_gathers(second: str):
        b = Builder(world_size=2)
        p = b.input("p", 128, 256)
        q = b.input("q", 128, 256)
        wait_p = b.all_gather(p)
        wait_q = b.all_gather(q, group=second)
        wait_q.append(wait_p)  # both issued before either is waited
        return b.finish(b.op(aten.add.Tensor, wait_p, wait_q))

    groups = {**GROUPS, "1": GroupInfo(size=2, spans_nodes=False)}
    one = estimate_step_time(two_gathers("0"), PROFILE, groups)
    two = estimate_step_time(two_gathers("1"), PROFILE, groups)
    gather = one.comm_s / 2
    assert one.comm_s == pytest.approx(two.comm_s) and gather > 0
    assert one.exposed_comm_s == pytest.approx(2 * gather, rel=0.01)
    assert two.exposed_comm_s == pytest.approx(gather, rel=0.01)


def test_views_and_getitems_cost_nothing() -> None:
    """relu(x) vs relu(x) ; view ; t ; view: the same time."""
    b = Builder()
    x = b.input("x", 64, 64)
    plain = b.finish(b.op(aten.relu.default, x))
    b2 = Builder()
    x2 = b2.input("x", 64, 64)
    r = b2.op(aten.relu.default, x2)
    v = b2.op(aten.view.default, b2.op(aten.t.default, b2.op(aten.view.default, r, [4096])), [64, 64])
    viewed = b2.finish(v)
    t_viewed = estimate_step_time(viewed, PROFILE, GROUPS).step_s
    assert t_viewed == estimate_step_time(plain, PROFILE, GROUPS).step_s


def test_matmul_flops_and_bytes_follow_shapes() -> None:
    """mm(a[m,k], b[k,n]): torch's formula 2mkn; bytes = both inputs + the output."""
    m, k, n = 8, 16, 32
    b = Builder()
    a, w = b.input("a", m, k), b.input("w", k, n)
    mm = b.op(aten.mm.default, a, w)
    b.finish(mm)
    assert node_flops(mm) == 2 * m * k * n
    assert node_bytes(mm) == 4 * (m * k + k * n + m * n)
    relu = Builder()
    node = relu.op(aten.relu.default, relu.input("y", 4, 4))
    assert node_flops(node) == 0  # no formula: priced by bytes


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"])
@pytest.mark.parametrize("spans_nodes", [False, True])
def test_collective_time_is_the_ring_formula(kind: str, spans_nodes: bool) -> None:
    w, nbytes = 8, 3 * 2**20
    got = collective_time(kind, nbytes, GroupInfo(size=w, spans_nodes=spans_nodes), PROFILE)
    bw = PROFILE.inter_node_bandwidth if spans_nodes else PROFILE.intra_node_bandwidth
    lat = PROFILE.inter_node_latency_s if spans_nodes else PROFILE.intra_node_latency_s
    if kind == "all_reduce":  # reduce-scatter then all-gather
        direct = 2 * (w - 1) * lat + 2 * (nbytes / w) * (w - 1) / bw
    elif kind == "broadcast":
        direct = (w - 1) * lat + nbytes / bw
    else:  # W-1 steps, each moving one W-th of the unsharded bytes
        direct = (w - 1) * lat + (nbytes / w) * (w - 1) / bw
    assert got == pytest.approx(direct)
    assert collective_time(kind, nbytes, GroupInfo(size=1, spans_nodes=False), PROFILE) == 0


def test_measured_bandwidth_per_kind_overrides_the_intra_node_one() -> None:
    prof = DeviceProfile(**{**PROFILE.to_dict(), "bandwidth_by_kind": {"all_gather": 2e7}})
    g = GroupInfo(size=2, spans_nodes=False)
    assert collective_time("all_gather", 1e6, g, prof) < collective_time("all_gather", 1e6, g, PROFILE)
    assert collective_time("all_reduce", 1e6, g, prof) == collective_time("all_reduce", 1e6, g, PROFILE)


def test_comm_time_by_kind_adds_up() -> None:
    gm = _gather_then_matmul(False)
    est = estimate_step_time(gm, PROFILE, GROUPS)
    assert set(est.comm_by_kind) == {C.Kind.ALL_GATHER.value}
    assert sum(est.comm_by_kind.values()) == pytest.approx(est.comm_s)


# ----------------------------------------------------------------------------- measured costs (issue 22)


def _with(**fields: object) -> DeviceProfile:
    return DeviceProfile(**{**PROFILE.to_dict(), **fields})


def test_interpolate_is_log_log_between_points_flat_below_and_linear_above() -> None:
    pts = [[1e3, 1e-6], [1e5, 1e-4]]
    assert interpolate(pts, 10) == 1e-6  # a call's fixed cost below the first point
    assert interpolate(pts, 1e4) == pytest.approx(1e-5)  # log-log midpoint
    assert interpolate(pts, 1e6) == pytest.approx(1e-3)  # the last point's throughput above it


def test_a_measured_curve_prices_its_op_instead_of_the_roofline() -> None:
    """mm by a "matmul" curve (by FLOPs), relu by its own curve (by bytes), neg by the "memory"
    fallback; a bf16 op keeps the roofline (the curves are fp32 measurements)."""
    b = Builder()
    x = b.input("x", 64, 64)
    mm = b.op(aten.mm.default, x, x)
    relu = b.op(aten.relu.default, mm)
    neg = b.op(aten.neg.default, relu)
    b.finish(neg)
    curves = {
        "matmul": [[1e3, 1e-6], [1e9, 1e-3]],
        "aten.relu": [[1e2, 2e-6], [1e8, 2e-2]],
        "memory": [[1e2, 3e-6], [1e8, 3e-2]],
    }
    prof = _with(op_curves=curves)
    assert compute_time(mm, prof)[0] == pytest.approx(interpolate(curves["matmul"], node_flops(mm)))
    assert compute_time(relu, prof)[0] == pytest.approx(interpolate(curves["aten.relu"], node_bytes(relu)))
    assert compute_time(neg, prof)[0] == pytest.approx(interpolate(curves["memory"], node_bytes(neg)))
    assert compute_time(mm, prof)[0] != compute_time(mm, PROFILE)[0]
    b2 = Builder()
    h = b2.op(aten.relu.default, b2.input("h", 64, 64, dtype=torch.bfloat16))
    b2.finish(h)
    assert compute_time(h, prof)[0] == compute_time(h, PROFILE)[0]


def test_a_fresh_large_output_pays_its_first_touch_and_an_in_place_op_does_not() -> None:
    """relu(x) allocates 1 MiB: the fresh-allocation curve's time is added; relu_(x) writes x."""
    b = Builder()
    x = b.input("x", 512, 512)
    fresh = b.op(aten.relu.default, x)
    inplace = b.op(aten.relu_.default, x)
    b.finish(fresh, inplace)
    prof = _with(fresh_alloc_curve=[[2**20, 1e-3], [2**30, 1.0]])
    assert compute_time(fresh, prof)[0] == pytest.approx(compute_time(fresh, PROFILE)[0] + 1e-3)
    assert compute_time(inplace, prof)[0] == compute_time(inplace, PROFILE)[0]


def test_each_collective_charges_its_host_cost_to_the_compute_stream() -> None:
    gm = _gather_then_matmul(True)
    host = 1e-3
    base = estimate_step_time(gm, PROFILE, GROUPS)
    paid = estimate_step_time(gm, _with(collective_host_s=host), GROUPS)
    assert paid.compute_s == pytest.approx(base.compute_s + host)
    assert paid.step_s == pytest.approx(base.step_s + host)


def test_op_efficiency_scales_its_class_only() -> None:
    """{"matmul": 0.5}: a compute-bound mm takes twice as long; a memory-bound relu is unchanged."""
    b = Builder()
    x = b.input("x", 256, 256)
    mm = b.op(aten.mm.default, x, x)
    relu = b.op(aten.relu.default, mm)
    b.finish(relu)
    half = _with(op_efficiency={"matmul": 0.5})
    assert compute_time(mm, half)[0] == pytest.approx(2 * compute_time(mm, PROFILE)[0])
    assert compute_time(relu, half)[0] == compute_time(relu, PROFILE)[0]


def test_an_undeclared_view_is_free_and_allocates_nothing() -> None:
    """_unsafe_view (no alias annotation; its fake result shares the input's storage) is a view:
    no bytes moved, no fresh allocation to touch; a clone of the same tensor is not."""
    b = Builder()
    x = b.input("x", 512, 512)
    u = b.op(aten._unsafe_view.default, x, [512 * 512])
    c = b.op(aten.clone.default, x)
    gm = b.finish(u, c)
    prof = _with(fresh_alloc_curve=[[2**20, 1e-3], [2**30, 1.0]])
    est = estimate_step_time(gm, prof, GROUPS)
    assert est.compute_s == pytest.approx(compute_time(c, prof)[0])


def test_the_chunked_loss_head_counts_its_three_matmuls() -> None:
    """spmd::linear_cross_entropy(x[N,D], W[V,D], ...) runs the logits, grad_x and grad_W
    matmuls (2NDV each) over its chunks: 6NDV FLOPs, the same as the unchunked head's three mm,
    and priced as a matmul (by FLOPs), not by its few bytes of inputs and outputs."""
    from passes.linear_cross_entropy import LINEAR_CROSS_ENTROPY, REDUCTION_MEAN

    n, d, v = 64, 32, 512
    b = Builder()
    x, w = b.input("x", n, d), b.input("w", v, d)
    target = b.input("target", n, dtype=torch.int64, role=Role.INPUT)
    grad_loss = b.input("grad_loss", dtype=torch.float32, role=Role.INPUT)
    head = b.op(LINEAR_CROSS_ENTROPY, x, w, target, grad_loss, 16, REDUCTION_MEAN, -100, None)
    b.finish(head)
    mm = Builder()
    mm_node = mm.op(aten.mm.default, mm.input("a", n, d), mm.input("b", d, v))
    mm.finish(mm_node)
    assert node_flops(head) == 6 * n * d * v == 3 * node_flops(mm_node)
    assert op_class(head) == "matmul"
    # Its matmuls by FLOPs (they dominate their bytes here) and the passes over the [rows, V]
    # logits by bytes (passes.cost_model.chunked_head_traffic): written by the mm, log-softmax (3),
    # nll_loss_backward (1), log-softmax backward (3), read by the grad_x and grad_W matmuls.
    elementwise = 10 * n * v * 4 / PROFILE.memory_bandwidth
    assert compute_time(head, PROFILE)[0] == pytest.approx(
        6 * n * d * v / PROFILE.peak_flops["fp32"] + elementwise
    )


def _head(n: int, d: int, v: int, chunk: int, dtype: torch.dtype = torch.float32, logits=None):  # noqa: ANN001, ANN202
    from passes.linear_cross_entropy import LINEAR_CROSS_ENTROPY, REDUCTION_MEAN

    b = Builder()
    x, w = b.input("x", n, d, dtype=dtype), b.input("w", v, d, dtype=dtype)
    target = b.input("target", n, dtype=torch.int64, role=Role.INPUT)
    grad_loss = b.input("grad_loss", dtype=torch.float32, role=Role.INPUT)
    node = b.op(LINEAR_CROSS_ENTROPY, x, w, target, grad_loss, chunk, REDUCTION_MEAN, -100, logits)
    b.finish(node)
    return node


def test_the_chunked_heads_logits_traffic_counts_its_casts() -> None:
    """bf16 activations with float32 logits (the 8B's head under mixed precision): per element of
    the [N, V] logits the mm writes 2 bytes, the cast to float32 moves 6, the log-softmax 12,
    nll_loss_backward 4, its backward 12, the cast back 6, the grad_x matmul reads 2 and, chunked,
    the grad_W accumulation in float32 reads a float32 copy (2 + 8): 54 bytes, where 36 were
    priced before (#39 item 3)."""
    from passes.cost_model import chunked_head_traffic

    n, d, v = 64, 32, 512
    head = _head(n, d, v, 16, torch.bfloat16, torch.float32)
    values = torch.fx.node.map_aggregate(
        (head.args, head.kwargs), lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a
    )
    assert chunked_head_traffic(values) == 54 * n * v
    one = _head(n, d, v, n, torch.bfloat16, torch.float32)  # one chunk: mm(g.T, x) reads g in bf16
    values = torch.fx.node.map_aggregate(
        (one.args, one.kwargs), lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a
    )
    assert chunked_head_traffic(values) == 46 * n * v


def test_a_calibrated_cpu_prices_the_chunked_heads_logits_too() -> None:
    """On a profile with measured curves (spmd.calibrate's CPU) the head's matmuls follow the
    matmul curve by FLOPs and its logits' passes the memory curve by bytes: before, the curve
    priced the op by its FLOPs alone, and the logits' traffic was free."""
    n, d, v = 64, 32, 512
    head = _head(n, d, v, 16)
    matmul = [[1.0, 1e-6], [1e12, 1.0]]
    memory = [[1.0, 2e-6], [1e12, 10.0]]
    cpu = _with(op_curves={"matmul": matmul, "memory": memory})
    by_flops = interpolate(matmul, 6 * n * d * v)
    logits = interpolate(memory, 40 * n * v) - 2e-6
    assert compute_time(head, cpu)[0] == pytest.approx(by_flops + logits)


def test_small_chunks_of_the_loss_head_pay_for_rereading_the_head() -> None:
    """Per chunk, the logits and grad_x matmuls read the whole head W and the grad_W
    accumulation reads and writes it: with few rows per chunk those matmuls are bound by bytes,
    so many small chunks take longer than one (measured on an H100: 256-row chunks of the 8B's
    head cost 25 ms a step more than one chunk); the FLOPs stay 6NDV whatever the chunking."""
    fast = dataclasses.replace(PROFILE, peak_flops={"fp32": 1e13})
    n, d, v = 256, 64, 4096
    one, many = _head(n, d, v, n), _head(n, d, v, 8)
    assert node_flops(one) == node_flops(many)
    assert compute_time(many, fast)[0] > 2 * compute_time(one, fast)[0]


def test_causal_attention_runs_the_unmasked_share_of_its_flops() -> None:
    """sdpa(q, k, v, is_causal=True) on s tokens counts torch's s^2 FLOPs (as FlopCounterMode)
    but a causal kernel runs s(s+1)/2 of them: its roofline time is that share of the
    non-causal op's; a measured curve keeps torch's count (it was measured by it)."""
    s = 64
    b = Builder()
    q, k, v = (b.input(name, 1, 2, s, 16) for name in "qkv")
    attn = aten._scaled_dot_product_flash_attention_for_cpu.default
    causal = b.op(attn, q, k, v, 0.0, True)
    full = b.op(attn, q, k, v, 0.0, False)
    b.finish(causal, full)
    assert node_flops(causal) == node_flops(full) > 0
    share = (s + 1) / (2 * s)
    assert causal_share(causal) == pytest.approx(share) and causal_share(full) == 1.0
    assert compute_time(causal, PROFILE)[0] == pytest.approx(share * compute_time(full, PROFILE)[0])
    curve = _with(op_curves={"attention": [[1.0, 1e-6], [1e9, 1.0]]})
    assert compute_time(causal, curve)[0] == compute_time(full, curve)[0]


def test_a_memory_bound_op_moves_what_it_reads_and_writes_once() -> None:
    """mul(a, b), mul.out(a, b, out=o) and a.add_(b) each read two n-element tensors and write
    one: 3n elements through memory on the roofline, whether the result is fresh, an out=
    buffer (written, not read) or written in place (read once, written once)."""
    n = 1 << 16
    b = Builder()
    x, y, o = b.input("x", n), b.input("y", n), b.input("o", n)
    fresh = b.op(aten.mul.Tensor, x, y)
    out = b.graph.call_function(aten.mul.out, (x, y), {"out": o})
    out.meta["val"] = o.meta["val"]
    inplace = b.op(aten.add_.Tensor, o, y)
    b.finish(fresh, out, inplace)
    want = 3 * 4 * n / PROFILE.memory_bandwidth
    for node in (fresh, out, inplace):
        assert compute_time(node, PROFILE)[0] == pytest.approx(want)


def _call(b, target, *args, **kwargs):  # noqa: ANN001, ANN202
    """A node of ``target(*args, **kwargs)`` (keyword arguments allowed) with its fake value."""
    node = b.graph.call_function(target, args, kwargs)
    vals = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta.get("val"))
    with b.mode:
        out = target(*vals[0], **vals[1])
    if out is not None:
        node.meta["val"] = out
    return node


def test_bytes_read_and_written_once_in_place_out_and_fused() -> None:
    """add(x, y), add_(x, y) and add(x, y, out=z) all read two tensors and write one; a fused
    optimizer that returns nothing reads its lists and writes four of them."""
    b = Builder()
    x, y, z = (b.input(n, 64, 64) for n in "xyz")
    size = 64 * 64 * 4
    assert node_bytes(_call(b, aten.add.Tensor, x, y)) == 3 * size
    assert node_bytes(_call(b, aten.add_.Tensor, x, y)) == 3 * size
    assert node_bytes(_call(b, aten.add.out, x, y, out=z)) == 3 * size
    p, g, m, v = ([b.input(f"{n}{i}", 64, 64) for i in range(2)] for n in "pgmv")
    steps = [b.input(f"s{i}") for i in range(2)]
    lr = b.input("lr")
    opts = dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    adamw = _call(b, aten._fused_adamw_.tensor_lr, p, g, m, v, [], steps, **opts)
    # read p, g, m, v, the steps and lr; write p, g, m, v
    assert node_bytes(adamw) == 2 * (8 * size + 4) + 4


def test_an_op_that_loops_over_its_tensors_pays_its_measured_call_costs() -> None:
    """copy-in of 3 shards, one shorter than its chunk: call + 3 x per_tensor + the padded path
    once (ragged_call + per_ragged) on top of its bytes; without call_costs, its bytes only."""
    from passes import flat_ops

    b = Builder()
    shards = [b.input("a", 8), b.input("b", 8), b.input("c", 5)]
    node = _call(b, flat_ops.COPY_IN, shards, [8, 8, 8], torch.float32)
    costs = {"call": 1e-3, "per_tensor": 1e-4, "ragged_call": 1e-5, "per_ragged": 1e-6}
    prof = _with(call_costs={"spmd.all_gather_copy_in": costs})
    base = compute_time(node, PROFILE)[0] - PROFILE.op_overhead_s
    expect = base + 1e-3 + 3 * 1e-4 + 1e-5 + 1e-6
    assert compute_time(node, prof)[0] == pytest.approx(expect)


def test_a_view_with_its_own_measured_call_pays_it() -> None:
    b = Builder()
    x = b.input("x", 8, 8)
    t = b.op(aten.t.default, x)
    d = b.op(aten.detach.default, x)
    gm = b.finish(t, d)
    prof = _with(op_overhead_s=1e-6, view_overhead_s=2e-6, op_curves={"aten.t": [[0.0, 5e-6]]})
    assert free_time(t, prof) == 5e-6 and free_time(d, prof) == 2e-6
    assert estimate_step_time(gm, prof, GROUPS).compute_s == pytest.approx(7e-6)


def test_a_split_pays_its_measured_cost_per_output() -> None:
    """split_with_sizes into 4 views: call + 4 x per_tensor where measured (``call_costs``)."""
    b = Builder()
    split = b.op(aten.split_with_sizes.default, b.input("x", 8, 8), [2, 2, 2, 2])
    prof = _with(call_costs={"aten.split_with_sizes": {"call": 1e-5, "per_tensor": 1e-6}})
    assert free_time(split, prof) == pytest.approx(1e-5 + 4e-6)


def test_padded_shards_of_the_aligned_optimizer_pay_their_copies() -> None:
    """Two parameters, the second padded: its shard is copied into a zero buffer and back for
    the parameter and both moments (read and written each way), the gradient only in: 14 x its
    bytes, at the "memory" rate."""
    from passes import fused_align

    b = Builder()
    p, g, m, v = ([b.input(f"{n}{i}", 100 + i) for i in range(2)] for n in "pgmv")
    steps = [b.input(f"s{i}") for i in range(2)]
    args = (p, g, m, v, [], steps, [0, 3], [0, 12], [0, 0], "_fused_adamw_.default", "{}")
    node = _call(b, fused_align.ALIGNED_FUSED, *args)
    rate = 1e-9  # seconds per byte
    costs = {"call": 0.0, "per_tensor": 0.0, "ragged_call": 0.0, "per_ragged": 0.0}
    memory = [[1e-3, 1e-3 * rate]]
    prof = _with(call_costs={"spmd.aligned_fused_optimizer_": costs}, op_curves={"memory": memory})
    unpadded = _call(b, fused_align.ALIGNED_FUSED, *args[:6], [0, 0], [0, 0], *args[8:])
    extra = compute_time(node, prof)[0] - compute_time(unpadded, prof)[0]
    assert extra == pytest.approx(14 * 101 * 4 * rate)


def test_a_step_pays_each_call_s_fixed_part_times_the_mixed_call_factor() -> None:
    """The curve's first point (a call on almost no data) and a view's call, x 1.5; the part of an
    op's time above its fixed part is unchanged."""
    b = Builder()
    x = b.input("x", 64, 64)
    relu = b.op(aten.relu.default, x)
    t = b.op(aten.t.default, x)
    b.finish(relu, t)
    curves = {"memory": [[1e2, 3e-6], [1e8, 3e-2]], "aten.t": [[0.0, 2e-6]]}
    plain, mixed = _with(op_curves=curves), _with(op_curves=curves, mixed_call_factor=1.5)
    assert compute_time(relu, mixed)[0] == pytest.approx(compute_time(relu, plain)[0] + 0.5 * 3e-6)
    assert free_time(t, mixed) == pytest.approx(1.5 * free_time(t, plain))


def test_with_a_mixed_call_curve_a_step_pays_the_extra_at_each_call_s_length() -> None:
    """A call of the first point's length pays its extra in place of fixed part x factor; one
    between the points the log-log value; one far above the last point the last point's extra
    (a bounded refill, not a share of its time); a view keeps the factor."""
    b = Builder()
    x = b.input("x", 64, 64)
    relu = b.op(aten.relu.default, x)
    big = b.input("big", 4096, 4096)
    relu_big = b.op(aten.relu.default, big)
    t = b.op(aten.t.default, x)
    b.finish(relu, relu_big, t)
    curves = {"memory": [[1e2, 1e-5], [1e9, 1e-1]], "aten.t": [[0.0, 2e-6]]}
    extra = [[1e-5, 5e-6], [1e-3, 5e-5]]
    plain = _with(op_curves=curves)
    mixed = _with(op_curves=curves, mixed_call_factor=1.5, mixed_call_curve=extra)
    base = compute_time(relu, plain)[0]
    at = interpolate(extra, base)
    assert 5e-6 <= at < 5e-5
    assert compute_time(relu, mixed)[0] == pytest.approx(base + at)
    assert compute_time(relu_big, mixed)[0] == pytest.approx(compute_time(relu_big, plain)[0] + 5e-5)
    assert free_time(t, mixed) == pytest.approx(1.5 * free_time(t, plain))
