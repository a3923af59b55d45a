"""spmd's own cost of a step apart from the transport's, and the transport's floor, on the bench models.

    OMP_NUM_THREADS=1 python benchmarks/profiles/fixed_costs.py                    # spmd's own costs
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/profiles/fixed_costs.py  # the floor

On two gloo ranks sharing two cores, a step's time is its compute, spmd's own ops (copy-in/out,
alignment, views, launches) and gloo's transport, which runs on the same cores. The bench's ratio to
``no_comm`` mixes the three; this script takes them apart.

* **One process** (no ``torchrun``): each bench model's step on a fake process group of 2 ranks
  (``torch.testing._internal.distributed.fake_pg``: collectives return at once, nothing is sent),
  compiled with ``spmd.DataParallel(style)`` for replicate and fully_shard, against the plain eager
  step (autograd, fused AdamW) of the same model, in interleaved rounds (median of ``--steps`` steps a
  round, median over rounds). The ratio is what spmd's graph costs beyond eager's ops: its fixed
  costs, on one core nobody shares.
* **Two ranks** (``torchrun``, gloo): the collectives of each style's compiled step (kinds and sizes
  read from its final graph), replayed alone back to back on preallocated buffers, and the eager
  step alone: wall and process CPU time (every thread) per step. With as many ranks as cores, a
  rank's core carries its compute and gloo's work for it, so ``(eager CPU + collectives CPU) /
  eager`` is the least that style's step can cost against ``no_comm``, whatever spmd does. Where
  the step's collectives run through shared memory (``passes.shm_collectives``: the ranks share
  this host), they are replayed through it; with ``SPMD_SHM=0``, on gloo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import spmd  # noqa: E402
from benchmarks.bench import models  # noqa: E402
from passes import collectives as C  # noqa: E402

SHM = torch.ops.spmd_shm

STYLES = ("replicate", "fully_shard")


def _build(spec: models.Spec) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = spec.build()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


def _median_step(fn, steps: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def own_costs(names: list[str], steps: int, rounds: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    print("spmd's own costs: one process, a fake process group of 2 ranks (nothing sent), one thread")
    print(f"{'model':10s} {'eager ms':>9s} " + " ".join(f"{s + ' ms':>15s} {'x eager':>7s}" for s in STYLES))
    for name in names:
        spec = models.get(name)
        x, y = spec.batch(torch.Generator().manual_seed(1000))
        plain = spec.train_step()
        runs = {"eager": (plain, *_build(spec))}
        for style in STYLES:
            runs[style] = (spmd.compile(parallel_mode=spmd.DataParallel(style))(plain), *_build(spec))
        for fn, m, o in runs.values():
            for _ in range(3):
                fn(m, o, x, y)
        meds: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(rounds):
            for k, (fn, m, o) in runs.items():
                meds[k].append(_median_step(lambda: fn(m, o, x, y), steps))  # noqa: B023
        ms = {k: statistics.median(v) * 1e3 for k, v in meds.items()}
        cells = " ".join(f"{ms[s]:15.2f} {ms[s] / ms['eager']:6.2f}x" for s in STYLES)
        print(f"{name:10s} {ms['eager']:9.2f} {cells}")
    dist.destroy_process_group()


def _replay(gm: torch.fx.GraphModule) -> tuple[list, float]:
    """A callable per collective of ``gm``, in order, on preallocated buffers (through shared memory
    where the graph's collective runs there, else gloo), and their MiB a rank."""
    ops = []
    mib = 0.0
    world = dist.get_world_size()
    for c in C.collectives(gm.graph):
        kind, nbytes = C.kind_of(c), C.bytes_of(c)
        mib += nbytes / 2**20
        n = max(world, nbytes // 4 // world * world)
        shm, group = C.is_shared_memory(c), C.group_of(c)
        if kind is C.Kind.ALL_GATHER:
            src, out = torch.randn(n // world), torch.empty(n)
            if shm:
                ops.append(lambda src=src, g=group: SHM.all_gather_into_tensor.default(src, world, g))
            else:
                ops.append(lambda src=src, out=out: dist.all_gather_into_tensor(out, src))
        elif kind is C.Kind.ALL_REDUCE:
            buf = torch.randn(n)
            if shm:
                ops.append(lambda buf=buf, g=group: SHM.all_reduce_.default(buf, "sum", g))
            else:
                ops.append(lambda buf=buf: dist.all_reduce(buf))
        elif kind is C.Kind.REDUCE_SCATTER and shm:
            src = torch.randn(n)
            ops.append(lambda src=src, g=group: SHM.reduce_scatter_tensor.default(src, "sum", world, g))
        elif kind is C.Kind.REDUCE_SCATTER or "all_to_all" in str(c.target):
            src, out = torch.randn(n), torch.empty(n)  # gloo's reduce-scatter is an all-to-all here
            ops.append(lambda src=src, out=out: dist.all_to_all_single(out, src))
        else:
            raise SystemExit(f"fixed_costs: no replay for {c.target}")
    return ops, mib


def transport_floor(names: list[str], steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        print("the transport's floor: 2 gloo ranks on this machine, each style's collectives replayed alone")
        print(f"{'model':10s} {'style':12s} {'colls':>5s} {'MiB':>6s} {'wall ms':>8s} {'CPU ms':>7s} "
              f"{'eager CPU ms':>12s} {'floor x no_comm':>15s}")  # fmt: skip
    for name in names:
        spec = models.get(name)
        x, y = spec.batch(torch.Generator().manual_seed(1000 + rank))
        plain = spec.train_step()
        model, optim = _build(spec)
        for _ in range(3):
            plain(model, optim, x, y)
        eager_cpu = []
        for _ in range(steps):
            t0 = time.process_time()
            plain(model, optim, x, y)
            eager_cpu.append(time.process_time() - t0)
        e = statistics.median(eager_cpu) * 1e3
        for style in STYLES:
            m, o = _build(spec)
            step = spmd.compile(parallel_mode=spmd.DataParallel(style))(plain)
            step(m, o, x, y)
            ops, mib = _replay(step.graphs["final"])
            walls, cpus = [], []
            for i in range(steps + 3):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for op in ops:
                    op()
                if i >= 3:
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
            w, c = statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3
            if rank == 0:
                print(f"{name:10s} {style:12s} {len(ops):5d} {mib:6.2f} {w:8.2f} {c:7.2f} {e:12.2f} "
                      f"{(e + c) / e:14.2f}x")  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="overhead", help=f"comma-separated, of {','.join(models.MODELS)}")
    p.add_argument("--steps", type=int, default=30, help="steps per measurement")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (one process)")
    args = p.parse_args()
    torch.set_num_threads(1)
    names = args.models.split(",")
    if "WORLD_SIZE" in os.environ:
        transport_floor(names, args.steps)
    else:
        own_costs(names, args.steps, args.rounds)


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:
        from benchmarks import rank_main

        rank_main.run(main)
    else:
        main()
