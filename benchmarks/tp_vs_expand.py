"""FSDP x TP (``DataParallel(..., tp_size=2, tp_plan=...)``) against ``DTensorExpandMode`` with the
same placements, side by side in one run on a 2 x 2 mesh of gloo ranks.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 benchmarks/tp_vs_expand.py [--rounds 5]

Three steps on one model and data: ``DTensorExpandMode`` (its data dimension is replicate-like: a
DTensor all-reduce per gradient), ``DataParallel("replicate")`` x TP and ``DataParallel("fully_shard")``
x TP, each with Megatron's placements of the built-in GPT (``spmd.parallel.tp_plans.gpt()``).
Rounds alternate the three (this machine is noisy), each round times ``--steps`` steps per
variant after a warm-up; the table gives each variant's median step time and its ratio to
``DTensorExpandMode``. Groups have one gloo thread (``spmd.gloo_threads(1)``), as ``make bench``.
Prints a table; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import rank_main
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

import spmd
from spmd.models import GPT, GPTConfig, train_step
from spmd.parallel import tp_plans
from spmd.parallel.tensor_parallel import resolve_plan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)  # per data rank
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with spmd.gloo_threads(1):
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=256, seq=a.seq, d_model=a.d_model, n_layers=a.layers, n_heads=8)

    def variant(kind: str):
        torch.manual_seed(0)
        model = GPT(cfg)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        if kind == "expand":
            params = resolve_plan(model, tp_plans.gpt()).params
            mode = spmd.DTensorExpandMode(
                {"dp": world // 2, "tp": 2}, param_placements={k: (Replicate(), v) for k, v in params.items()}
            )
        else:
            mode = spmd.DataParallel(kind, tp_size=2, tp_plan=tp_plans.gpt())
        return model, optim, spmd.compile(parallel_mode=mode)(train_step)

    kinds = ["expand", "replicate", "fully_shard"]
    built = {k: variant(k) for k in kinds}
    g = torch.Generator().manual_seed(rank // 2)  # one batch stream per data rank
    x = torch.randint(0, 256, (a.batch, a.seq), generator=g)
    y = x.roll(-1, 1)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:  # compile and warm up
        m, o, s = built[k]
        for _ in range(2):
            s(m, o, x, y)
    for _ in range(a.rounds):
        for k in kinds:
            m, o, s = built[k]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                s(m, o, x, y)
            dist.barrier()
            times[k].append((time.perf_counter() - t0) / a.steps * 1e3)
    if rank == 0:
        base = statistics.median(times["expand"])
        shape = f"GPT d{a.d_model} x {a.layers} layers, seq {a.seq}, batch {a.batch}/data rank"
        print(f"{shape}, {world} ranks (dp x tp 2)")
        print(f"{'variant':<24}{'median ms':>10}{'vs expand':>10}  collectives")
        rows = {}
        for k in kinds:
            med = statistics.median(times[k])
            coll = {n: c.count for n, c in built[k][2].report().collectives.items()}
            rows[k] = {"median_ms": med, "ratio": med / base, "rounds_ms": times[k], "collectives": coll}
            label = "DTensorExpandMode" if k == "expand" else f"{k} x TP"
            print(f"{label:<24}{med:>10.1f}{med / base:>9.2f}x  {coll}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "variants": rows}, f, indent=1)


if __name__ == "__main__":
    rank_main.run(main)
