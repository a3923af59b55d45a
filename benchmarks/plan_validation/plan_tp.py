"""FSDP x TP on paper: the plan's tp rows for a Llama preset, and torchtitan's Table 4 layout simulated.

    PYTHONPATH=$PWD python benchmarks/plan_validation/plan_tp.py --preset llama3.1-70b --world 1024 \
        --tp 1,2,4,8 --remat full,0.5,0.25                 # folded rows, no exact confirmation
    PYTHONPATH=$PWD python benchmarks/plan_validation/plan_tp.py --table4   # spmd.simulate, 80 blocks

The plan's rows are the folded search's extrapolations (``--exact-confirm`` lowers the best rows on the
full model as ``spmd.plan`` does by default: ~10-25 min per 70B tp row on 2 cores). Results:
benchmarks/results/plan-tp.md.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

import spmd
from spmd import models
from spmd.parallel import MixedPrecision, tp_plans
from spmd.plan import NamedPlan, plan
from spmd.plan.__main__ import _remats

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def table4() -> None:
    """Llama 3.1 70B, 256 ranks, FSDP 32 x TP 8 with sequence parallelism, 16 sequences of 8,192
    per data group, bf16, full remat (torchtitan docs/performance.md, Table 4)."""
    model, optim, idx, tgt = models.build_hf("llama3.1-70b", batch=16, seq=8192)
    mode = spmd.DataParallel(
        "fully_shard", tp_size=8, tp_plan=tp_plans.llama(sequence_parallel=True), mixed_precision=BF16
    )
    step = spmd.compile(parallel_mode=mode, remat="full")(models.causal_lm_step)
    t = time.perf_counter()
    r = spmd.simulate(step, model, optim, idx, tgt, world_size=256, device="h100-80gb")
    print(r)
    took = time.perf_counter() - t
    print(f"peak {r.peak_memory_bytes / 2**30:.1f} GiB per rank; simulated in {took:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table4", action="store_true", help="simulate torchtitan's Table 4 layout instead")
    ap.add_argument("--preset", default="llama3.1-70b")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank without tp")
    ap.add_argument("--tp", default="1,8")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--no-sp", action="store_true", help="tp_plans.llama() without sequence parallelism")
    ap.add_argument("--exact-confirm", action="store_true")
    a = ap.parse_args()
    if a.table4:
        table4()
        return
    if not a.exact_confirm:
        fold = importlib.import_module("spmd.plan.fold")
        fold.confirm = lambda rows, *args, **kw: rows  # keep the extrapolations
    model, optim, idx, tgt = models.build_hf(a.preset, batch=a.batch, seq=8192)
    sp = not a.no_sp
    named = NamedPlan(tp_plans.llama(sequence_parallel=sp), f"tp_plans.llama(sequence_parallel={sp})")
    t = time.perf_counter()
    p = plan(
        spmd.compile()(models.causal_lm_step),
        model, optim, idx, tgt,
        world_size=a.world, device="h100-80gb", memory_per_rank="80GiB", mixed_precision=BF16,
        styles=("fully_shard",), prefetch=(1,), min_unit_mb=(1.0,), reshard=(True,),
        remat=tuple(_remats(a.remat)), tp_plan=named, tp=tuple(int(x) for x in a.tp.split(",")),
    )  # fmt: skip
    print(p)
    for r in p.rows:
        by_dim = {k: f"{v / 2**30:.0f} GiB" for k, v in r.comm_bytes_by_dim.items()}
        print(f"{r.label}: compute {r.compute_s:.2f} s, exposed comm {r.exposed_comm_s:.2f} s, {by_dim}")
    print(f"planned in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
