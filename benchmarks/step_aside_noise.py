"""The noise of the measured choice of ``spmd.backend.step_aside``: how far apart the medians of
two identical callables come out when timed as it times inductor against the eager runtime.

    OMP_NUM_THREADS=1 python benchmarks/step_aside_noise.py --models overhead,gpt,encoder --reps 8

World size 1, one thread, the spmd eager backend's step of each bench model. Each repetition runs
step_aside's schedule with the SAME callable in both slots (a warm-up each, then TIMED_STEPS of
each, alternating) and compares the two medians: ``B / A - 1``. For each margin, the fraction of
repetitions in which B would beat A by more than it, i.e. how often identical callables would
make the choice step aside by noise alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import models  # noqa: E402

import spmd  # noqa: E402
from spmd.backend.step_aside import SCHEDULE, TIMED_STEPS  # noqa: E402

MARGINS = (0.01, 0.03, 0.05, 0.10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="overhead,gpt,encoder")
    p.add_argument("--reps", type=int, default=8, help="repetitions of the schedule per model")
    p.add_argument("--quick", action="store_true", help="the bench's small models")
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        spec = models.get(name, quick=args.quick)
        torch.manual_seed(0)
        model = spec.build()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

        def train_step(model, optim, x, y, spec=spec):  # noqa: ANN001, ANN202
            loss = spec.loss(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss

        step = spmd.compile()(train_step)
        gen = torch.Generator().manual_seed(1000)
        batches = [spec.batch(gen) for _ in range(4)]
        for i in range(3):  # the first call and two warm-up steps
            step(model, optim, *batches[i % 4])
        rel: list[float] = []
        for _ in range(args.reps):
            times: dict[str, list[float]] = {"A": [], "B": []}
            for i, (_, timed) in enumerate(SCHEDULE):
                slot = "AB"[i % 2]
                t0 = time.perf_counter()
                step(model, optim, *batches[i % 4])
                if timed:
                    times[slot].append(time.perf_counter() - t0)
            rel.append(statistics.median(times["B"]) / statistics.median(times["A"]) - 1)
        med = statistics.median(abs(r) for r in rel)
        wrong = ", ".join(f">{100 * m:.0f}%: {sum(r < -m for r in rel)}/{len(rel)}" for m in MARGINS)
        print(
            f"{name}: {TIMED_STEPS}+{TIMED_STEPS} alternating steps x {len(rel)}: |B/A - 1| median "
            f"{100 * med:.1f}%, max {100 * max(abs(r) for r in rel):.1f}%; B faster by {wrong}",
            flush=True,
        )


if __name__ == "__main__":
    main()
