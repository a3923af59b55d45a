"""Many compiled steps on 2 gloo ranks, twice side by side: a crash or a race shows (issue 23).

Each rank trains two identical copies of each model (same init, same batches) with the
eager backend and the passes that free, reuse or write buffers around collectives
(reduce-scatter as all-to-all, in-place all-reduce, ``reuse_dead_buffers``, optimizer
overlap), one step of copy A then the same step of copy B. The math is deterministic, so
the two copies' losses and parameters must be equal bit for bit after every step: a buffer
written or freed while gloo's background thread still reads or writes it gives a
difference (or, with ``MALLOC_PERTURB_``, garbage), a corrupted heap aborts. Used by
``benchmarks/diagnostics/crash_hunt.sh`` (``MODE=steps``); tracing happens once per copy, so nearly all
the time goes to running steps, unlike the test suite.

    PYTHONPATH=. .venv/bin/python benchmarks/diagnostics/crash_hunt_steps.py --steps 100

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) each worker is one rank and runs the body
itself, so a tool can wrap each rank's interpreter (``benchmarks/diagnostics/valgrind_hunt.sh`` runs
every rank under valgrind this way); ``--configs``/``--copies`` cut the work for such a run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

import spmd
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.launcher import run_ranks
from tests.dist.workers import _full, train_step, train_step_clip

# (model, style, optimizer, step function): the passes in question all fire on these
# (fully_shard: reduce-scatters as all-to-alls; replicate: in-place bucket all-reduces;
# tinygpt: reuse of the logits' buffers; clip: a small all-reduce of the norm). "tp":
# DTensorExpandMode with Megatron placements on a 1-D mesh, clip_grad_norm_ over sharded
# gradients and fused SGD -- tests/dist/test_expand.py's 1-D case, the test that crashed in CI.
CONFIGS = [
    ("tinygpt", "fully_shard", "adamw_fused", train_step),
    ("uneven", "fully_shard", "adam_fused", train_step_clip),
    ("tinygpt", "replicate", "adamw_fused", train_step),
    ("nested", "replicate", "sgd_momentum_foreach", train_step_clip),
    ("tinygpt", "tp", "sgd_momentum_fused", train_step_clip),
]


def _mode(style: str, world: int) -> Any:
    if style == "tp":
        from torch.distributed.tensor import Replicate

        from tests.dist.workers_expand import TP

        return spmd.DTensorExpandMode(
            {"tp": world}, param_placements=dict(TP), input_placements=(Replicate(),)
        )
    return spmd.DataParallel(style)


def body(
    rank: int,
    world: int,
    steps: int,
    configs: list[int] | None = None,
    n_copies: int = 2,
    backend: str = "eager",
) -> list[str]:
    problems: list[str] = []
    for name, style, optim, fn in [CONFIGS[c] for c in configs] if configs is not None else CONFIGS:
        copies = []
        for _ in range(n_copies):
            torch.manual_seed(0)
            model = pm.build(name)
            opt = shared.make_optimizer(optim, model)
            step = spmd.compile(parallel_mode=_mode(style, world), backend=backend)(fn)
            copies.append((model, opt, step))
        for i in range(steps):
            # Tensor parallelism: every rank feeds the same (replicated) batch.
            batch = pm.batch(name, i % 7, 0 if style == "tp" else rank)
            la, *rest = (step(model, opt, *batch) for model, opt, step in copies)
            if any(not torch.equal(la, lb) for lb in rest):
                problems.append(f"{name}/{style} step {i}: losses {[x.item() for x in (la, *rest)]!r} differ")
                break
        for other in copies[1:]:
            for (n, a), b in zip(copies[0][0].named_parameters(), other[0].parameters(), strict=True):
                if not torch.equal(_full(a), _full(b)):
                    problems.append(f"{name}/{style}: parameter {n} differs after {steps} steps")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--configs",
        type=lambda s: [int(c) for c in s.split(",")],
        default=None,
        help="comma-separated indices into CONFIGS (default: all)",
    )
    ap.add_argument("--copies", type=int, default=2, help="copies trained side by side and compared")
    ap.add_argument(
        "--backend", default="eager", choices=["eager", "inductor"], help="spmd.compile's backend"
    )
    args = ap.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a torchrun worker: this process is one rank
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        try:
            results: Any = [
                body(
                    dist.get_rank(),
                    dist.get_world_size(),
                    args.steps,
                    args.configs,
                    args.copies,
                    args.backend,
                )
            ]
            dist.barrier()
        finally:
            dist.destroy_process_group()
    else:
        results = run_ranks(body, 2, args.steps, args.configs, args.copies, args.backend, timeout=3600)
    problems = [p for r in results for p in r]
    for p in problems:
        print("MISMATCH", p)
    n = len(args.configs) if args.configs is not None else len(CONFIGS)
    print(f"{n} configs x {args.steps} steps x {args.copies} copies: {'ok' if not problems else 'MISMATCH'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
