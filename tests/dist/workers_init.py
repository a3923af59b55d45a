"""Per-rank bodies of the meta-device initialisation tests (module level, so spawned ranks can
import them)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _full, train_step


def meta_parity(
    rank: int, world: int, style: str, combos: list[tuple[str, str]], steps: int = 5, sync: bool = False
) -> list[str]:
    """A model built on the meta device and materialised by spmd starts bit for bit where the
    same model built normally with the same seed starts, and then trains like DDP.

    With ``sync`` every rank seeds differently and ``sync_module_states=True`` must give
    rank 0's values (each module broadcast before it is sharded).
    """
    problems: list[str] = []
    for model_name, opt_name in combos:
        tag = f"{model_name}/{opt_name}/{style}/sync={sync}"
        ctor = pm.MODELS[model_name][0]
        torch.manual_seed(0)
        ddp = DDP(ctor())  # rank 0's seed-0 values everywhere
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        with torch.device("meta"):
            model = ctor()
        opt = shared.make_optimizer(opt_name, model)  # over the meta parameters
        mode = spmd.DataParallel(style, sync_module_states=sync)
        torch.manual_seed(rank if sync else 0)
        mode.distribute(model, opt)
        for (n, p), (_, q) in zip(model.named_parameters(), ddp.module.named_parameters()):
            if p.is_meta or not torch.equal(_full(p), q):
                problems.append(f"{tag}: initial {n} differs from the normally built model")
        for (n, b), (_, c) in zip(model.named_buffers(), ddp.module.named_buffers()):
            if b.is_meta or not torch.equal(b, c):
                problems.append(f"{tag}: initial buffer {n} differs from the normally built model")
        if model.state_dict().keys() != ddp.module.state_dict().keys():
            problems.append(f"{tag}: state_dict keys differ (tied weights untied?)")
        step = spmd.compile(parallel_mode=mode, check_invariants=True)(train_step)
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            torch.manual_seed(100 + i)
            loss = step(model, opt, *b)
            torch.manual_seed(100 + i)
            ref = train_step(ddp, ref_opt, *b)
            if not torch.equal(loss, ref):
                problems.append(f"{tag}: step {i} loss {loss.item()!r} != ddp {ref.item()!r}")
        for (n, p), (_, q) in zip(model.named_parameters(), ddp.module.named_parameters()):
            if not torch.equal(_full(p), q):
                problems.append(f"{tag}: {n} differs from DDP after {steps} steps")
    return problems


class Stack(nn.Module):
    """``n`` equal Linear layers: the largest module holds 1/n of the parameter bytes."""

    def __init__(self, n: int = 16, d: int = 256) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def meta_memory(rank: int, world: int, style: str) -> dict[str, int]:
    """Peak bytes of live tensors on this rank while spmd materialises a meta-built model,
    against the full model's parameter bytes (MemTracker, which counts every storage
    allocated under it)."""
    with torch.device("meta"):
        model = Stack()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(
        sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:
        spmd.DataParallel(style).distribute(model)
    peak = tracker.get_tracker_snapshot("peak")
    local_bytes = sum(
        p._local_tensor.numel() * p.element_size() if isinstance(p, torch.distributed.tensor.DTensor) else 0
        for p in model.parameters()
    )
    return {
        "peak": max(d.get("Total", 0) for d in peak.values()),
        "full_param_bytes": full_bytes,
        "largest_module_bytes": largest,
        "local_param_bytes": local_bytes,
    }
