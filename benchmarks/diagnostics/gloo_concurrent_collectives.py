"""torch's gloo corrupts the heap when two collectives run at once: torch's own calls, no spmd.

    # torch's default group (two worker threads), six functional collectives in flight:
    torchrun --standalone --nproc_per_node=2 benchmarks/diagnostics/gloo_concurrent_collectives.py
    # the same with one worker thread (spmd.gloo_threads(1)), or one collective in flight:
    torchrun --standalone --nproc_per_node=2 benchmarks/diagnostics/gloo_concurrent_collectives.py --threads 1
    torchrun --standalone --nproc_per_node=2 benchmarks/diagnostics/gloo_concurrent_collectives.py \
        --in-flight 1

Each rank issues ``--in-flight`` functional collectives (all_gather_into_tensor, all_to_all_single,
all_reduce of 8 to 6,352 floats, the sizes of a small fully_shard step), then waits on them one by
one with a small matmul before each wait (the caller computes while gloo works), ``--iters``
times. A gloo group runs the collectives it is given on its worker threads -- two for a group
made by ``init_process_group("gloo")`` -- so with two or more in flight, two run at once.

Measured 2026-11-28 on this 2-core machine (torch 2.13.0+cpu, glibc 2.36), 20,000 iterations
or a crash: two threads, six in flight: a rank aborted with "malloc(): unaligned tcache chunk
detected" after 11 s and 87 s (2 of 2 runs); two threads, one in flight: 0 crashes in 3 runs of
40,000; one thread, six in flight: 0 crashes in 2 runs (228 s each). A core of the same abort
in spmd's test (benchmarks/results/crashes.md) shows what was overwritten: a freed 32-byte chunk of gloo's
worker-thread arena held the vtable pointer of ``std::_Sp_counted_deleter<gloo::transport::tcp::
UnboundBuffer*, ...ShareableNonOwningPtr...>``, the control block of gloo's unbound-buffer
handle: a control block released twice, its memory reused while still on a free list. The
exit code is 0 when every iteration finished on both ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import spmd  # noqa: E402
from benchmarks import rank_main  # noqa: E402

SIZES = [16, 32, 2048, 6352, 64, 8]  # floats; divisible by the 2 ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=6, help="collectives issued before the first wait")
    parser.add_argument("--threads", type=int, default=0, help="gloo worker threads (0: torch's default, 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.threads:
        with spmd.gloo_threads(args.threads):
            dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = dist.group.WORLD._get_backend(torch.device("cpu")).options._threads
    ops = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    start = time.time()
    for it in range(args.iters):
        outs = []
        for k in range(args.in_flight):
            n = SIZES[(it + k) % len(SIZES)]
            x = torch.full((n,), float(rank + k))
            kind = (it + k) % 3
            if kind == 0:
                outs.append(ops.all_gather_into_tensor(x, world, group))
            elif kind == 1:
                outs.append(ops.all_to_all_single(x, [n // world] * world, [n // world] * world, group))
            else:
                outs.append(ops.all_reduce(x, "sum", group))
        a = torch.randn(64, 64)
        for out in outs[::-1] if it % 2 else outs:
            a = a @ a.t() * 0.01
            ops.wait_tensor(out)
    print(
        f"rank {rank}: {args.iters} iterations, {args.in_flight} in flight, {threads} gloo thread(s): "
        f"done in {time.time() - start:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    rank_main.run(main)
