"""Per-rank bodies of the hybrid_shard, ignored-parameter and per-module-style tests."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _diff, _full, train_step, train_step_clip


def _compare(
    tag: str,
    model: nn.Module,
    ref: nn.Module,
    losses: list[tuple[torch.Tensor, torch.Tensor]],
    atol: float,
    skip: tuple[str, ...] = (),
) -> tuple[list[str], float]:
    """Mismatches of losses and final parameters beyond ``atol``, and the largest difference."""
    problems: list[str] = []
    worst = 0.0
    for i, (a, b) in enumerate(losses):
        worst = max(worst, _diff(a, b))
        if _diff(a, b) > atol:
            problems.append(f"{tag}: step {i} loss {a.item()!r} != ddp {b.item()!r}")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if n in skip:
            continue
        full = _full(p)
        worst = max(worst, _diff(full, q))
        if full.shape != q.shape or _diff(full, q) > atol:
            problems.append(f"{tag}: param {n} differs from DDP by {_diff(full, q)}")
    return problems, worst


def _two_level_hook(shard_pg: Any, rep_pg: Any) -> Any:
    """A DDP communication hook that averages as hybrid_shard does: within the shard group, then
    across replicas (each a 2-rank sum, halved: exact), instead of one ring over every rank."""
    import torch.distributed as dist

    def hook(state, bucket):  # unannotated: DDP checks the annotations it finds
        t = bucket.buffer()
        for pg in (shard_pg, rep_pg):
            dist.all_reduce(t, group=pg)
            t.div_(dist.get_world_size(pg))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(t)
        return fut

    return hook


def hybrid_parity(
    rank: int, world: int, combos: list[tuple[str, str, bool]], steps: int, atol: float
) -> dict[str, Any]:
    """hybrid_shard on a (world/2 x 2) mesh against DDP over every rank, different data per rank.

    Returns the mismatches against (a) DDP with a two-level averaging hook, bit for bit, and
    (b) plain DDP, within ``atol``; and the largest difference from plain DDP per combo. The
    first combo uses the default mesh (LOCAL_WORLD_SIZE=2, as torchrun on nodes of 2 ranks
    sets it), the others an explicit mesh with named dimensions. Ends with a DCP round trip.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    problems: list[str] = []
    worst: dict[str, float] = {}
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    for k, (model_name, opt_name, clip) in enumerate(combos):
        tag = f"{model_name}/{opt_name}/hybrid_shard/clip={clip}"
        mesh = (
            None
            if k == 0
            else init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        )
        model = pm.build(model_name)
        mode = spmd.DataParallel("hybrid_shard", mesh=mesh)
        ddp = DDP(copy.deepcopy(model))
        hier = DDP(copy.deepcopy(model))
        step_mesh = mesh if mesh is not None else mode._mesh(model)
        hier.register_comm_hook(
            None, _two_level_hook(step_mesh.get_group("shard"), step_mesh.get_group("replicate"))
        )
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        hier_opt = shared.make_optimizer(opt_name, hier.module)
        fn = train_step_clip if clip else train_step
        step = spmd.compile(parallel_mode=mode, check_invariants=True)(fn)
        losses, hier_losses = [], []
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            loss = step(model, opt, *b)
            losses.append((loss, fn(ddp, ref_opt, *b)))
            hier_losses.append((loss, fn(hier, hier_opt, *b)))
        p0 = next(model.parameters())
        if not (isinstance(p0, DTensor) and p0.device_mesh.ndim == 2):
            problems.append(f"{tag}: parameters are not DTensors on a 2-D mesh")
        problems += _compare(tag + " vs two-level DDP", model, hier.module, hier_losses, 0.0)[0]
        bad, worst[tag] = _compare(tag, model, ddp.module, losses, atol)
        problems += bad
    # DCP: save the last model, load into a fresh one distributed the same way.
    ckpt = os.environ["SPMD_TEST_CKPT"]
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    model2 = pm.build(model_name)
    opt2 = shared.make_optimizer(opt_name, model2)
    mode.distribute(model2, opt2)
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        if not torch.equal(_full(p), _full(q)) or p.placements != q.placements:
            problems.append(f"DCP round trip: {n} differs")
    return {"problems": problems, "worst": worst}


class LocalExpertNet(nn.Module):
    """A shared trunk and head around a rank-local expert (the mixture-of-experts case where each
    rank holds its own expert): the expert's parameters must never be communicated."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 24), nn.ReLU())
        self.expert = nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24))
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        return self.head(h + self.expert(h))


def _local_expert_model(rank: int, local: list[str]) -> nn.Module:
    """The same values on every rank, except the parameters named in ``local`` (rank-local)."""
    torch.manual_seed(0)
    model = LocalExpertNet()
    g = torch.Generator().manual_seed(1000 + rank)  # each rank's own expert
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in local:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def ignored_and_styles(rank: int, world: int, cases: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Each case (style, optimizer, DataParallel keywords) trains 6 steps compiled and under DDP
    (which ignores the same parameters); losses and parameters must be equal bit for bit."""
    problems: list[str] = []
    for style, opt_name, knobs in cases:
        tag = f"{style}/{opt_name}/{knobs}"
        mods = ["expert" if m == "<expert object>" else m for m in knobs.get("ignored_modules", [])]
        names = [n for n, _ in LocalExpertNet().named_parameters()]
        ignored_names = [
            n
            for n in names
            if n in knobs.get("ignored_params", ()) or any(n.startswith(m + ".") for m in mods)
        ]
        model = _local_expert_model(rank, ignored_names)
        ref_model = copy.deepcopy(model)
        DDP._set_params_and_buffers_to_ignore_for_model(ref_model, ignored_names)
        ddp = DDP(ref_model)
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        knobs = {k: ([model.expert] if v == ["<expert object>"] else v) for k, v in knobs.items()}
        step = spmd.compile(parallel_mode=spmd.DataParallel(style, **knobs), check_invariants=True)(
            train_step
        )
        losses = []
        for i in range(6):
            b = pm.batch("mlp", i, rank)
            losses.append((step(model, opt, *b), train_step(ddp, ref_opt, *b)))
        problems += _compare(tag, model, ddp.module, losses, 0.0)[0]
        for n, p in model.named_parameters():
            local = n in ignored_names
            if local != (type(p.data) is torch.Tensor):
                problems.append(f"{tag}: {n} is {type(p.data).__name__}, ignored={local}")
        if "module_styles" in knobs:
            for n, p in model.named_parameters():
                want = (Replicate(),) if n.startswith("head") else (Shard(0),)
                if not n.startswith("expert") and p.placements != want:
                    problems.append(f"{tag}: {n} placements {p.placements}, want {want}")
        if ignored_names:  # the experts stayed rank-local: rank 0's differs from rank 1's
            mine = model.expert[0].weight.detach().clone()
            theirs = [torch.empty_like(mine) for _ in range(world)]
            torch.distributed.all_gather(theirs, mine)
            if torch.equal(theirs[0], theirs[1]):
                problems.append(f"{tag}: the ignored experts are equal on all ranks")
    return problems
