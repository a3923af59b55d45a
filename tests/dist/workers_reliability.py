"""Per-rank bodies of tests/dist/test_reliability.py and tests/dist/test_faults.py."""

from __future__ import annotations

import copy
import datetime
import os
import random
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests.dist.workers import train_step
from tests.random_models import RandomMLP


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _batch(model_name: str, step: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    return shared.MODELS[model_name][1](g, n)


def _against_ddp(
    tag: str,
    model: nn.Module,
    opt_name: str,
    style: str,
    batches: list[tuple[torch.Tensor, ...]],
) -> list[str]:
    """Train ``model`` compiled and a DDP copy on the same local batches; the mismatches."""
    ddp = DDP(copy.deepcopy(model))
    opt, ref_opt = shared.make_optimizer(opt_name, model), shared.make_optimizer(opt_name, ddp.module)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style), check_invariants=True)(train_step)
    problems = []
    for i, b in enumerate(batches):
        loss, ref = step(model, opt, *b), train_step(ddp, ref_opt, *b)
        # Keep stepping after a mismatch: a rank that stopped early would leave the other
        # waiting in a collective.
        if not torch.equal(loss, ref):
            problems.append(f"{tag}: step {i} loss {loss.item()!r} != ddp {ref.item()!r}")
    for (n, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        full = _full(p)
        if full.shape != q.shape or not torch.equal(full, q):
            problems.append(f"{tag}: param {n} differs from DDP by {_diff(full, q)}")
    return problems


# ----------------------------------------------------------------------------- uneven batches


def uneven(rank: int, world: int, sizes: list[int], combos: list[tuple[str, str, str]]) -> list[str]:
    """Rank r trains on ``sizes[r]`` samples per step, for every (style, model, optimizer)."""
    problems = []
    for style, model_name, opt_name in combos:
        model = shared.build(model_name)
        batches = [_batch(model_name, i, rank, sizes[rank]) for i in range(4)]
        problems += _against_ddp(
            f"{style}/{model_name}/{opt_name}/sizes={sizes}", model, opt_name, style, batches
        )
    return problems


def last_batch_smaller(rank: int, world: int, style: str) -> list[str]:
    """Three full batches of 4, then a last batch of 3 on rank 1 only (the end of an epoch)."""
    model = shared.build("mlp")
    batches = [_batch("mlp", i, rank, 3 if (i == 3 and rank == 1) else 4) for i in range(4)]
    return _against_ddp(f"{style}/last batch", model, "adamw_fused", style, batches)


# ----------------------------------------------------------------------------- random configs


def random_configs(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` random MLP configurations (the same list on every rank: seeded)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        depth = rng.randint(1, 4)
        out.append(
            {
                "widths": [rng.randint(1, 24) for _ in range(depth)],
                "sizes": [rng.randint(1, 6), rng.randint(1, 6)],
                "optim": rng.choice(["sgd_momentum_foreach", "adamw_fused", "adam_fused"]),
                "style": rng.choice(["replicate", "fully_shard"]),
            }
        )
    return out


def random_mlps(rank: int, world: int, configs: list[dict[str, Any]]) -> list[str]:
    problems = []
    for c in configs:
        torch.manual_seed(0)
        model = RandomMLP(c["widths"])
        g = torch.Generator().manual_seed(rank + 1)
        n, d = c["sizes"][rank], c["widths"][0]
        batches = [(torch.randn(n, d, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(3)]
        problems += _against_ddp(str(c), model, c["optim"], c["style"], batches)
    return problems


# ----------------------------------------------------------------------------- determinism


def determinism(rank: int, world: int, styles: list[str], steps: int = 5) -> list[str]:
    """Two runs from the same seed (dropout draws random numbers inside the graph): identical
    losses and parameters, bit for bit."""

    def run(style: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model = shared.build("dropout")
        opt = shared.make_optimizer("adamw_fused", model)
        step = spmd.compile(parallel_mode=spmd.DataParallel(style))(train_step)
        torch.manual_seed(1234 + rank)
        losses = [step(model, opt, *_batch("dropout", i, rank, 4)) for i in range(steps)]
        return losses, [_full(p).detach().clone() for p in model.parameters()]

    problems = []
    for style in styles:
        (l1, p1), (l2, p2) = run(style), run(style)
        for i, (a, b) in enumerate(zip(l1, l2)):
            if not torch.equal(a, b):
                problems.append(f"{style}: step {i} loss {a.item()!r} != {b.item()!r}")
        for i, (a, b) in enumerate(zip(p1, p2)):
            if not torch.equal(a, b):
                problems.append(f"{style}: parameter #{i} differs by {_diff(a, b)}")
        if len({x.item() for x in l1}) < 2:
            problems.append(f"{style}: the losses did not change, the run trained nothing")
    return problems


# ----------------------------------------------------------------------------- faults


def _step_until(rank: int, style: str, stop: int) -> spmd.CompiledStep:
    """Train ``stop`` healthy steps; return the compiled step."""
    model = shared.build("mlp")
    opt = shared.make_optimizer("adamw_fused", model)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style))(train_step)
    for i in range(stop):
        step(model, opt, *_batch("mlp", i, rank, 4))
    step.state = (model, opt)  # type: ignore[attr-defined]
    return step


def _survive(rank: int, step: spmd.CompiledStep, first: int) -> dict[str, Any]:
    """Keep stepping until the step raises; report what and how fast."""
    model, opt = step.state  # type: ignore[attr-defined]
    for i in range(first, first + 100):
        t0 = time.perf_counter()
        try:
            step(model, opt, *_batch("mlp", i, rank, 4))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return {
                "step": i,
                "seconds": time.perf_counter() - t0,
                "type": type(exc).__name__,
                "msg": str(exc),
            }
    return {"step": None, "type": "no error"}


def killed_rank(rank: int, world: int, style: str, kill_at: int = 3) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself before step ``kill_at``; rank 0 keeps training."""
    step = _step_until(rank, style, kill_at)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _survive(rank, step, kill_at)


def stalled_rank(rank: int, world: int, style: str, stall_at: int = 3) -> dict[str, Any]:
    """Rank 1 stops calling the step (alive, but not in the collective) until rank 0 has
    given up; rank 0 must time out with the process group's timeout."""
    step = _step_until(rank, style, stall_at)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["survivor_done"], datetime.timedelta(seconds=120))
        return {"type": "stalled"}
    out = _survive(rank, step, stall_at)
    store.set("survivor_done", "1")
    return out
