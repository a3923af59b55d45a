"""Rank functions for tests/dist/test_report.py, and the model whose report has exact formulas.

``Stack`` is LayerNorm -> Linear -> ReLU -> Linear (no Linear biases): backward reads every
parameter, so fully_shard with reshard_after_forward gathers each one twice (forward and
backward), and the expected bytes are plain formulas of the parameter shapes (``expected``).
tests/unit/test_simulate.py uses the same model and formulas at large simulated world sizes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

import spmd
from spmd.models import train_step

F32 = 4


class Stack(nn.Module):
    def __init__(self, d: int = 5, h: int = 7, c: int = 3):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, c, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.ln(x))))


def stack_batch(d: int, c: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, d, generator=g), torch.randint(0, c, (n,), generator=g)


def expected(shapes: list[tuple[int, ...]], world: int, rank: int = 0) -> dict[str, int]:
    """Bytes per rank of float32 parameters of these shapes, sharded on dim 0 like torch.chunk."""
    local = padded = full = 0
    for shape in shapes:
        rows, per_row = shape[0], math.prod(shape[1:])
        chunk = math.ceil(rows / world)
        local += max(0, min(chunk, rows - rank * chunk)) * per_row * F32
        padded += chunk * world * per_row * F32
        full += rows * per_row * F32
    return {"local": local, "padded": padded, "full": full}


def reports(rank: int, world: int) -> dict[str, Any]:
    """One real step of Stack in each style; each style's report of two stages, as dicts."""
    out: dict[str, Any] = {}
    for name, dp in [
        ("replicate", spmd.DataParallel("replicate")),
        ("fully_shard", spmd.DataParallel("fully_shard")),
        ("fully_shard_noreshard", spmd.DataParallel("fully_shard", reshard_after_forward=False)),
    ]:
        torch.manual_seed(0)
        model = Stack()
        out["shapes"] = [tuple(p.shape) for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        step = spmd.compile(parallel_mode=dp)(train_step)
        step(model, opt, *stack_batch(5, 3, rank))
        out[name] = {stage: step.report(stage).to_dict() for stage in ("partitioned", "final")}
    return out
