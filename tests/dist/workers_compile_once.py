"""Per-rank bodies of the shared-compile tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch

import spmd
from spmd.errors import LoweringError
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _full, train_step

STEPS = 2


def _cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}


def _train(rank: int, style: str, batch_rows: int | None = None, **options: Any) -> dict[str, Any]:
    """``STEPS`` steps of the MLP with fused AdamW on backend='inductor': the final parameters,
    losses, the FX graph cache counters' change and the report's shared-compile fields."""
    model = pm.build("mlp")
    opt = shared.make_optimizer("adamw_fused", model)
    # inductor_fallback="never": every step runs the (shared or own) compiled code, none the eager runtime.
    options = {"inductor_fallback": "never", **options}
    step = spmd.compile(parallel_mode=spmd.DataParallel(style), backend="inductor", **options)(train_step)
    before = _cache_counts()
    losses = []
    for i in range(STEPS):
        b = pm.batch("mlp", i, rank)
        if batch_rows is not None:
            b = tuple(t[:batch_rows] for t in b)
        losses.append(step(model, opt, *b).detach().clone())
    after = _cache_counts()
    report = step.report()
    return {
        "params": [_full(p).detach().clone() for p in model.parameters()],
        "losses": losses,
        "cache": {k: after[k] - before[k] for k in after},
        "role": report.lower_role,
        "wait_s": report.lower_wait_s,
        "report": str(report),
    }


def shared_compile(rank: int, world: int) -> dict[str, Any]:
    """The same graph on both ranks with the shared compile (on: the test sets
    SPMD_SHARE_COMPILE=1), then each rank compiling itself (caches off), then different graphs
    per rank (uneven local batches), then a leader whose inductor fails."""
    out: dict[str, Any] = {
        "shared": _train(rank, "replicate"),
        "own": _train(rank, "replicate", inductor_config={"force_disable_caches": True}),
        # 3 rows on rank 0, 2 on rank 1: the graphs differ in the activations' shapes only
        # (and from the cases above, which would otherwise be in the cache already)
        "uneven": _train(rank, "replicate", batch_rows=3 - rank),
    }
    calls = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("injected inductor failure")

    # spmd reaches inductor through passes.torch_compat, which keeps what it resolved: patch both.
    with (
        mock.patch("torch._inductor.compile_fx.compile_fx", broken),
        mock.patch("passes.torch_compat.compile_fx", broken, create=True),
    ):
        try:
            _train(rank, "replicate", batch_rows=1)  # the same graph on both, not compiled before
            out["failure"] = None
        except LoweringError as exc:
            out["failure"] = str(exc)
    out["failure_compiled"] = len(calls)
    torch.distributed.barrier()
    return out
