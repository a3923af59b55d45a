"""Per-rank bodies of the memory-format tests: a channels_last conv net against DDP."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from passes.meta import ROLE, Role
from tests import models as shared
from tests.dist.workers import train_step

CL = torch.channels_last


class ConvNet(nn.Module):
    """Two Conv2d + BatchNorm2d blocks. The first conv's 16 x 27 weight shards at an offset of
    216 elements, not a multiple of the fused optimizers' alignment; the second's 7 output
    channels shard unevenly (padded collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 7, 3, padding=1),
            nn.BatchNorm2d(7),
            nn.ReLU(),
        )
        self.fc = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convs(x).mean(dim=(2, 3)))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    x = torch.randn(4, 3, 8, 8, generator=g).to(memory_format=CL)
    return x, torch.randint(0, 4, (4,), generator=g)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _mode(style: str) -> spmd.DataParallel:
    if style == "hybrid_shard":  # 1 replica x 2 shards: the hybrid path, exactly DDP's sums at W=2
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        return spmd.DataParallel(style, mesh=mesh)
    return spmd.DataParallel(style)


def channels_last_parity(rank: int, world: int, cases: list[tuple[str, str]], steps: int = 3) -> list[str]:
    """Train a channels_last ConvNet compiled in each (style, optimizer) case and under DDP:
    losses and parameters bit for bit; the parameters the graph gathers, the gradient shards it
    reduces and the local shards it keeps are channels_last, as the model's parameters are."""
    problems: list[str] = []
    for style, opt_name in cases:
        tag = f"{style}/{opt_name}"
        torch.manual_seed(0)
        model = ConvNet().to(memory_format=CL)
        ddp = DDP(copy.deepcopy(model))
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        # "replicate_unbucketed": each gradient's own all-reduce (its result is contiguous).
        unbucketed = style.endswith("_unbucketed")
        step = spmd.compile(
            parallel_mode=_mode(style.removesuffix("_unbucketed")),
            check_invariants=True,
            disabled_passes=("bucket_collectives",) if unbucketed else (),
        )(train_step)
        for i in range(steps):
            b = _batch(i, rank)
            loss = step(model, opt, *b)
            ref = train_step(ddp, ref_opt, *b)
            if not torch.equal(loss, ref):
                problems.append(f"{tag}: step {i} loss {loss.item()!r} != ddp {ref.item()!r}")
        for (n, p), (_, q) in zip(model.named_parameters(), ddp.module.named_parameters()):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if not torch.equal(full, q):
                problems.append(f"{tag}: param {n} differs from DDP by {_diff(full, q)}")
            mine = p.to_local() if isinstance(p, DTensor) else p
            if p.stride() != q.stride() or (q.dim() == 4 and not mine.is_contiguous(memory_format=CL)):
                problems.append(
                    f"{tag}: param {n} strides {p.stride()} (local {mine.stride()}) != {q.stride()}"
                )
        gm = step.graphs["final"]
        convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
        grads = [n for n in gm.graph.nodes if n.meta.get(ROLE) is Role.GRAD and n.meta["val"].dim() == 4]
        if len(convs) != 2 or len(grads) != 2:
            problems.append(f"{tag}: expected 2 convolutions and 2 conv weight gradients in the graph")
        # Every style reduces in memory order: a fused optimizer reads a parameter and its
        # gradient as flat memory, so a contiguous gradient of a channels_last weight is wrong.
        for n in [c.args[1] for c in convs] + grads:
            if not n.meta["val"].is_contiguous(memory_format=CL):
                problems.append(f"{tag}: {n.name} in the graph has strides {n.meta['val'].stride()}")
    return problems
