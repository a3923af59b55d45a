"""Measure this machine for the cost model: the ``cpu-local`` device profile.

    python -m spmd.calibrate                 # writes ~/.cache/spmd/cpu-local.json
    python -m spmd.calibrate --out prof.json --threads 1

What it measures (about half a minute), each as the median of several repeats:

- matmul FLOP/s per dtype (fp32, bf16) at ``--threads`` threads (the bench runs 1 per rank);
- memory bandwidth: a large ``add`` (reads two tensors, writes one);
- per-op overhead: a graph of 1-element ``add``s run as fx runs a step's graph (generated
  Python, dispatch, a fresh output: what every op of the graph pays);
- gloo between 2 local processes, through the functional collectives a step's graph calls
  (each with its ``wait_tensor``): latency of a 4-byte all-reduce (two ring steps), and
  the bus bandwidth of a 16 MiB all-reduce, all-gather, reduce-scatter and all-to-all,
  each with the ring's factor taken out (``passes.cost_model.ring_bus_factor``);
- how much compute and a collective overlap: a 16 MiB all-reduce issued, matmuls of about
  its length run, then waited, against the two alone (``comm_compute_overlap``: 1 = fully
  hidden, 0 = one after the other, as when gloo's thread and the compute share a core).

A measurement on a loaded machine is a measurement of that load: the json records when
and with what command it was taken, so it can be re-taken.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from passes.cost_model import DeviceProfile, ring_bus_factor
from spmd.profiles import CPU_LOCAL

_COMM_BYTES = 16 * 2**20


def _best(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    """The median time of ``fn`` (seconds) over ``repeats`` runs of ``inner`` calls.

    The median, not the best: a step is timed by its median too, so on a machine shared
    with other work both see the same share of the cores.
    """
    fn()  # warm up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t0) / inner)
    return statistics.median(ts)


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
    final graph runs (fx's generated Python, the dispatcher, a fresh output each)."""
    import torch.fx as fx

    g = fx.Graph()
    x = y = g.placeholder("x")
    for _ in range(n_ops):
        y = g.call_function(torch.ops.aten.add.Tensor, (y, x))
    g.output(y)
    gm = fx.GraphModule(torch.nn.Module(), g)
    one = torch.ones(1)
    return _best(lambda: gm(one), repeats, inner=10) / n_ops


def measure_compute() -> dict[str, Any]:
    """This process's compute constants: the profile fields ``peak_flops``, ``memory_bandwidth``
    and ``op_overhead_s`` (about 5 s)."""
    return {
        "peak_flops": {"fp32": measure_matmul(torch.float32), "bf16": measure_matmul(torch.bfloat16, n=256)},
        "memory_bandwidth": measure_memory_bandwidth(),
        "op_overhead_s": measure_op_overhead(),
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
            return _best(lambda: f.wait_tensor(fn()), repeats, inner)

        a = torch.randn(256, 256)
        mm_s = _best(lambda: torch.mm(a, a), 5, inner=10)
        ar_s = timed(lambda: f.all_reduce(big, "sum", name), 5)
        k = max(1, round(ar_s / mm_s))

        def compute() -> None:
            for _ in range(k):
                torch.mm(a, a)

        def both() -> None:
            w = f.all_reduce(big, "sum", name)
            compute()
            f.wait_tensor(w)

        alone_s = _best(compute, 5)
        dist.barrier()
        both_s = _best(both, 5)
        res = {
            # How much of the shorter one hides behind the other when both run at once.
            "overlap": (alone_s + ar_s - both_s) / min(alone_s, ar_s),
            "latency_all_reduce": timed(lambda: f.all_reduce(small, "sum", name), 5, inner=50),
            "all_reduce": timed(lambda: f.all_reduce(big, "sum", name), 5),
            "all_gather": timed(lambda: f.all_gather_into_tensor(half, 2, name), 5),
            "reduce_scatter": timed(lambda: f.reduce_scatter_tensor(big, "sum", 2, name), 5),
            "all_to_all": timed(lambda: f.all_to_all_single(big, [n // 2] * 2, [n // 2] * 2, name), 5),
        }
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
        comm_compute_overlap=min(max(g["overlap"], 0.0), 1.0),
        bandwidth_by_kind=by_kind,
        sources={k: "measured: " + cmd for k in ("peak_flops", "memory_bandwidth", "op_overhead_s", "gloo")},
    )
