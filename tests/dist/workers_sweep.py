"""Per-rank body of tests/dist/test_sweep.py."""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests import sweep_models as S

log = logging.getLogger(__name__)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _step_of(loss_of: Any) -> Any:
    def train_step(model, optim, *batch):
        out = loss_of(model, *batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        optim.step()
        optim.zero_grad()
        return out

    return train_step


def _same_output(a: Any, b: Any) -> bool:
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    if sa != sb:
        return False
    return all(
        torch.equal(x, y) if isinstance(y, torch.Tensor) else (x == y and type(x) is type(y))
        for x, y in zip(la, lb)
    )


def _loss(out: Any) -> float:
    return (out[0] if isinstance(out, tuple) else out).item()


def _compare(tag: str, model: torch.nn.Module, ref: torch.nn.Module, who: str) -> list[str]:
    out = []
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        a, b = _full(p).detach(), _full(q).detach()
        if a.shape != b.shape or not torch.equal(a, b):
            out.append(f"{tag}: param {n} differs from {who} by {_diff(a, b):.3g}")
    for (n, p), (_, q) in zip(model.named_buffers(), ref.named_buffers()):
        if not torch.equal(_full(p), _full(q)):
            out.append(f"{tag}: buffer {n} differs from {who}")
    return out


def _refused(tag: str, fn: Any, case: S.Case, style: str, model: torch.nn.Module) -> list[str]:
    """Without its module_styles the model must be refused with a ConfigError naming the module."""
    step = spmd.compile(parallel_mode=spmd.DataParallel(style))(fn)
    opt = shared.make_optimizer("sgd_momentum_foreach", model)
    try:
        step(model, opt, *case.batch(torch.Generator().manual_seed(0)))
    except spmd.ConfigError as e:
        assert case.module_styles is not None
        if not all(repr(m) in str(e) for m in case.module_styles):
            return [f"{tag}: the ConfigError does not name the module: {e}"]
        return []
    return [f"{tag}: without module_styles={case.module_styles} the step was not refused"]


def sweep(rank: int, world: int, cases: list[tuple[str, str, str]], steps: int) -> list[str]:
    """Every (model, style, optimizer) compiled against DDP (and, for fully_shard with SGD on
    models whose buffers stay put, FSDP2), different data per rank, dropout seeded alike.

    Returns one line per problem: a crash (its exception) or a loss/parameter/buffer that is
    not bit for bit DDP's.
    """
    from torch.distributed.fsdp import fully_shard

    problems: list[str] = []
    for name, style, opt_name in cases:
        tag = f"{name}/{style}/{opt_name}"
        t0 = time.perf_counter()
        case = S.build(name)
        model = case.model
        ddp = DDP(copy.deepcopy(model), find_unused_parameters=case.unused_params)
        fsdp2 = None
        if style == "fully_shard" and opt_name.startswith("sgd") and case.fsdp2:
            fsdp2 = fully_shard(copy.deepcopy(model))
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        f2_opt = shared.make_optimizer(opt_name, fsdp2) if fsdp2 is not None else None
        fn = _step_of(case.loss)
        g = torch.Generator().manual_seed(100 + rank)
        styles = case.module_styles if style != "replicate" else None
        if styles:
            problems += _refused(tag, fn, case, style, copy.deepcopy(model))
        dp = spmd.DataParallel(style, module_styles=styles)
        step = spmd.compile(parallel_mode=dp, check_invariants=True)(fn)
        for i in range(steps):
            b = case.batch(g)
            torch.manual_seed(100 + i)
            try:
                loss = step(model, opt, *b)
            except Exception as e:  # noqa: BLE001 - a crash is a finding; the peer crashes alike
                problems.append(f"{tag}: step {i} raised {type(e).__name__}: {str(e)[:600]}")
                log.exception("sweep %s", tag)
                break
            torch.manual_seed(100 + i)
            ref = fn(ddp, ref_opt, *b)
            # Keep stepping after a mismatch: a rank that stopped early would hang the other.
            if not _same_output(loss, ref):
                problems.append(f"{tag}: step {i} output (loss {_loss(loss)!r}) != ddp's ({_loss(ref)!r})")
            if fsdp2 is not None:
                torch.manual_seed(100 + i)
                f2 = fn(fsdp2, f2_opt, *b)
                if not _same_output(loss, f2):
                    problems.append(
                        f"{tag}: step {i} output (loss {_loss(loss)!r}) != fsdp2's ({_loss(f2)!r})"
                    )
        else:
            problems += _compare(tag, model, ddp.module, "DDP")
            if fsdp2 is not None:
                problems += _compare(tag, model, fsdp2, "FSDP2")
        log.info("sweep %s: %.1f s", tag, time.perf_counter() - t0)
    return problems
