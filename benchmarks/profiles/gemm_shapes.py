"""The float32 CPU matmuls of a bench model's step, each timed with ATen's ``mm`` and oneDNN's matmul.

    OMP_NUM_THREADS=1 python benchmarks/profiles/gemm_shapes.py --models gpt,encoder,overhead

World size 1, one thread. Traces the step with ``spmd.compile`` (eager backend), takes every
distinct matmul shape and layout of the final graph (:func:`spmd.backend.gemm_policy.gemm_of`) and times
it as ``inductor_gemm="auto"`` would (:func:`spmd.backend.gemm_policy.time_gemm`, no cache). Prints per
shape: calls per step, median ms of each library, their ratio and the choice, then the per-step
total of the matmuls with each fixed library and with the per-shape choice.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import spmd  # noqa: E402
from benchmarks.bench import models  # noqa: E402
from benchmarks.bench.worker import make_variant  # noqa: E402
from spmd.backend import gemm_policy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt,encoder")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        spec = models.get(name, quick=args.quick)
        v = make_variant("no_comm", spec, 1)
        step = spmd.compile()(v.step)
        x, y = spec.batch(torch.Generator().manual_seed(0))
        step(v.model, v.optim, x, y)
        counts = collections.Counter(
            g for n in step.graphs["final"].graph.nodes if (g := gemm_policy.gemm_of(n)) is not None
        )
        print(f"\n### {name}: {spec.description}; {torch.get_num_threads()} thread(s)")
        print(f"{gemm_policy.machine_key()}\n")
        print("| matmul (m x k x n, strides) | calls | ATen ms | oneDNN ms | oneDNN / ATen | auto |")
        print("|---|---:|---:|---:|---:|---|")
        tot = {"aten": 0.0, "onednn": 0.0, "auto": 0.0}
        for g, c in sorted(counts.items()):
            a, d = gemm_policy.time_gemm(g)
            pick = gemm_policy.choose(a, d)
            tot["aten"] += c * a
            tot["onednn"] += c * d
            tot["auto"] += c * (d if pick == gemm_policy.ONEDNN else a)
            print(f"| {g.key()} | {c} | {a:.2f} | {d:.2f} | {d / a:.2f} | {pick} |")
        print(
            f"\nper step, {sum(counts.values())} matmuls: all ATen {tot['aten']:.1f} ms, "
            f"all oneDNN {tot['onednn']:.1f} ms, per-shape choice {tot['auto']:.1f} ms"
        )


if __name__ == "__main__":
    main()
