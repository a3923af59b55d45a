"""Per-rank body of the chunked loss head test (``test_chunked_loss``)."""

from __future__ import annotations

import copy
from typing import Any

from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from passes.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _diff, _full, train_step


def against_ddp(rank: int, world: int, style: str, chunks: list[int], steps: int) -> list[dict[str, Any]]:
    """For each chunk size: TinyGPT (tied head) trained ``steps`` steps with fused SGD, compiled
    with ``chunked_loss=chunk`` and under DDP, different data per rank: the largest difference
    of a loss or a parameter, and how many chunked heads the final graph has."""
    return [_one(rank, style, chunk, steps) for chunk in chunks]


def _one(rank: int, style: str, chunk: int, steps: int) -> dict[str, Any]:
    model = pm.build("tinygpt")
    ddp = DDP(copy.deepcopy(model))
    opt = shared.make_optimizer("sgd_momentum_fused", model)
    ref_opt = shared.make_optimizer("sgd_momentum_fused", ddp.module)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style), chunked_loss=chunk, check_invariants=True)(
        train_step
    )
    worst = 0.0
    for i in range(steps):
        b = pm.batch("tinygpt", i, rank)
        worst = max(worst, _diff(step(model, opt, *b), train_step(ddp, ref_opt, *b)))
    for p, q in zip(model.parameters(), ddp.module.parameters()):
        worst = max(worst, _diff(_full(p), q))
    heads = [n for n in step.graphs["final"].graph.nodes if n.target is LINEAR_CROSS_ENTROPY]
    return {"worst": worst, "heads": len(heads), "tokens": pm.batch("tinygpt", 0, rank)[0].numel()}
