"""plan_check's probe (``spmd.calibrate``'s 512^3 fp32 matmul rate and 16M-element add bandwidth)
at the points of a plan_check job, on 2 gloo ranks at once, to find why a probe taken right after
``measure_compute`` read 1.7-2.2x slower than the same probe during the timed rounds
(benchmarks/results/plan-validation.md, "Validation on this machine"):

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=268435456 OMP_NUM_THREADS=1 \\
        PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=2 benchmarks/plan_validation/probe_check.py

(plan_check's allocator settings; about a minute on the idle 2-core machine.) Probes, each after a
barrier as plan_check's: twice at the start; ``measure_compute()`` (what the job calibrates; its
own fp32 rate and bandwidth printed); twice right after it (plan_check's old reference), once more
2 s later; three fully_shard steps of the bench GPT; twice after them (a round's probe). A probe
is plan_check's: ``spmd.calibrate.READINGS`` calls of each function, their medians. Per probe and
rank: the median GFLOP/s and the range of the single calls' (how far one call would have been
off), the median GB/s, the main thread's CPU time over the wall time (below 1: the rank was
preempted) and the other threads' (above 0: a thread of the process ran beside the probe).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root


def main() -> None:
    import torch
    import torch.distributed as dist

    from spmd.calibrate import READINGS, measure_compute, probe_readings

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()

    def report(tag: str, values: tuple[float, ...]) -> None:
        every: list[tuple[float, ...] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, values)
        if rank == 0:
            print(f"{tag:26s} " + "  ".join(f"rank {i}: {v}" for i, v in enumerate(every)), flush=True)

    def probe(tag: str) -> None:
        dist.barrier()
        t0, c0, th0 = time.perf_counter(), time.process_time(), time.thread_time()
        flops, bw = probe_readings()  # plan_check's probe: the medians of these
        wall, cpu, main_cpu = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - th0
        report(
            tag,
            (
                round(statistics.median(flops) / 1e9, 1),
                f"{min(flops) / 1e9:.0f}-{max(flops) / 1e9:.0f}",
                round(statistics.median(bw) / 1e9, 2),
                round(main_cpu / wall, 2),
                round((cpu - main_cpu) / wall, 2),
            ),
        )

    if rank == 0:
        print(
            f"probe: (median GFLOP/s of {READINGS} readings, their range, median GB/s, main-thread CPU / "
            "wall, other threads' CPU / wall)",
            flush=True,
        )
    probe("start")
    probe("start, again")
    dist.barrier()
    c = measure_compute()
    report(
        "measure_compute's own",
        (round(c["peak_flops"]["fp32"] / 1e9, 1), round(c["memory_bandwidth"] / 1e9, 2)),
    )
    probe("right after it")
    probe("right after it, again")
    time.sleep(2)
    probe("2 s later")
    import spmd
    from benchmarks.bench import models

    spec = models.get("gpt", quick=False)
    torch.manual_seed(0)
    net = spec.build()
    optim = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)

    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"))(spec.train_step())
    x, y = spec.batch(torch.Generator().manual_seed(1000 + rank))
    for _ in range(3):
        step(net, optim, x, y)
    probe("after 3 GPT steps")
    probe("after 3 GPT steps, again")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
