"""One collective at a time through shared memory against gloo, on the ranks of this host.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/profiles/shm_collectives.py

For each op and size (float32, bytes per rank as ``passes.collectives.bytes_of`` counts them), the
median over ``--repeats`` calls of the wall time and of this process's CPU time (every thread), for
the ``spmd_shm`` op (``spmd.backend.shm``, the transport ``passes.shm_collectives`` puts a local
group's collectives on) and for the gloo functional collective plus its wait. A barrier before
each call, so a row is one collective's cost, not a pipeline's. ``--back-to-back``: the calls one
after another without barriers, wall per call over all of them (the fixed cost of a call, as a
step's small collectives pay it). Printed on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import spmd  # noqa: E402
from spmd.backend import shm  # noqa: E402

_f = torch.ops._c10d_functional
_s = torch.ops.spmd_shm


def _time(fn: Callable[[], object], repeats: int, back_to_back: bool = False) -> tuple[float, float]:
    if back_to_back:
        for _ in range(10):
            fn()
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t) / repeats * 1e3, (time.process_time() - c) / repeats * 1e3
    walls, cpus = [], []
    for i in range(repeats + 3):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        fn()
        if i >= 3:
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
    return statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3


def _ops(n: int, world: int, name: str) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(shared memory, gloo) callables per op, on ``n`` float32 a rank."""
    x, part, splits = torch.randn(n), torch.randn(n // world), [n // world] * world
    ops: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "all_gather": (
            lambda: _s.all_gather_into_tensor(part, world, name),
            lambda: _f.wait_tensor(_f.all_gather_into_tensor(part, world, name)),
        ),
        "all_to_all": (
            lambda: _s.all_to_all_single(x, splits, splits, name),
            lambda: _f.wait_tensor(_f.all_to_all_single(x, splits, splits, name)),
        ),
    }
    if world == 2:  # the reductions shared memory runs (at more ranks they stay on gloo)
        ops["reduce_scatter"] = (
            lambda: _s.reduce_scatter_tensor(x, "sum", world, name),
            lambda: _f.wait_tensor(_f.reduce_scatter_tensor(x, "sum", world, name)),
        )
        ops["all_reduce"] = (  # avg, in place: the values keep their size over the calls
            lambda: _s.all_reduce_(x, "avg", name),
            lambda: _f.wait_tensor(_f.all_reduce_(x, "avg", name)),
        )
    return ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--sizes-kib", default="64,1600,6400", help="bytes per rank, KiB, comma-separated")
    p.add_argument("--back-to-back", action="store_true", help="no barrier between calls")
    args = p.parse_args()
    torch.set_num_threads(1)
    with spmd.gloo_threads(1):  # as the bench makes its group (docs/troubleshooting.md, gloo)
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        group = dist.group.WORLD
        assert group is not None
        name = group.group_name
        if shm.transports([group]) != {name: world}:
            raise SystemExit("shm_collectives: no shared memory for this group (see the spmd logger at INFO)")
        if rank == 0:
            how = "mean over" if args.back_to_back else "median of"
            print(f"{world} ranks; {how} {args.repeats} calls; ms per call (wall / process CPU)")
            head = f"{'op':16s} {'KiB/rank':>9s} {'shm wall':>9s} {'shm CPU':>8s}"
            print(f"{head} {'gloo wall':>10s} {'gloo CPU':>9s}")
        for kib in (float(k) for k in args.sizes_kib.split(",")):
            for op, (ours, gloo) in _ops(
                max(world, int(kib * 1024) // 4 // world * world), world, name
            ).items():
                sw, sc = _time(ours, args.repeats, args.back_to_back)
                gw, gc = _time(gloo, args.repeats, args.back_to_back)
                if rank == 0:
                    print(f"{op:16s} {kib:9g} {sw:9.3f} {sc:8.3f} {gw:10.3f} {gc:9.3f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
