"""Automatic tensor-parallel placements against the same placements written by hand, on gloo.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 benchmarks/plan_validation/auto_tp_vs_hand.py

Issue #35's last target: "on 4 gloo ranks the automatic placement's step time is within 10% of the
same placements written by hand". The built-in GPT of examples/train_gpt_tp.py (d 128, 3 blocks,
16 x 64 tokens per data rank, fused AdamW, clip_grad_norm_) on a 2 x 2 mesh, fully_shard x tp 2:

- ``auto``: ``DataParallel("fully_shard", tp_size=2)``, spmd chooses;
- ``frozen``: the same choice written out (``spmd.tp_plan_of(model)``) and passed as ``tp_plan=``;
- ``megatron``: ``tp_plans.gpt()``, Megatron's layout by hand (for reference: other placements).

Each variant compiles, warms up, then the three alternate in rounds of ``--steps`` steps (so a
change of the machine's load falls on all of them); the table gives each one's median step time
over the rounds and its ratio to ``frozen``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import spmd
from spmd.models import GPT, GPTConfig
from spmd.parallel import tp_plans


def build(tp_plan: object) -> tuple[object, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, seq=64, d_model=128, n_layers=3, n_heads=4))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)

    @spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", tp_size=2, tp_plan=tp_plan))
    def step(model, optim, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        return loss

    return step, model, optim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1234 + rank // 2)
    x = torch.randint(0, 128, (16, 64), generator=gen)
    y = torch.randint(0, 128, (16, 64), generator=gen)

    variants = {"auto": build(None)}
    variants["auto"][0](*variants["auto"][1:], x, y)  # the first call chooses
    frozen = spmd.tp_plan_of(variants["auto"][1])
    variants["frozen"] = build(frozen)
    variants["megatron"] = build(tp_plans.gpt())
    times: dict[str, list[float]] = {k: [] for k in variants}
    for step, model, optim in variants.values():
        for _ in range(3):
            step(model, optim, x, y)  # compile and warm up
    for _ in range(args.rounds):
        for name, (step, model, optim) in variants.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(model, optim, x, y).item()
            times[name].append((time.perf_counter() - t) / args.steps)
    if rank == 0:
        base = statistics.median(times["frozen"])
        print(f"{'variant':10} {'median ms':>10} {'x frozen':>9}   rounds (ms)")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{name:10} {med * 1e3:10.2f} {med / base:8.3f}x   {' '.join(f'{t * 1e3:.1f}' for t in ts)}"
            )
        same = {k: type(v).__name__ for k, v in frozen.items()}
        print(f"frozen plan: {same}")


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
