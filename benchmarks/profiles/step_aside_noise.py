"""The noise of the measured choice of ``spmd.backend.step_aside``: what it decides between two
identical callables, timed as it times inductor's code against the eager backend's graph.

    OMP_NUM_THREADS=1 python benchmarks/profiles/step_aside_noise.py --models overhead,gpt,encoder --reps 8

World size 1, one thread, the spmd eager backend's step of each bench model. Each repetition runs
step_aside's schedule with the SAME callable in both slots, A for inductor and B for eager (a
warm-up each, then timed pairs in alternating order until
:func:`~spmd.backend.step_aside.settled`) and reports how many pairs it took, how far apart the
medians came out (``B / A - 1``) and how often B was kept: how often identical callables would
make the choice step aside by noise alone. ``--fixed N``
times N pairs instead (the rule before the adaptive one was 3), for the spread of N-pair medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import spmd  # noqa: E402
from benchmarks.bench import models  # noqa: E402
from spmd.backend.step_aside import EAGER, INDUCTOR, choose, iqr, scheduled, settled  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="overhead,gpt,encoder")
    p.add_argument("--reps", type=int, default=8, help="repetitions of the measurement per model")
    p.add_argument("--fixed", type=int, default=0, help="time this many pairs (0: step_aside's rule)")
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
        pairs_used: list[int] = []
        kept_b = 0
        for _ in range(args.reps):
            times: dict[str, list[float]] = {INDUCTOR: [], EAGER: []}
            calls = 0
            while True:
                slot, timed = scheduled(calls)
                t0 = time.perf_counter()
                # the same batch for both calls of a pair (a batch may cost more than another)
                step(model, optim, *batches[(calls // 2) % 4])
                calls += 1
                if timed:
                    times[slot].append(1e3 * (time.perf_counter() - t0))
                n = len(times[EAGER])
                if not timed or n != len(times[INDUCTOR]) or n == 0:
                    continue  # a pair is not complete
                a, b = statistics.median(times[INDUCTOR]), statistics.median(times[EAGER])
                if (args.fixed and n >= args.fixed) or (
                    not args.fixed and settled(a, b, iqr(times[INDUCTOR]), iqr(times[EAGER]), n)
                ):
                    break
            rel.append(b / a - 1)
            pairs_used.append(n)
            kept_b += choose(a, b) == EAGER
        med = statistics.median(abs(r) for r in rel)
        print(
            f"{name}: {len(rel)} measurements ({'fixed ' + str(args.fixed) if args.fixed else 'adaptive'}): "
            f"pairs {min(pairs_used)}-{max(pairs_used)} (median {statistics.median(pairs_used):g}); "
            f"|B/A - 1| median {100 * med:.1f}%, max {100 * max(abs(r) for r in rel):.1f}%; "
            f"B (identical) kept in {kept_b}/{len(rel)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
