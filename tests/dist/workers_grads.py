"""Per-rank bodies of the ``.grad`` tests: a step that never zeroes gradients, compiled and
under DDP / FSDP2, must leave the same ``p.grad`` and parameters bit for bit."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests.dist import parity_models as pm


def step_no_zero(model, optim, *batch):
    *xs, y = batch
    loss = shared.loss_fn(model(*xs), y)
    loss.backward()
    optim.step()
    return loss


def step_zero(model, optim, *batch):
    loss = step_no_zero(model, optim, *batch)
    optim.zero_grad()
    return loss


def step_micro(model, optim, *batch):
    """Two micro-batches, no zero_grad."""
    *xs, y = batch
    half = y.shape[0] // 2
    for sl in (slice(0, half), slice(half, None)):
        loss = shared.loss_fn(model(*[x[sl] for x in xs]), y[sl])
        loss.backward()
    optim.step()
    return loss


def ref_step_micro(model, optim, *batch):
    """``step_micro`` under DDP (``no_sync``) or FSDP2 (no gradient sync) for the first micro-batch."""
    *xs, y = batch
    half = y.shape[0] // 2
    for k, sl in enumerate((slice(0, half), slice(half, None))):
        if isinstance(model, DDP):
            ctx = model.no_sync() if k == 0 else contextlib.nullcontext()
        else:
            model.set_requires_gradient_sync(k == 1)
            ctx = contextlib.nullcontext()
        with ctx:
            loss = shared.loss_fn(model(*[x[sl] for x in xs]), y[sl])
            loss.backward()
    optim.step()
    return loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _fsdp2(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for m in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def accumulate(
    rank: int, world: int, model_name: str, opt_name: str, micro: bool = False, steps: int = 3
) -> list[str]:
    """Three calls without zero_grad, then one with: replicate against DDP, fully_shard against
    FSDP2 (both bit for bit on loss, ``p.grad`` and parameters), and the placements of ``p.grad``.
    ``micro``: each call runs two micro-batches (the references skip the first one's reduction)."""
    problems: list[str] = []
    fn, ref_fn = (step_micro, ref_step_micro) if micro else (step_no_zero, step_no_zero)
    for style in ("replicate", "fully_shard"):
        model = pm.build(model_name)
        ref = DDP(copy.deepcopy(model)) if style == "replicate" else _fsdp2(copy.deepcopy(model))
        ref_mod = ref.module if isinstance(ref, DDP) else ref
        opt, ref_opt = shared.make_optimizer(opt_name, model), shared.make_optimizer(opt_name, ref_mod)
        step = spmd.compile(parallel_mode=spmd.DataParallel(style), check_invariants=True)(fn)
        want_placement = Replicate() if style == "replicate" else Shard(0)
        tag = f"{model_name}/{opt_name}/{style}/micro={micro}"
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            loss, ref_loss = step(model, opt, *b), ref_fn(ref, ref_opt, *b)
            if not torch.equal(loss, ref_loss):
                problems.append(f"{tag}: call {i}: loss {loss.item()!r} != {ref_loss.item()!r}")
            for (n, p), q in zip(model.named_parameters(), ref_mod.parameters()):
                if p.grad is None or q.grad is None:
                    problems.append(f"{tag}: call {i}: {n}.grad is {p.grad!r}, reference has {type(q.grad)}")
                    continue
                if not isinstance(p.grad, DTensor) or p.grad.placements != (want_placement,):
                    problems.append(f"{tag}: call {i}: {n}.grad is {type(p.grad).__name__} {p.grad}")
                elif p.grad._local_tensor.shape != p._local_tensor.shape:
                    problems.append(f"{tag}: call {i}: {n}.grad local shape differs from the parameter's")
                if not torch.equal(_full(p.grad), _full(q.grad)):
                    d = (_full(p.grad) - _full(q.grad)).abs().max().item()
                    problems.append(f"{tag}: call {i}: {n}.grad differs by {d}")
        for (n, p), q in zip(model.named_parameters(), ref_mod.parameters()):
            if not torch.equal(_full(p), _full(q)):
                problems.append(f"{tag}: param {n} differs by {(_full(p) - _full(q)).abs().max().item()}")
        # A step that ends with zero_grad leaves no gradient, and its graph has no gradient output.
        zstep = spmd.compile(parallel_mode=spmd.DataParallel(style))(step_zero)
        if isinstance(ref, nn.Module) and not isinstance(ref, DDP):
            ref.set_requires_gradient_sync(True)
        zstep(model, opt, *pm.batch(model_name, 9, rank))
        step_zero(ref, ref_opt, *pm.batch(model_name, 9, rank))
        if any(p.grad is not None for p in model.parameters()):
            problems.append(f"{tag}: .grad set after a step ending with zero_grad")
        zstep(model, opt, *pm.batch(model_name, 10, rank))
        step_zero(ref, ref_opt, *pm.batch(model_name, 10, rank))
        if zstep.num_graphs != 2 or zstep._last.exe.grad_outs:  # with old grads, then without
            problems.append(f"{tag}: zero_grad step: {zstep.num_graphs} graphs")
        for (n, p), q in zip(model.named_parameters(), ref_mod.parameters()):
            if not torch.equal(_full(p), _full(q)):
                problems.append(f"{tag}: after zero_grad steps param {n} differs")
    return problems
