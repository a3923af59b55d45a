"""Per-rank body of tests/dist/test_layouts.py."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from spmd.frontend.kernel_layouts import torch_fake_layouts
from tests import layout_models as L
from tests import models as shared
from tests.dist.workers import train_step


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p


def layout_family(
    rank: int, world: int, cases: list[tuple[str, str, dict[str, Any]]], steps: int
) -> list[str]:
    """Every (model, style, DataParallel options) compiled against DDP, different data per rank.

    Returns the mismatches (losses and parameters, bit for bit) and, for each case, how many
    layout fix-ups the first call inserted (as ``"fixes <tag> <n>"`` lines, for the parent).
    A case whose options say ``torch_fake_layouts`` is traced on torch's own fake layouts
    (spmd.frontend.kernel_layouts), so the batch-norm models need the first run's fix-ups.
    """
    out: list[str] = []
    for model_name, style, opts in cases:
        tag = f"{model_name}/{style}/{opts}"
        opts = dict(opts)
        with torch_fake_layouts() if opts.pop("torch_fake_layouts", False) else contextlib.nullcontext():
            out += _against_ddp(model_name, style, opts, rank, world, steps, tag)
    return out


def _against_ddp(
    model_name: str, style: str, opts: dict[str, Any], rank: int, world: int, steps: int, tag: str
) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    out: list[str] = []
    if opts.pop("mesh_2d", False):
        opts["mesh"] = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model = L.build(model_name)
    ddp = DDP(copy.deepcopy(model))
    opt = shared.make_optimizer("sgd_momentum_foreach", model)
    ref_opt = shared.make_optimizer("sgd_momentum_foreach", ddp.module)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style, **opts), check_invariants=True)(train_step)
    g = torch.Generator().manual_seed(100 + rank)
    for i in range(steps):
        x, y = L.batch(model_name, g)
        # The same seed for both: dropout must draw DDP's mask, element for element.
        torch.manual_seed(1000 * rank + i)
        loss = step(model, opt, x, y)
        torch.manual_seed(1000 * rank + i)
        ref = train_step(ddp, ref_opt, x, y)
        # Keep stepping after a mismatch: a rank that stopped early would hang the other.
        if not torch.equal(loss, ref):
            out.append(f"{tag}: step {i} loss {loss.item()!r} != ddp {ref.item()!r}")
    for (n, p), q in zip(model.named_parameters(), ddp.module.parameters()):
        full = _full(p)
        if full.shape != q.shape or not torch.equal(full, q):
            diff = (full.double() - q.double()).abs().max().item()
            out.append(f"{tag}: param {n} differs from DDP by {diff:.3g}")
    fixes = sum(1 for n in step.graphs["final"].graph.nodes if n.meta.get("spmd_layout_fix"))
    out.append(f"fixes {tag} {fixes}")
    return out


def killed_before_first_run(rank: int, world: int, style: str) -> dict[str, Any]:
    """Both ranks compile (``lower``); rank 1 SIGKILLs itself; rank 0 makes the first call,
    whose checking run (passes.layouts) meets the dead peer in a collective."""
    import os
    import signal

    from tests.dist import workers_reliability as wr

    step = wr._step_until(rank, style, 0)
    model, opt = step.state  # type: ignore[attr-defined]
    step.lower(model, opt, *wr._batch("mlp", 0, rank, 4))
    torch.distributed.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return wr._survive(rank, step, 0)
