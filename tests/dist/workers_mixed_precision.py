"""Per-rank bodies of the mixed-precision tests: spmd against FSDP2 ``fully_shard(mp_policy=...)``."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import spmd
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import train_step

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}


def _fsdp2(model: nn.Module, policy: MixedPrecisionPolicy, reshard: bool) -> nn.Module:
    """FSDP2 as its users apply it: ``fully_shard`` each block (or layer), then the root."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    blocks = list(getattr(model, "blocks", getattr(model, "layers", []))) or [
        m for m in model.modules() if isinstance(m, nn.Linear)
    ]
    for blk in blocks:
        fully_shard(blk, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def against_fsdp2(rank: int, world: int, cases: list[dict[str, Any]], steps: int = 5) -> list[str]:
    """Train each case compiled by spmd and under FSDP2 with the same policy; return mismatches.

    A case: ``model`` (parity model name), ``optim`` (tests.models optimizer name),
    ``style`` (spmd's parallel style), ``param``/``reduce`` (dtype names or None),
    ``cast_inputs`` (bool), ``reshard`` (bool), ``output`` (FSDP2 ``output_dtype`` name),
    ``cast_at`` (spmd's ``cast_forward_inputs_at``). Each step's local loss and the final full
    parameters must be equal bit for bit; so must the loss dtype. A case with ``differs=True``
    is a control: it must NOT match (the test can see the difference it claims to fix).
    """
    all_problems: list[str] = []
    for case in cases:
        problems: list[str] = []
        param, reduce = _DTYPES[case.get("param")], _DTYPES[case.get("reduce")]
        cast_inputs, reshard = case.get("cast_inputs", True), case.get("reshard", True)
        output = _DTYPES[case.get("output")]
        tag = "/".join(f"{k}={v}" for k, v in case.items())
        model = pm.build(case["model"])
        ref_model = _fsdp2(
            copy.deepcopy(model),
            MixedPrecisionPolicy(
                param_dtype=param, reduce_dtype=reduce, output_dtype=output, cast_forward_inputs=cast_inputs
            ),
            reshard,
        )
        opt = shared.make_optimizer(case["optim"], model)
        ref_opt = shared.make_optimizer(case["optim"], ref_model)
        mp = spmd.MixedPrecision(
            param_dtype=param,
            reduce_dtype=reduce,
            cast_forward_inputs=cast_inputs,
            cast_forward_inputs_at=case.get("cast_at"),
            output_dtype=output,
        )
        mode = spmd.DataParallel(case["style"], reshard_after_forward=reshard, mixed_precision=mp)
        step = spmd.compile(parallel_mode=mode, check_invariants=True)(train_step)
        for i in range(steps):
            b = pm.batch(case["model"], i, rank)
            loss = step(model, opt, *b)
            ref = train_step(ref_model, ref_opt, *b)
            # Keep stepping after a mismatch: a rank that stopped early would hang the other.
            if loss.dtype != ref.dtype or not torch.equal(loss, ref):
                problems.append(f"{tag}: step {i} loss {loss!r} != fsdp2 {ref!r}")
        for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            mine, theirs = _full(p), _full(q)
            if mine.dtype != theirs.dtype or not torch.equal(mine, theirs):
                problems.append(
                    f"{tag}: param {n} ({mine.dtype}) differs from FSDP2 by {_diff(mine, theirs)}"
                )
        if case.get("eval"):
            model.eval()
            ref_model.eval()
            ev = spmd.compile(parallel_mode=mode)(eval_step)
            xs = pm.batch(case["model"], 99, rank)[:-1]
            with torch.no_grad():
                got, want = ev(model, *xs), ref_model(*xs)
            if got.dtype != want.dtype or not torch.equal(got, want):
                problems.append(f"{tag}: eval output differs from FSDP2 by {_diff(got, want)}")
        if case.get("differs"):
            problems = [] if problems else [f"{tag}: the control case matched FSDP2 bit for bit"]
        all_problems += problems
    return all_problems


def eval_step(model: nn.Module, *xs: torch.Tensor) -> torch.Tensor:
    return model(*xs)
