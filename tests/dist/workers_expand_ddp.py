"""Per-rank bodies of the DTensorExpandMode-vs-DDP tests: gradient accumulation across calls,
BatchNorm statistics and a data-parallel degree that is not a power of two."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers_grads import step_no_zero, step_zero


def _build(name: str) -> torch.nn.Module:
    return shared.build(name) if name == "convbn" else pm.build(name)


def _batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """A different batch on every rank and step."""
    if name == "convbn":
        return shared._image_batch(torch.Generator().manual_seed(1000 * step + rank + 1))
    return pm.batch(name, step, rank)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def vs_ddp(
    rank: int,
    world: int,
    cases: list[tuple[str, str]],
    zero_grad: bool = True,
    steps: int = 4,
    batch_semantics: str = "local",
    broadcast_buffers: bool = True,
) -> list[str]:
    """``DTensorExpandMode()`` (default placements) against DDP, different data on every rank:
    every loss, the final parameters, ``p.grad`` (when the step never zeroes it: accumulated
    across calls) and the buffers (BatchNorm's running statistics) bit for bit. The expansion
    does not broadcast buffers from rank 0 as DDP does by default: compare buffers with
    ``broadcast_buffers=False`` where the step mutates them."""
    fn = step_zero if zero_grad else step_no_zero
    problems: list[str] = []
    for model_name, opt_name in cases:
        tag = f"W={world} {model_name}/{opt_name}/{'zero' if zero_grad else 'no_zero'}"
        model = _build(model_name)
        ddp = DDP(copy.deepcopy(model), broadcast_buffers=broadcast_buffers)
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        mode = spmd.DTensorExpandMode(batch_semantics=batch_semantics)  # "local": DDP
        step = spmd.compile(parallel_mode=mode, check_invariants=True)(fn)
        for i in range(steps):
            b = _batch(model_name, i, rank)
            loss, want = step(model, opt, *b), fn(ddp, ref_opt, *b)
            if not torch.equal(loss, want):
                problems.append(f"{tag}: step {i} loss {loss.item()!r} != ddp {want.item()!r}")
        for (n, p), (_, q) in zip(model.named_parameters(), ddp.module.named_parameters()):
            if not torch.equal(_full(p), q):
                problems.append(f"{tag}: param {n} differs from DDP by {_diff(_full(p), q)}")
            if not zero_grad and not (
                p.grad is not None and q.grad is not None and torch.equal(_full(p.grad), q.grad)
            ):
                d = _diff(_full(p.grad), q.grad) if p.grad is not None and q.grad is not None else None
                problems.append(f"{tag}: {n}.grad differs from DDP's (by {d})")
        for (n, b), (_, c) in zip(model.named_buffers(), ddp.module.named_buffers()):
            if not torch.equal(_full(b), c):
                problems.append(f"{tag}: buffer {n} differs from DDP by {_diff(_full(b).float(), c.float())}")
    return problems


def batchnorm_global(rank: int, world: int, steps: int = 3) -> dict[str, float]:
    """``batch_semantics="global"`` on ConvBN: BatchNorm takes the statistics of the global batch
    (as SyncBatchNorm), so the running statistics follow single-device training on the global
    batch; returns their largest difference from it and from DDP's (local statistics)."""
    model = _build("convbn")
    ref = copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model))
    opt = shared.make_optimizer("sgd_momentum_fused", model)
    ref_opt = shared.make_optimizer("sgd_momentum_fused", ref)
    ddp_opt = shared.make_optimizer("sgd_momentum_fused", ddp.module)
    mode = spmd.DTensorExpandMode(batch_semantics="global")
    step = spmd.compile(parallel_mode=mode, check_invariants=True)(step_zero)
    for i in range(steps):
        batches = [_batch("convbn", i, r) for r in range(world)]
        step(model, opt, *batches[rank])
        step_zero(ddp, ddp_opt, *batches[rank])
        step_zero(ref, ref_opt, *[torch.cat(t) for t in zip(*batches)])
    stats = ("bn.running_mean", "bn.running_var")
    bufs, refs, ddps = (
        dict(model.named_buffers()),
        dict(ref.named_buffers()),
        dict(ddp.module.named_buffers()),
    )
    return {
        "vs_global": max(_diff(_full(bufs[n]), refs[n]) for n in stats),
        "vs_ddp": max(_diff(_full(bufs[n]), ddps[n]) for n in stats),
    }
