"""Where one rank's step time goes, per variant, by category (torch.profiler on CPU).

    torchrun --standalone --nproc_per_node=2 benchmarks/profiles/profile_step.py \
        --variants no_comm,no_comm_compiled,spmd_replicate_inductor --steps 6

Every variant (names as in ``worker.py``, plus the inductor-option variants in ``INDUCTOR_OPTIONS``)
is built and warmed up, then profiled for ``--steps`` steps on every rank; rank 0 logs, per variant,
the step wall time and the self CPU time of the profiled ops grouped into categories: matmul
(``mm``/``addmm``/``bmm``: mkldnn or mkl), attention (SDPA's CPU flash kernels), inductor's fused
kernels (``cpp_fused_*``, visible through ``cpp.enable_kernel_profile``), the optimizer, the
collectives and their waits, spmd's flat-buffer copy ops, the embedding, other ATen ops, and what
no op accounts for (host: Python, the wrapper, allocation). ``--table N`` also logs the N ops with
the most self time. Then timed steps in interleaved rounds (no profiler) give median and IQR.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from benchmarks.bench import models  # noqa: E402
from benchmarks.bench.worker import Variant, make_variant  # noqa: E402

log = logging.getLogger("spmd.bench")

# Variants that differ from spmd_*_inductor only in options: (style, DataParallel kwargs, compile kwargs).
INDUCTOR_OPTIONS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "spmd_replicate_inductor_opt": ("replicate", {}, {"inductor_optimizer": "inline"}),
    "spmd_fully_shard_inductor_opt": ("fully_shard", {}, {"inductor_optimizer": "inline"}),
    "spmd_replicate_inductor_aten": ("replicate", {}, {"inductor_gemm": "aten"}),
    "spmd_fully_shard_inductor_aten": ("fully_shard", {}, {"inductor_gemm": "aten"}),
    "spmd_replicate_inductor_dnn": ("replicate", {}, {"inductor_gemm": "onednn"}),
    "spmd_fully_shard_inductor_dnn": ("fully_shard", {}, {"inductor_gemm": "onednn"}),
    "spmd_replicate_inductor_all": (
        "replicate",
        {"bucket_cap_mb": 4},
        {"inductor_gemm": "onednn", "inductor_optimizer": "inline"},
    ),
    "spmd_fully_shard_inductor_all": (
        "fully_shard",
        {},
        {"inductor_gemm": "onednn", "inductor_optimizer": "inline"},
    ),
    "spmd_replicate_inductor_b4": ("replicate", {"bucket_cap_mb": 4}, {}),
    "spmd_replicate_inductor_mod": ("replicate", {"bucket_mode": "module"}, {}),
    "spmd_replicate_inductor_mod_opt": (
        "replicate",
        {"bucket_mode": "module"},
        {"inductor_optimizer": "inline"},
    ),
}

CATEGORIES = (
    (
        "matmul",
        (
            "onednn_mm",
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "mkldnn",
            "aten::_mkl",
            "mkl_linear",
            "aten::linear",
        ),
    ),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("optimizer", ("_fused_adam", "spmd_lowering::", "cpp_fused_adam", "_foreach")),
    ("collective", ("c10d", "gloo", "wait_tensor", "all_reduce", "all_gather", "reduce_scatter")),
    ("flat_copy", ("spmd::",)),
    ("embedding", ("embedding",)),
    ("inductor_kernel", ("cpp_fused", "kernel_cpp")),
)


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other_aten"


def build(name: str, spec: models.Spec, world: int) -> Variant:
    if name not in INDUCTOR_OPTIONS:
        return make_variant(name, spec, world)
    import spmd

    style, mode_kwargs, options = INDUCTOR_OPTIONS[name]
    v = make_variant("no_comm", spec, world)  # same weights and optimizer, plain step
    mode = spmd.DataParallel(style, **mode_kwargs)
    v.step = spmd.compile(parallel_mode=mode, backend="inductor", **options)(v.step)
    v.name = name
    return v


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt", choices=models.MODELS)
    p.add_argument("--variants", default="no_comm,no_comm_compiled,spmd_replicate_inductor")
    p.add_argument("--steps", type=int, default=6)  # profiled steps per variant
    p.add_argument("--timed", type=int, default=12)  # timed steps per variant (interleaved)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--table", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--kernel-profile", action="store_true", help="name inductor's kernels in the profile")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    if args.kernel_profile:
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # a record_function per cpp kernel
    from spmd.backend.gloo_threads import gloo_threads

    with gloo_threads(1):  # spmd's full schedule, safely (benchmarks/results/crashes.md), as make bench
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = models.get(args.model, quick=args.quick)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [spec.batch(gen) for _ in range(4)]
    it = [0]

    def run(v: Variant) -> Any:
        x, y = batches[it[0] % len(batches)]
        it[0] += 1
        return v.step(v.model, v.optim, x, y)  # type: ignore[misc]

    variants = []
    for name in args.variants.split(","):
        v = build(name, spec, world)
        t0 = time.perf_counter()
        run(v)
        v.first_call_s = time.perf_counter() - t0
        for _ in range(2):
            run(v)
        variants.append(v)
        dist.barrier()
        if rank == 0:
            log.info("%s: first call %.1f s", name, v.first_call_s)

    summary: dict[str, dict[str, float]] = {}
    for v in variants:
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                run(v)
            wall = (time.perf_counter() - t0) / args.steps
        cats: dict[str, float] = defaultdict(float)
        events = prof.key_averages()
        for e in events:
            cats[category(e.key)] += e.self_cpu_time_total / 1e6 / args.steps
        accounted = sum(cats.values())
        cats["host_unaccounted"] = wall - accounted
        summary[v.name] = {"wall": wall, **cats}
        if rank == 0 and args.table:
            log.info(
                "== %s: top ops by self CPU\n%s",
                v.name,
                events.table(sort_by="self_cpu_time_total", row_limit=args.table),
            )

    times: dict[str, list[float]] = defaultdict(list)
    per_round = max(args.timed // args.rounds, 1)
    for _ in range(args.rounds):
        for v in variants:
            run(v)
            for _ in range(per_round):
                dist.barrier()
                t0 = time.perf_counter()
                run(v)
                times[v.name].append(time.perf_counter() - t0)
    if rank == 0:
        cols = ["wall"] + [c for c, _ in CATEGORIES] + ["other_aten", "host_unaccounted"]
        log.info("profiled ms/step (rank 0, self CPU time by category):")
        log.info("%-32s" + " %9s" * len(cols), "variant", *[c[:9] for c in cols])
        for name, cats in summary.items():
            log.info("%-32s" + " %9.1f" * len(cols), name, *[1e3 * cats.get(c, 0.0) for c in cols])
        base = statistics.median(times[variants[0].name])
        log.info("timed (no profiler), ms: median [IQR], ratio to %s", variants[0].name)
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=4)
            med = statistics.median(ts)
            log.info("%-32s %8.1f [%6.1f-%6.1f] %5.2fx", name, 1e3 * med, 1e3 * q[0], 1e3 * q[2], med / base)
    dist.destroy_process_group()


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
