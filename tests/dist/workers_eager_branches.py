"""Per-rank bodies of tests/dist/test_eager_branches.py."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests.unit import test_eager_branches as U


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _compare(tag: str, model: nn.Module, ref: nn.Module, out: list[str]) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        mine, theirs = _full(p), _full(q)
        if not torch.equal(mine, theirs):
            out.append(
                f"{tag}: param {n} differs by {(mine.double() - theirs.double()).abs().max().item():.3g}"
            )


def ctc_parity(rank: int, world: int, steps: int) -> list[str]:
    """``F.ctc_loss`` (tensor lengths, different per rank and step) in replicate and fully_shard
    against DDP, fused AdamW: every loss and the final parameters bit for bit. Returns mismatches."""
    out: list[str] = []
    for style in ("replicate", "fully_shard"):
        torch.manual_seed(0)
        model = U.CTCHead()
        ref = DDP(copy.deepcopy(model))
        opt, ref_opt = U._fused_adamw(model), U._fused_adamw(ref)
        step = spmd.compile(parallel_mode=spmd.DataParallel(style))(U.ctc_step)
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(steps):
            batch = U.ctc_batch(g)
            loss, want = step(model, opt, *batch), U.ctc_step(ref, ref_opt, *batch)
            if not torch.equal(loss, want):  # keep stepping: a rank that stopped would hang the other
                out.append(f"{style}: step {i} loss {loss.item()!r} != {want.item()!r}")
        _compare(style, model, ref.module, out)
    return out
