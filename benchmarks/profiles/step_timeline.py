"""Where one rank's compiled step goes, without the profiler: per collective and per op category.

    torchrun --standalone --nproc_per_node=2 benchmarks/profiles/step_timeline.py --variants spmd_fully_shard

Each variant (names as in ``worker.py``) is built and warmed up; then a copy of its final graph is
run with a stamp (``perf_counter_ns`` and ``thread_time_ns``, about a microsecond each) after every
node, so no profiler slows the small ops. Rank 0 logs, medians over ``--steps`` steps of every rank:

* per collective: its kind and bytes, the issue's own cost, issue to wait-complete, time blocked
  in the wait, and the rank skew at issue (how much later the last rank issued it than the first;
  the ranks share one monotonic clock);
* per op category: main-thread CPU and wall time (wall minus CPU is time the thread was not
  running: descheduled on a loaded machine, or blocked in a wait);
* per step: wall, main-thread CPU, and CPU of the other threads (gloo's workers: the
  communication's own CPU work, which on a machine with as many cores as ranks competes with
  compute).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import operator
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from benchmarks.bench import models  # noqa: E402
from benchmarks.bench.worker import make_variant  # noqa: E402
from passes import collectives as C  # noqa: E402

log = logging.getLogger("spmd.bench")

_VIEWS = ("view", "t.default", "detach", "as_strided", "reshape", "slice", "split", "permute")


def category(n: fx.Node) -> str:
    if C.is_wait(n):
        return "wait"
    if C.is_collective(n):
        return "issue " + C.kind_of(n).value
    t = str(n.target)
    if t.startswith("spmd.") or "chunk_cat" in t or "fused_adam" in t or "fused_sgd" in t:
        return t.removesuffix(".default")
    if n.target is operator.getitem or any(k in t for k in _VIEWS):
        return "views, getitem"
    if "mm" in t:
        return "matmul"
    return "other aten"


class Stamps:
    """Per-node stamps of one step: category CPU/wall totals and collective events."""

    def __init__(self) -> None:
        self.cats: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.events: dict[str, int] = {}
        self.last = (0, 0)

    def start(self) -> None:
        self.last = (time.thread_time_ns(), time.perf_counter_ns())

    def after(self, cat: str, event: str | None, *_deps: Any) -> None:
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        acc = self.cats[cat]
        acc[0] += c - self.last[0]
        acc[1] += w - self.last[1]
        if event is not None:
            self.events[event] = self.last[1]  # the node's start
            self.events[event.upper()] = w  # its end
        self.last = (time.thread_time_ns(), time.perf_counter_ns())


def instrument(gm: fx.GraphModule, stamps: Stamps) -> list[tuple[str, int]]:
    """Add stamps to ``gm`` in place; returns (kind, bytes) per collective, in graph order."""
    g, colls, index = gm.graph, [], {}
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        event = None
        if C.is_collective(n):
            index[n] = len(colls)
            colls.append((C.kind_of(n).value, C.bytes_of(n)))
            event = f"i{index[n]}"
        elif C.is_wait(n):
            src = n.args[0]
            while isinstance(src, fx.Node) and not C.is_collective(src):
                src = src.args[0]
            event = f"w{index[src]}"
        with g.inserting_after(n):
            g.call_function(stamps.after, (category(n), event, n))
    first = next(n for n in g.nodes if n.op != "placeholder")
    with g.inserting_before(first):
        g.call_function(stamps.start, ())
    gm.recompile()
    return colls


def _q(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{statistics.median(xs):6.2f}"
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs):6.2f} [{q[0]:5.2f}-{q[2]:5.2f}]"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="overhead", choices=models.MODELS)
    p.add_argument("--variants", default="spmd_fully_shard")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    from spmd.backend.gloo_threads import gloo_threads

    with gloo_threads(1):  # spmd's full schedule, safely (benchmarks/results/crashes.md), as make bench
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = models.get(args.model)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [spec.batch(gen) for _ in range(4)]
    for name in args.variants.split(","):
        v = make_variant(name, spec, world)
        for i in range(3):
            v.step(v.model, v.optim, *batches[i % 4])  # type: ignore[misc]
        stamps = Stamps()
        colls = instrument(v.step._last.exe.gm, stamps)  # type: ignore[union-attr]
        steps = []
        for i in range(args.steps):
            stamps.cats.clear()
            stamps.events.clear()
            dist.barrier()
            t0, c0, p0 = time.perf_counter_ns(), time.thread_time_ns(), time.process_time_ns()
            v.step(v.model, v.optim, *batches[i % 4])  # type: ignore[misc]
            wall, cpu = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
            other = time.process_time_ns() - p0 - cpu
            steps.append(
                {"wall": wall, "cpu": cpu, "other": other, "cats": dict(stamps.cats), **stamps.events}
            )
        every: list[list[dict[str, Any]]] = [[] for _ in range(world)]
        dist.all_gather_object(every, steps)
        if rank == 0:
            report(name, colls, every)
    dist.destroy_process_group()


def report(name: str, colls: list[tuple[str, int]], every: list[list[dict[str, Any]]]) -> None:
    ms = 1e-6
    flat = [s for rank_steps in every for s in rank_steps]
    log.info("== %s: ms per step, median [IQR] over steps and ranks", name)
    for key, label in (("wall", "wall"), ("cpu", "main-thread CPU"), ("other", "other threads' CPU")):
        log.info("  %-22s %s", label, _q([s[key] * ms for s in flat]))
    log.info("  %3s %-15s %7s  %-22s %-22s %-22s %-22s", "#", "kind", "KiB", "issue", "issue->wait done",
             "blocked in wait", "rank skew at issue")  # fmt: skip
    for k, (kind, nbytes) in enumerate(colls):
        issue = [(s[f"I{k}"] - s[f"i{k}"]) * ms for s in flat]
        done = [(s[f"W{k}"] - s[f"i{k}"]) * ms for s in flat]
        blocked = [(s[f"W{k}"] - s[f"w{k}"]) * ms for s in flat]
        skew = [
            (max(r[i][f"i{k}"] for r in every) - min(r[i][f"i{k}"] for r in every)) * ms
            for i in range(len(every[0]))
        ]
        log.info("  %3d %-15s %7.0f  %-22s %-22s %-22s %-22s", k, kind, nbytes / 1024, _q(issue), _q(done),
                 _q(blocked), _q(skew))  # fmt: skip
    cats = sorted(
        {c for s in flat for c in s["cats"]}, key=lambda c: -sum(s["cats"].get(c, [0])[0] for s in flat)
    )
    log.info("  %-36s %-22s %-22s", "category", "main-thread CPU", "wall")
    for c in cats:
        cpu = [s["cats"].get(c, [0, 0])[0] * ms for s in flat]
        wall = [s["cats"].get(c, [0, 0])[1] * ms for s in flat]
        log.info("  %-36s %-22s %-22s", c, _q(cpu), _q(wall))


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
