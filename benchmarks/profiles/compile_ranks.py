"""Inductor compile time of the first call as a real job sees it: N ranks under torchrun (gloo,
1 thread each) on one host, cold (a fresh TORCHINDUCTOR_CACHE_DIR) then warm (the same
directory, a second job), with the shared compile (spmd.backend.compile_once) on and off.

    OMP_NUM_THREADS=1 python benchmarks/profiles/compile_ranks.py           # GPT-2-small shape: 1 and 2 ranks
    OMP_NUM_THREADS=1 python benchmarks/profiles/compile_ranks.py --ranks 2 --share on,off
    OMP_NUM_THREADS=1 python benchmarks/profiles/compile_ranks.py --ranks 1 --compile-threads 1,2 --no-warm

Per rank it prints the report's ``lower_s`` (inductor phase, a follower's wait included), the
wait, ``compile_s`` (trace .. lowering), the first call's wall time and inductor's FX graph cache
hits/misses; per job the wall time of torchrun. One rank: replicate without a process group
(world 1); more: each ``--style`` (replicate: the same graph on every rank; fully_shard: GPT-2's
odd vocabulary, 50257 rows, shards unevenly, so the ranks' graphs differ and each compiles).
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def rank_main(out_dir: str, model_name: str, style: str) -> None:
    """One rank: build, compile and run the first step, write what it measured."""
    import torch
    import torch.distributed as dist

    import spmd
    from spmd import models as spmd_models
    from tests.models import TinyGPT

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    if model_name == "gpt2s":
        model = TinyGPT(vocab=50257, d_model=768, n_layers=12, n_heads=12, seq=256)
        idx = torch.randint(0, 50257, (1, 257), generator=torch.Generator().manual_seed(rank))
        batch, fn = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()), spmd_models.train_step
    else:  # a small one, to try the script
        model = TinyGPT(vocab=64, d_model=32, n_layers=2, n_heads=2, seq=16)
        idx = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
        batch, fn = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()), spmd_models.train_step
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    mode = spmd.DataParallel(style) if world > 1 else None
    step = spmd.compile(parallel_mode=mode, backend="inductor")(fn)
    from torch._dynamo.utils import counters

    t0 = time.perf_counter()
    step(model, optim, *batch)
    first = time.perf_counter() - t0
    rep = step.report()
    out = {
        "rank": rank,
        "role": rep.lower_role,
        "lower_s": rep.lower_s,
        "wait_s": rep.lower_wait_s,
        "compile_s": rep.compile_s,
        "first_call_s": first,
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def job(
    ranks: int, share: bool, cache: str, threads: str | None, model: str, style: str
) -> tuple[float, list[dict]]:
    """One torchrun job; (its wall seconds, the ranks' records)."""
    out_dir = tempfile.mkdtemp(prefix="compile_ranks_")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=ROOT)
    env["SPMD_SHARE_COMPILE"] = "1" if share else "0"
    if threads is not None:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = threads
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc_per_node={ranks}", __file__, "--rank-out", out_dir]
    cmd += ["--model", model, "--style", style]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    recs = []
    for r in range(ranks):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            recs.append(json.load(f))
    return wall, recs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2s", choices=["gpt2s", "tiny"])
    p.add_argument("--ranks", default="1,2")  # jobs of these many ranks
    p.add_argument("--style", default="replicate,fully_shard")  # DataParallel styles (2+ ranks)
    p.add_argument("--share", default="off,on")  # the shared compile (2+ ranks only)
    p.add_argument("--compile-threads", default="default")  # TORCHINDUCTOR_COMPILE_THREADS values
    p.add_argument("--no-warm", action="store_true")  # cold jobs only
    p.add_argument("--rank-out", default=None)  # internal: run as one rank of a job
    args = p.parse_args()
    if args.rank_out:
        rank_main(args.rank_out, args.model, args.style)
        return
    cols = ["rank", "role", "lower_s", "wait_s", "compile_s", "first call", "hit/miss", "job wall"]
    print(f"{'job':<38}" + "".join(f"{c:>11}" for c in cols), flush=True)
    for ranks in map(int, args.ranks.split(",")):
        styles = args.style.split(",") if ranks > 1 else ["replicate"]
        shares = [s == "on" for s in args.share.split(",")] if ranks > 1 else [False]
        for style, share, threads in itertools.product(styles, shares, args.compile_threads.split(",")):
            cache = tempfile.mkdtemp(prefix="inductor_cache_")  # cold, then warm from the same directory
            for temp in ["cold"] if args.no_warm else ["cold", "warm"]:
                thr = None if threads == "default" else threads
                wall, recs = job(ranks, share, cache, thr, args.model, style)
                name = f"{ranks}x {style} share={'on' if share else 'off'} thr={threads} {temp}"
                for r in recs:
                    vals = [r["rank"], r["role"], f"{r['lower_s']:.1f}", f"{r['wait_s']:.1f}"]
                    vals += [f"{r['compile_s']:.1f}", f"{r['first_call_s']:.1f}", f"{r['hit']}/{r['miss']}"]
                    print(f"{name:<38}" + "".join(f"{v:>11}" for v in vals) + f"{wall:>11.1f}", flush=True)


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
