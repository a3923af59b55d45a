"""Per-rank bodies of the 3-rank (not a power of two) parity tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _diff, _full, train_step
from tests.dist.workers_grads import _fsdp2


def _reference(
    style: str, model: nn.Module, model_name: str, ddp_kwargs: dict[str, Any], rebuilt: bool
) -> tuple[nn.Module, nn.Module]:
    """(the module to step, the module holding its parameters): DDP for replicate, FSDP2 for
    fully_shard.

    ``rebuilt``: DDP runs one backward (on another batch, its gradients then dropped, no
    optimizer step) first. DDP's first iteration reduces buckets laid out in parameter order,
    later ones buckets rebuilt in the order gradients became ready, which is spmd's order."""
    if style == "replicate":
        ddp = DDP(copy.deepcopy(model), **ddp_kwargs)
        if rebuilt:
            *xs, y = pm.batch(model_name, 1000, 0)
            shared.loss_fn(ddp(*xs), y).backward()
            ddp.zero_grad(set_to_none=True)
        return ddp, ddp.module
    ref = _fsdp2(copy.deepcopy(model))
    return ref, ref


def parity(
    rank: int,
    world: int,
    style: str,
    combos: list[tuple[str, str]],
    steps: int = 6,
    ddp_kwargs: dict[str, Any] | None = None,
    knobs: dict[str, Any] | None = None,
    rebuilt: bool = True,
) -> dict[str, Any]:
    """Train each (model, optimizer) compiled with ``DataParallel(style)`` and under its reference
    (DDP / FSDP2), different data per rank; return the bit-for-bit mismatches and the largest
    difference per combo."""
    problems: list[str] = []
    worst: dict[str, float] = {}
    for model_name, opt_name in combos:
        tag = f"{model_name}/{opt_name}/{style}/W={world}"
        model = pm.build(model_name)
        ref, ref_mod = _reference(style, model, model_name, ddp_kwargs or {}, rebuilt)
        opt, ref_opt = shared.make_optimizer(opt_name, model), shared.make_optimizer(opt_name, ref_mod)
        step = spmd.compile(parallel_mode=spmd.DataParallel(style, **(knobs or {})), check_invariants=True)(
            train_step
        )
        w = 0.0
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            torch.manual_seed(100 + i)
            loss = step(model, opt, *b)
            torch.manual_seed(100 + i)
            want = train_step(ref, ref_opt, *b)
            w = max(w, _diff(loss, want))
            if not torch.equal(loss, want):
                problems.append(f"{tag}: step {i} loss {loss.item()!r} != {want.item()!r}")
        for (n, p), (_, q) in zip(model.named_parameters(), ref_mod.named_parameters()):
            full, ref_full = _full(p), _full(q)
            w = max(w, _diff(full, ref_full))
            if not torch.equal(full, ref_full):
                problems.append(f"{tag}: param {n} differs by {_diff(full, ref_full)}")
        worst[tag] = w
    return {"problems": problems, "worst": worst}


def ddp_vs_ddp(
    rank: int, world: int, combos: list[tuple[str, str]], steps: int, bucket_cap_mb: float
) -> dict[str, float]:
    """DDP against itself with another bucket layout: the largest difference per combo.

    Nonzero shows that gloo's sum order depends on where a gradient sits in its bucket."""
    worst: dict[str, float] = {}
    for model_name, opt_name in combos:
        model = pm.build(model_name)
        a, b = DDP(copy.deepcopy(model)), DDP(copy.deepcopy(model), bucket_cap_mb=bucket_cap_mb)
        oa, ob = shared.make_optimizer(opt_name, a.module), shared.make_optimizer(opt_name, b.module)
        w = 0.0
        for i in range(steps):
            x = pm.batch(model_name, i, rank)
            torch.manual_seed(100 + i)
            la = train_step(a, oa, *x)
            torch.manual_seed(100 + i)
            lb = train_step(b, ob, *x)
            w = max(w, _diff(la, lb))
        for p, q in zip(a.module.parameters(), b.module.parameters()):
            w = max(w, _diff(p, q))
        worst[f"{model_name}/{opt_name}"] = w
    return worst
