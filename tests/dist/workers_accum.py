"""Per-rank bodies of the gradient-accumulation tests."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from passes import collectives as C
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist import workers

MICRO = 2  # micro-batches per step; the parity batches have 2 or 4 rows


def accumulating_step(model, optim, *batch):
    """k forward/backward passes over slices of the local batch, one optimizer step."""
    for piece in zip(*(t.chunk(MICRO) for t in batch)):
        *xs, y = piece
        loss = shared.loss_fn(model(*xs), y) / MICRO
        loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def ddp_no_sync_step(ddp, optim, *batch):
    """The DDP idiom: no_sync for every micro-batch but the last."""
    pieces = list(zip(*(t.chunk(MICRO) for t in batch)))
    for i, piece in enumerate(pieces):
        *xs, y = piece
        with ddp.no_sync() if i < len(pieces) - 1 else contextlib.nullcontext():
            loss = shared.loss_fn(ddp(*xs), y) / MICRO
            loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _reductions(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Elements reduced per collective kind (all-reduce, reduce-scatter)."""
    out: dict[str, int] = {}
    for n in C.collectives(gm.graph):
        kind = C.kind_of(n).value
        if "reduce" in kind:
            out[kind] = out.get(kind, 0) + n.args[0].meta["val"].numel()
    return out


def parity(rank: int, world: int, style: str, reshard: bool, combos: list[tuple[str, str]]) -> list[str]:
    """Compiled accumulating step vs DDP with no_sync: every loss and the final parameters,
    bit for bit; and the step reduces each gradient once, as a one-micro-batch step does."""
    problems: list[str] = []
    for model_name, opt_name in combos:
        tag = f"{model_name}/{opt_name}/{style}/reshard={reshard}"
        model = pm.build(model_name)
        ddp = DDP(copy.deepcopy(model))
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        mode = spmd.DataParallel(style, reshard_after_forward=reshard)
        step = spmd.compile(parallel_mode=mode, check_invariants=True)(accumulating_step)
        problems += [
            f"{tag}: {p}" for p in _train_and_compare(step, model, opt, ddp, ref_opt, model_name, rank, 6)
        ]
        # One reduction per gradient per step: the same reduced elements as a plain step.
        plain = spmd.compile(parallel_mode=mode)(workers.train_step)
        plain(model, opt, *pm.batch(model_name, 50, rank))
        got, want = _reductions(step.graphs["final"]), _reductions(plain.graphs["final"])
        if got != want:
            problems.append(f"{tag}: accumulating step reduces {got}, a plain step {want}")
    return problems


def combined(rank: int, world: int) -> list[str]:
    """Accumulation with per-parameter plans: a fully_shard model with a replicated head and a
    rank-local (ignored) expert, vs DDP with no_sync ignoring the same expert, bit for bit."""
    from tests.dist import workers_hybrid as wh

    names = [n for n, _ in wh.LocalExpertNet().named_parameters()]
    ignored = [n for n in names if n.startswith("expert.")]
    model = wh._local_expert_model(rank, ignored)
    ref_model = copy.deepcopy(model)
    DDP._set_params_and_buffers_to_ignore_for_model(ref_model, ignored)
    ddp = DDP(ref_model)
    opt = shared.make_optimizer("adamw_fused", model)
    ref_opt = shared.make_optimizer("adamw_fused", ddp.module)
    mode = spmd.DataParallel("fully_shard", module_styles={"head": "replicate"}, ignored_modules=["expert"])
    step = spmd.compile(parallel_mode=mode, check_invariants=True)(accumulating_step)
    return _train_and_compare(step, model, opt, ddp, ref_opt, "mlp", rank, 5)


def _train_and_compare(step, model, opt, ddp, ref_opt, data: str, rank: int, steps: int) -> list[str]:
    """Train both for ``steps`` steps; every loss and the final parameters must be equal."""
    problems = []
    for i in range(steps):
        b = pm.batch(data, i, rank)
        loss, ref = step(model, opt, *b), ddp_no_sync_step(ddp, ref_opt, *b)
        if not torch.equal(loss, ref):
            problems.append(f"step {i}: loss {loss.item()!r} != ddp {ref.item()!r}")
    for (n, p), (_, q) in zip(model.named_parameters(), ddp.module.named_parameters()):
        full = p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p
        if not torch.equal(full, q):
            problems.append(f"param {n} differs from DDP by {(full - q).abs().max().item()}")
    return problems
