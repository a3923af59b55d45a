"""Simulate a model's train step at any world size and print its report.

    python -m spmd.simulate --model gpt2-small --world-size 1024 --style fully_shard
    python -m spmd.simulate --model tiny --world-size 8 --style replicate --json
    python -m spmd.simulate --preset llama3.1-8b --world-size 8 --batch 2 --seq 8192 --mixed-precision bf16
    python -m spmd.simulate --hf-config path/to/config.json --world-size 64
    python -m spmd.simulate --model gpt2-small --world-size 8 --batch 8 --remat selective

The model is built under FakeTensorMode (no memory for its weights); see spmd.models.
"""

from __future__ import annotations

import argparse
import logging
import sys

import spmd
from spmd import models


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spmd.simulate", description=__doc__.split("\n\n")[0])
    models.add_model_arguments(p)
    p.add_argument("--world-size", type=int, default=8, help="ranks to simulate")
    p.add_argument("--style", default="fully_shard", choices=["replicate", "fully_shard"])
    p.add_argument("--no-reshard", action="store_true", help="fully_shard: reshard_after_forward=False")
    p.add_argument(
        "--remat",
        default=None,
        help="rematerialization policy: selective, op (torchtitan's), full, or a float in (0, 1] "
        "(default: none)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="lower for this device profile (h100-80gb, a100-80gb, cpu-local or a profile json; "
        "default: the CPU's rules, where the model is built)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log spmd's progress to stderr")
    args = p.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    fn, (model, optim, idx, targets), mp = models.build_from_args(args)
    dp = spmd.DataParallel(args.style, reshard_after_forward=not args.no_reshard, mixed_precision=mp)
    remat: str | float | None = args.remat
    if remat is not None and remat not in ("selective", "op", "full", "none"):
        try:
            remat = float(remat)
        except ValueError:
            p.error(f"--remat {remat!r}: must be selective, op, full or a float in (0, 1]")
    step = spmd.compile(parallel_mode=dp, remat=None if remat == "none" else remat)(fn)
    report = spmd.simulate(step, model, optim, idx, targets, world_size=args.world_size, device=args.device)
    print(report.to_json() if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
