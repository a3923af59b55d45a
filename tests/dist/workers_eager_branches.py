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


def data_checks_on_ranks(rank: int, world: int, steps: int) -> list[str]:
    """Branches on data (ChecksItsData) in replicate and fully_shard against DDP for ``steps``
    steps, then a batch whose labels are out of range on rank 1 only: every rank must raise
    DataCheckError (and none hang in the step's collectives). Returns mismatches and one
    ``"raised <style> <rank count>"`` line per style."""
    out: list[str] = []
    for style in ("replicate", "fully_shard"):
        torch.manual_seed(0)
        model = U.ChecksItsData()
        ref = DDP(copy.deepcopy(model))
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        step = spmd.compile(parallel_mode=spmd.DataParallel(style))(U.data_step)
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(steps):
            batch = U.data_batch(g)
            loss, want = step(model, opt, *batch), U.data_step(ref, ref_opt, *batch)
            if not torch.equal(loss, want):
                out.append(f"{style}: step {i} loss {loss.item()!r} != {want.item()!r}")
        x, y, mask = U.data_batch(g)
        if rank == 1:
            y = torch.tensor([0, 5, 1])
        try:
            step(model, opt, x, y, mask)
            out.append(f"{style}: no error on rank {rank}")
        except spmd.DataCheckError as exc:
            out.append(f"raised {style} {'differs on 1 of 2 ranks' in str(exc)} {'y.max() >= 5' in str(exc)}")
        _compare(style, model, ref.module, out)  # the refused batch changed nothing
    return out


def wav2vec2_parity(rank: int, world: int, steps: int) -> list[str]:
    """HF Wav2Vec2ForCTC with labels (dropout on) in replicate and fully_shard against DDP."""
    out: list[str] = []
    for style in ("replicate", "fully_shard"):
        model = U.tiny_wav2vec2_ctc()
        ref = DDP(copy.deepcopy(model), find_unused_parameters=True)  # masked_spec_embed: SpecAugment is off
        opt, ref_opt = U._fused_adamw(model), U._fused_adamw(ref)
        step = spmd.compile(parallel_mode=spmd.DataParallel(style))(U.wav2vec2_step)
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(steps):
            batch = U.wav2vec2_batch(g)
            torch.manual_seed(10 + i)
            loss = step(model, opt, *batch)
            torch.manual_seed(10 + i)
            want = U.wav2vec2_step(ref, ref_opt, *batch)
            if not torch.equal(loss, want):
                out.append(f"{style}: step {i} loss {loss.item()!r} != {want.item()!r}")
        _compare(style, model, ref.module, out)
    return out


class NestedChecks(nn.Module):
    """A check read only on one side of a branch on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if mask.any() and y.max() >= 5:  # the second condition is read only when the first holds
            raise ValueError("label out of range")
        return torch.nn.functional.cross_entropy(self.lin(x), y)


def ranks_read_other_checks(rank: int, world: int) -> list[str]:
    """Rank 0's first mask is all False (one condition read), rank 1's is not (two): the ranks'
    checks differ, and so would their all-reduces; compiling must raise RankDivergenceError on both."""
    torch.manual_seed(0)
    model = NestedChecks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile()(U.data_step)
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    mask = torch.tensor([False, rank == 1, False])
    try:
        step(model, opt, x, y, mask)
    except spmd.RankDivergenceError as exc:
        return [f"diverged {'data check' in str(exc)}"]
    return ["no error"]
