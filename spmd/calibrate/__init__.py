"""Measure this machine for the cost model: the ``cpu-local`` device profile.

    python -m spmd.calibrate                 # writes ~/.cache/spmd/cpu-local.json
    python -m spmd.calibrate --out prof.json --threads 1

What it measures (about 50 s idle), each as the median of several repeats:

- matmul FLOP/s per dtype (fp32, bf16) at ``--threads`` threads (the bench runs 1 per rank);
- memory bandwidth: a large ``add`` (reads two tensors, writes one);
- per-op overhead: a graph of 1-element ``add``s run as fx runs a step's graph (generated
  Python, dispatch, a fresh output: what an op without a curve pays), and of ``aten.t`` views
  (``view_overhead_s``);
- the time of one fp32 call by size (``op_curves``, issue 22: the roofline of one big matmul
  and one big add under-predicted every step): ``mm`` at shapes from 16^3 to 1k x 1k x 1k in the
  three layouts of a layer's forward and gradients (by FLOPs); a binary add (every op without
  its own curve) and the common non-matmul ops of a step (gelu, silu, layer norm, softmax,
  log-softmax and their backward, sum, clone) from 64 to 2M elements, in cache and out (by
  bytes); CPU flash attention forward and backward (by FLOPs);
- ``addmm`` (a linear layer's forward with its bias) by FLOPs at the matmul shapes; a fused
  AdamW step by bytes (the ``"optimizer"`` curve); each view op of a step's graph (``t``,
  ``view``, ``as_strided``, ``detach``, ...: one point each, its call in a graph);
- how much more a call costs in a step than alone (``mixed_call_factor``): a graph mixing tiny
  ops of nine kinds against each kind alone (each run after another kind finds the host's
  caches cold for it), and the same for whole calls by their length (``mixed_call_curve``: the
  nine ops at five operand sizes, calls of 5 us to 0.5 ms: a step's first call of an op after
  other kinds took 1.8-5x the same call repeated, matmuls of 20 us included);
- the first touch of a fresh allocation by size (``fresh_alloc_curve``): above glibc's mmap
  threshold every allocation is mapped anew and page-faults as it is written;
- the per-tensor cost of a fused optimizer step over many tiny tensors (``per_tensor_s``), and
  the fixed and per-tensor cost of each op that loops over its tensors (``call_costs``): the
  all-gather copy-in and copy-out and the aligned fused optimizer of a fully_shard step (Python
  per shard; padded shards apart), fused AdamW, ``_foreach_add_`` (one dispatch per tensor on
  CPU), the copies of a list into one buffer (``cat``, ``_chunk_cat``, ``stack``) and the views
  with an output per piece (``split_with_sizes``, ``unbind``), each from calls on 1 and 32 tiny
  tensors per list (or outputs);
- gloo between 2 local processes, through the functional collectives a step's graph calls
  (each with its ``wait_tensor``): latency of a 4-byte all-reduce (two ring steps), and
  the bus bandwidth of a 16 MiB all-reduce, all-gather, reduce-scatter and all-to-all,
  each with the ring's factor taken out (``passes.cost_model.ring_bus_factor``);
- how much compute and a collective overlap: a 16 MiB all-reduce issued, matmuls of about
  its length run, then waited, against the two alone (``comm_compute_overlap``: 1 = fully
  hidden, 0 = one after the other, as when gloo's thread and the compute share a core);
- a small collective as a step pays it (``collective_host_s``): 20 all-gathers of 64 KiB, each
  issued before 2 ms of matmuls and waited after them, against the matmuls alone;
- the same collectives through shared memory (``spmd.backend.shm``, what a compiled step of this
  host's ranks runs; where the two ranks can map it): a 64 KiB all-gather for the fixed cost of a
  call (``shm_call_s``), and each kind at 16 MiB for its rate (``shm_bandwidth_by_kind``).

A measurement on a loaded machine is a measurement of that load: the json records when
and with what command it was taken, so it can be re-taken.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import statistics
from collections.abc import Callable
from typing import Any

import torch

from passes import torch_compat
from passes.cost_model import DeviceProfile, ring_bus_factor
from spmd.backend.bound_ops import bind_ops
from spmd.calibrate.calls import (
    measure_call_costs,
    measure_mixed_call_curve,
    measure_mixed_call_factor,
    measure_optimizer_curve,
    measure_view_costs,
)
from spmd.calibrate.timing import _NUMELS, _best, _curve, _in_graph
from spmd.profiles import CPU_LOCAL

_COMM_BYTES = 16 * 2**20
# The interleaved-collective measurement: a 64 KiB all-gather (a small unit's parameters) issued
# before about 2 ms of matmuls and waited after them (longer than the gather at 2 ranks here, so
# the wait finds it done), 20 times.
_UNIT_BYTES = 64 * 2**10
_HIDE_S = 2e-3
_N_INTERLEAVED = 20


# A reading of the roofline constants (the matmul rate, the add bandwidth) is the median of this
# many calls of its function, each on fresh operands: one call (itself the median of 5 repeats of
# at least 20 ms) varied 2x from call to call on the idle machine (benchmarks/plan_validation/probe_check.py,
# 2026-11-25 16:38: 43.1 and 87.8 GFLOP/s on the two ranks at the same point), so a single call
# says little about the machine. Five: the fewest whose median ignores two outliers.
READINGS = 5


def median_reading(measure: Callable[[], float], readings: int = READINGS) -> float:
    """The median of ``readings`` calls of ``measure`` (see :data:`READINGS`)."""
    return statistics.median(measure() for _ in range(readings))


def probe_readings(readings: int = READINGS) -> tuple[list[float], list[float]]:
    """``readings`` calls each of the fp32 matmul rate and the add bandwidth (FLOP/s, bytes/s):
    the probe ``benchmarks/plan_validation/plan_check.py`` takes during its rounds, against the same two
    constants in :func:`measure_compute`."""
    flops = [measure_matmul(torch.float32) for _ in range(readings)]
    return flops, [measure_memory_bandwidth() for _ in range(readings)]


def probe(readings: int = READINGS) -> tuple[float, float]:
    """(fp32 matmul FLOP/s, add bandwidth): the medians of :func:`probe_readings`, as
    :func:`measure_compute` measures its ``peak_flops["fp32"]`` and ``memory_bandwidth``."""
    flops, bandwidth = probe_readings(readings)
    return statistics.median(flops), statistics.median(bandwidth)


def measure_matmul(dtype: torch.dtype, n: int = 512, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    t = _best(lambda: torch.mm(a, b, out=out), repeats, inner=4)
    return 2 * n**3 / t


def measure_memory_bandwidth(numel: int = 16 * 2**20, repeats: int = 5) -> float:
    a, b = torch.randn(numel), torch.randn(numel)
    out = torch.empty(numel)
    t = _best(lambda: torch.add(a, b, out=out), repeats)
    return 3 * numel * 4 / t


def measure_op_overhead(repeats: int = 5, n_ops: int = 200) -> float:
    """Seconds per op of a GraphModule of ``n_ops`` one-element adds, as a compiled step's
    final graph runs (its code with the operators bound, the dispatcher, a fresh output each)."""
    import torch.fx as fx

    g = fx.Graph()
    x = y = g.placeholder("x")
    for _ in range(n_ops):
        y = g.call_function(torch.ops.aten.add.Tensor, (y, x))
    g.output(y)
    run = bind_ops(fx.GraphModule(torch.nn.Module(), g))
    one = torch.ones(1)
    return _best(lambda: run(one), repeats, inner=10) / n_ops


# (m, k, n) of the matmul curve: the shapes of a layer's forward (batch x d -> 4d), its input
# gradient and its weight gradient (k = the batch, the transposed operand) at a few widths, from
# a few-row MLP to a 1k x 1k x 8k head; keyed by FLOPs (the same FLOPs in another shape runs at
# about the same rate on this CPU's BLAS: within ~20% in the shapes above).
_MATMUL_SHAPES = (
    (16, 16, 16),
    (32, 64, 256),
    (256, 32, 64),
    (128, 128, 128),
    (256, 256, 1024),
    (1024, 256, 256),
    (512, 512, 512),
    (1024, 256, 2048),
    (1024, 1024, 1024),
)


# Element counts of the elementwise / reduction curves: in L1, L2, the last-level cache, and two
# past it (8 MiB and 32 MiB per tensor: a step's logits). Above the last point a curve keeps that
# point's rate; with 8 MiB the last, a fused AdamW over a 7M-parameter GPT was priced at 0.65
# ns/element where it runs at 1.0 (DRAM: measured here 2026-11-25, 2M vs 8M elements).
def measure_matmul_curves(repeats: int = 5) -> dict[str, list[list[float]]]:
    """[[FLOPs, seconds], ...] of fp32 ``mm`` calls with a fresh output, as a graph's mm runs,
    at the shapes ``_MATMUL_SHAPES``, each the mean of three operand layouts (``"matmul"``, the
    curve of every matmul-class op without its own), and of ``addmm`` (a linear layer's forward
    with its bias: ``x @ W^T + b``, ``"aten.addmm"``; the bias costs small matmuls up to 2x)."""
    aten = torch.ops.aten
    pts = []
    addmm = []
    for m, k, n in _MATMUL_SHAPES:
        # The three layouts a step's matmuls come in: forward (x @ W^T), input gradient
        # (g @ W), weight gradient (g^T @ x); the point is their mean. Timed in a graph.
        for a, b in (
            (torch.randn(m, k), torch.randn(n, k).t()),
            (torch.randn(m, k), torch.randn(k, n)),
            (torch.randn(k, m).t(), torch.randn(k, n)),
        ):
            pts.append((2 * m * k * n, _in_graph(aten.mm.default, (a, b), repeats)))
        if m * k * n <= 512**3:  # above, the bias is noise (and the curve's last rate holds)
            x, w = torch.randn(m, k), torch.randn(n, k).t()
            addmm.append((2 * m * k * n, _in_graph(aten.addmm.default, (torch.randn(n), x, w), repeats)))
    return {"matmul": _curve(pts), "aten.addmm": _curve(addmm)}


def _op_cases(numel: int) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """One call of each op with its own curve, on ``numel`` fp32 elements (rows of 256 where
    the op works by rows), as the graph calls it (functional: a fresh output): key -> (op, args)."""
    aten = torch.ops.aten
    d = 256 if numel >= 256 else numel
    x = torch.randn(numel // d, d)
    g = torch.randn(numel // d, d)
    w, bias = torch.randn(d), torch.randn(d)
    _, mean, rstd = aten.native_layer_norm(x, [d], w, bias, 1e-5)
    ls = aten._log_softmax(x, 1, False)
    sm = aten._softmax(x, 1, False)
    return {
        "memory": (aten.add.Tensor, (x, g)),
        "aten.clone": (aten.clone.default, (x,)),
        "aten.sum": (aten.sum.dim_IntList, (x, [0], True)),
        "aten.gelu": (aten.gelu.default, (x,)),
        "aten.gelu_backward": (aten.gelu_backward.default, (g, x)),
        "aten.silu": (aten.silu.default, (x,)),
        "aten.silu_backward": (aten.silu_backward.default, (g, x)),
        "aten.native_layer_norm": (aten.native_layer_norm.default, (x, [d], w, bias, 1e-5)),
        "aten.native_layer_norm_backward": (
            aten.native_layer_norm_backward.default,
            (g, x, [d], mean, rstd, w, bias, [True, True, True]),
        ),
        "aten._log_softmax": (aten._log_softmax.default, (x, 1, False)),
        "aten._log_softmax_backward_data": (aten._log_softmax_backward_data.default, (g, ls, 1, x.dtype)),
        "aten._softmax": (aten._softmax.default, (x, 1, False)),
        "aten._softmax_backward_data": (aten._softmax_backward_data.default, (g, sm, 1, x.dtype)),
    }


def measure_op_curves(repeats: int = 5) -> dict[str, list[list[float]]]:
    """Per op (and "memory": a binary add, the fallback of every op without its own curve):
    [[bytes, seconds], ...] at the element counts ``_NUMELS``, each call timed in a graph
    (:func:`_in_graph`). Bytes as the cost model counts them for that call
    (``passes.cost_model.node_bytes``: tensor inputs and outputs)."""
    from passes.torch_compat import pytree

    pts: dict[str, list[tuple[float, float]]] = {}
    for numel in _NUMELS:
        for key, (target, args) in _op_cases(numel).items():
            out = target(*args)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            pts.setdefault(key, []).append((nbytes, _in_graph(target, args, repeats)))
    return {k: _curve(v) for k, v in pts.items()}


def measure_attention_curves(repeats: int = 3) -> dict[str, list[list[float]]]:
    """CPU flash attention forward and backward (causal, fp32): [[FLOPs, seconds], ...] by
    torch's SDPA FLOP formula, at a few (batch, heads, seq, head dim)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    fwd: list[tuple[float, float]] = []
    bwd: list[tuple[float, float]] = []
    for b, h, s, d in ((1, 2, 32, 16), (2, 4, 128, 32), (8, 8, 128, 32), (2, 8, 512, 64)):
        q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
        go = torch.randn_like(out)
        fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default
        t_f = _in_graph(fwd_op, (q, k, v, 0.0, True), repeats)
        t_b = _in_graph(
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            (go, q, k, v, out, lse, 0.0, True),
            repeats,
        )
        fwd.append((fc.sdpa_flop_count(q.shape, k.shape, v.shape), t_f))
        bwd.append((fc.sdpa_backward_flop_count(go.shape, q.shape, k.shape, v.shape), t_b))
    return {
        "aten._scaled_dot_product_flash_attention_for_cpu": _curve(fwd),
        "aten._scaled_dot_product_flash_attention_for_cpu_backward": _curve(bwd),
    }


def _fill_fresh(n: int) -> None:
    torch.empty(n).fill_(1.0)


def measure_fresh_alloc_curve(repeats: int = 5) -> list[list[float]]:
    """[[bytes, seconds], ...]: what writing a freshly allocated tensor costs beyond writing
    an existing one (``empty(n).fill_`` against ``fill_``), from 1 MiB to 128 MiB. Small
    allocations come from the allocator's free lists (about 0); large ones are mapped anew
    each time (glibc's mmap threshold: at most 32 MiB) and each page faults on first touch."""
    pts = []
    for mib in (1, 8, 16, 32, 64, 128):
        n = mib * 2**20 // 4
        warm = torch.empty(n)
        t_warm = _best(functools.partial(warm.fill_, 1.0), repeats)
        t_fresh = _best(functools.partial(_fill_fresh, n), repeats)
        pts.append((mib * 2**20, max(t_fresh - t_warm, 1e-7)))
    return _curve(pts)


def measure_view_overhead(repeats: int = 5, n_ops: int = 200) -> float:
    """Seconds per view op (``aten.t``) of a GraphModule of ``n_ops`` of them: a view is a
    dispatch and a new tensor header, no kernel."""
    import torch.fx as fx

    g = fx.Graph()
    y = g.placeholder("x")
    for _ in range(n_ops):
        y = g.call_function(torch.ops.aten.t.default, (y,))
    g.output(y)
    run = bind_ops(fx.GraphModule(torch.nn.Module(), g))
    x = torch.ones(4, 4)
    return _best(lambda: run(x), repeats, inner=10) / n_ops


def measure_per_tensor(repeats: int = 5, n: int = 256) -> float:
    """Seconds per tensor of a fused AdamW step over ``n`` one-element tensors (the per-tensor
    loop of a foreach / fused optimizer op, bytes negligible)."""
    ps = [torch.zeros(1) for _ in range(4 * n)]
    p, g, m, v = ps[:n], ps[n : 2 * n], ps[2 * n : 3 * n], ps[3 * n :]
    steps = [torch.zeros(()) for _ in range(n)]
    lr = torch.tensor(1e-3)

    def step() -> None:
        torch_compat.fused_adamw_(
            p, g, m, v, [], steps, lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8,
            amsgrad=False, maximize=False,
        )  # fmt: skip

    return _best(step, repeats, inner=5) / n


# The view ops of a step's graph, each on a tensor of the shape a step gives it: its call (the
# dispatch, a new tensor header, fx's Python around it) timed in a graph as a step runs it.
def measure_compute() -> dict[str, Any]:
    """This process's compute constants: the profile fields ``peak_flops``, ``memory_bandwidth``,
    ``op_overhead_s``, ``view_overhead_s``, ``per_tensor_s``, ``call_costs``,
    ``mixed_call_factor``, ``mixed_call_curve``, ``op_curves`` and ``fresh_alloc_curve`` (about
    30 s)."""
    curves = {
        **measure_matmul_curves(),
        **measure_op_curves(),
        **measure_attention_curves(),
        **measure_optimizer_curve(),
        **measure_view_costs(),
    }
    return {
        "peak_flops": {
            "fp32": median_reading(lambda: measure_matmul(torch.float32)),
            "bf16": median_reading(lambda: measure_matmul(torch.bfloat16, n=256)),
        },
        "memory_bandwidth": median_reading(measure_memory_bandwidth),
        "op_overhead_s": measure_op_overhead(),
        "view_overhead_s": measure_view_overhead(),
        "per_tensor_s": measure_per_tensor(),
        "call_costs": measure_call_costs(),
        "mixed_call_factor": measure_mixed_call_factor(),
        "mixed_call_curve": measure_mixed_call_curve(),
        "op_curves": curves,
        "fresh_alloc_curve": measure_fresh_alloc_curve(),
    }


def _gloo_worker(rank: int, init: str, q: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        # The functional collectives and their waits: what a compiled step's graph calls.
        f = torch.ops._c10d_functional
        name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        small = torch.ones(1)
        n = _COMM_BYTES // 4
        big = torch.ones(n)
        half = torch.ones(n // 2)

        def timed(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
            dist.barrier()
            return _best(lambda: f.wait_tensor(fn()), repeats, inner, window=False)

        a = torch.randn(256, 256)
        mm_s = _best(lambda: torch.mm(a, a), 5, inner=10, window=False)
        ar_s = timed(lambda: f.all_reduce(big, "sum", name), 5)
        k = max(1, round(ar_s / mm_s))

        def compute() -> None:
            for _ in range(k):
                torch.mm(a, a)

        def both() -> None:
            w = f.all_reduce(big, "sum", name)
            compute()
            f.wait_tensor(w)

        alone_s = _best(compute, 5, window=False)
        dist.barrier()
        both_s = _best(both, 5, window=False)

        # A small collective as a step pays it: issued, compute that outlasts it, then waited
        # (so the wait does not block on the wire): what the host pays beyond the compute.
        unit = torch.ones(_UNIT_BYTES // 4)
        n_mm = max(1, round(_HIDE_S / mm_s))

        def work() -> None:
            for _ in range(n_mm):
                torch.mm(a, a)

        def with_collectives() -> None:
            for _ in range(_N_INTERLEAVED):
                w = f.all_gather_into_tensor(unit, 2, name)
                work()
                f.wait_tensor(w)

        def without() -> None:
            for _ in range(_N_INTERLEAVED):
                work()

        dist.barrier()
        plain_s = _best(without, 3, window=False)
        dist.barrier()
        inter_s = _best(with_collectives, 3, window=False)
        res = {
            # How much of the shorter one hides behind the other when both run at once.
            "overlap": (alone_s + ar_s - both_s) / min(alone_s, ar_s),
            "collective_host": (inter_s - plain_s) / _N_INTERLEAVED,
            "latency_all_reduce": timed(lambda: f.all_reduce(small, "sum", name), 5, inner=50),
            "all_reduce": timed(lambda: f.all_reduce(big, "sum", name), 5),
            "all_gather": timed(lambda: f.all_gather_into_tensor(half, 2, name), 5),
            "reduce_scatter": timed(lambda: f.reduce_scatter_tensor(big, "sum", 2, name), 5),
            "all_to_all": timed(lambda: f.all_to_all_single(big, [n // 2] * 2, [n // 2] * 2, name), 5),
        }
        # The same collectives through shared memory (spmd.backend.shm: what a compiled step on
        # this host's ranks runs): a small all-gather for the fixed cost of a call, then each kind
        # at the large size.
        from spmd.backend import shm

        group = dist.group.WORLD
        if group is not None and shm.transports([group]) == {name: 2}:
            s = torch.ops.spmd_shm
            res["shm_call"] = timed(lambda: s.all_gather_into_tensor(unit, 2, name), 5, inner=20)
            res["shm_all_gather"] = timed(lambda: s.all_gather_into_tensor(half, 2, name), 5)
            res["shm_all_reduce"] = timed(lambda: s.all_reduce(big, "sum", name), 5)
            res["shm_reduce_scatter"] = timed(lambda: s.reduce_scatter_tensor(big, "sum", 2, name), 5)
            res["shm_all_to_all"] = timed(
                lambda: s.all_to_all_single(big, [n // 2] * 2, [n // 2] * 2, name), 5
            )
        if rank == 0:
            q.put(res)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_gloo() -> dict[str, float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, f"tcp://127.0.0.1:{port}", q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res: dict[str, float] = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    return res


def calibrate(threads: int = 1) -> DeviceProfile:
    """Measure this machine (see the module docstring) and return its profile."""
    torch.set_num_threads(threads)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = f"python -m spmd.calibrate --threads {threads} on {socket.gethostname()}, {when}"
    c = measure_compute()
    g = measure_gloo()
    # A 4-byte all-reduce at 2 ranks: two ring steps of pure latency.
    lat = g["latency_all_reduce"] / 2
    by_kind: dict[str, float] = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        steps = 2 if kind == "all_reduce" else 1
        t = max(g[kind] - steps * lat, 1e-9)
        by_kind[kind] = _COMM_BYTES * ring_bus_factor(kind, 2) / t
    overlap = min(max(g["overlap"], 0.0), 1.0)
    # What the interleaved collectives cost the host, less what the model already charges them
    # (the launch, and the share of their wire time the compute loses: 1 - overlap).
    unit_t = lat + _UNIT_BYTES * ring_bus_factor("all_gather", 2) / by_kind["all_gather"]
    host = max(g["collective_host"] - c["op_overhead_s"] - (1.0 - overlap) * unit_t, 0.0)
    # Shared memory (where the two ranks could map it): a call's fixed cost, and per kind the bytes
    # (``bytes_of``'s count) a second moves beyond it.
    shm_call = g.get("shm_call", 0.0)
    shm_bw = {
        kind: _COMM_BYTES / max(g[f"shm_{kind}"] - shm_call, 1e-9)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        if f"shm_{kind}" in g
    }
    return DeviceProfile(
        name=CPU_LOCAL,
        peak_flops=c["peak_flops"],
        memory_bandwidth=c["memory_bandwidth"],
        intra_node_bandwidth=by_kind["all_reduce"],
        inter_node_bandwidth=by_kind["all_reduce"],
        intra_node_latency_s=lat,
        inter_node_latency_s=lat,
        gpus_per_node=os.cpu_count() or 1,
        op_overhead_s=c["op_overhead_s"],
        view_overhead_s=c["view_overhead_s"],
        per_tensor_s=c["per_tensor_s"],
        call_costs=c["call_costs"],
        mixed_call_factor=c["mixed_call_factor"],
        mixed_call_curve=c["mixed_call_curve"],
        op_curves=c["op_curves"],
        fresh_alloc_curve=c["fresh_alloc_curve"],
        comm_compute_overlap=overlap,
        collective_host_s=host,
        bandwidth_by_kind=by_kind,
        shm_call_s=shm_call,
        shm_bandwidth_by_kind=shm_bw,
        sources={
            k: "measured: " + cmd
            for k in (
                "peak_flops",
                "memory_bandwidth",
                "op_overhead_s",
                "view_overhead_s",
                "per_tensor_s",
                "call_costs",
                "mixed_call_factor",
                "mixed_call_curve",
                "op_curves",
                "fresh_alloc_curve",
                "gloo",
                "collective_host_s",
                "shm",
            )
        },
    )
