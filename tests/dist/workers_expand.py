"""Per-rank bodies of the DTensorExpandMode tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import eval_step, train_step, train_step_clip

# Megatron-style tensor parallelism of tests.models.TinyGPT on the "tp" mesh dimension: the first
# projection of attention (qkv) and of the MLP (fc) column-parallel (weight and bias Shard(0)),
# the second (proj, out) row-parallel (weight Shard(1)); the token embedding (tied to the head)
# sharded on the vocabulary, the position embedding on the hidden dimension.
TP = {
    "blocks.*.qkv.*": Shard(0),
    "blocks.*.fc.*": Shard(0),
    "blocks.*.proj.weight": Shard(1),
    "blocks.*.out.weight": Shard(1),
    "tok.weight": Shard(0),
    "pos.weight": Shard(1),
}
# tests.models.MaskedGPT has separate q, k, v projections: column-parallel, they shard the heads.
TP_MASKED = {"blocks.*.[qkv].*": Shard(0), **TP}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def defaults_vs_ddp(rank: int, world: int, combos: list[tuple[str, str]], steps: int = 6) -> list[str]:
    """DTensorExpandMode() with its defaults, DataParallel("replicate") and DDP, different data per
    rank: every step's loss and the final parameters bit for bit."""
    problems: list[str] = []
    for model_name, opt_name in combos:
        tag = f"{model_name}/{opt_name}"
        model = pm.build(model_name)
        dp_model = copy.deepcopy(model)
        ddp = DDP(copy.deepcopy(model))
        opt = shared.make_optimizer(opt_name, model)
        dp_opt = shared.make_optimizer(opt_name, dp_model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        step = spmd.compile(parallel_mode=spmd.DTensorExpandMode(), check_invariants=True)(train_step)
        dp_step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"))(train_step)
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            loss = step(model, opt, *b)
            dp_loss = dp_step(dp_model, dp_opt, *b)
            ref = train_step(ddp, ref_opt, *b)
            if not (torch.equal(loss, ref) and torch.equal(dp_loss, ref)):
                problems.append(
                    f"{tag}: step {i} loss {loss.item()!r} / dp {dp_loss.item()!r} != ddp {ref.item()!r}"
                )
        for (n, p), (_, d), (_, q) in zip(
            model.named_parameters(), dp_model.named_parameters(), ddp.module.named_parameters()
        ):
            if not torch.equal(_full(p), q):
                problems.append(f"{tag}: param {n} differs from DDP by {_diff(_full(p), q)}")
            if not torch.equal(_full(p), _full(d)):
                problems.append(f"{tag}: param {n} differs from DataParallel('replicate')")
        if not all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in model.parameters()):
            problems.append(f"{tag}: parameters are not Replicate() DTensors")
        # A second compiled function (an eval step) on the distributed model: DDP's local output.
        model.eval()
        ddp.eval()
        ev = spmd.compile(parallel_mode=spmd.DTensorExpandMode())(eval_step)
        xs = pm.batch(model_name, 99, rank)[:-1]
        with torch.no_grad():
            got, want = ev(model, *xs), ddp(*xs)
        if not torch.equal(got, want):
            problems.append(f"{tag}: eval output differs from DDP by {_diff(got, want)}")
    return problems


def _tp_placements(mesh_ndim: int, tp: dict[str, Any] = TP) -> dict[str, Any]:
    if mesh_ndim == 1:
        return dict(tp)
    return {k: (Replicate(), v) for k, v in tp.items()}


def _masked_diff(name: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, leaving out the key third of an attention ``qkv.bias`` under Adam.

    That bias gets a gradient of exactly 0 in exact arithmetic (softmax ignores a constant
    added to every key score), so both sides see rounding noise, which Adam normalises into
    lr-sized steps of either sign (see DESIGN: "amplified by Adam ... attention key bias").
    """
    if name.endswith("qkv.bias"):
        d = a.shape[0] // 3
        a, b = torch.cat([a[:d], a[2 * d :]]), torch.cat([b[:d], b[2 * d :]])
    return _diff(a, b)


def tensor_parallel(
    rank: int,
    world: int,
    mesh_shape: dict[str, int],
    optim: str = "adamw",
    clip: bool = False,
    steps: int = 5,
    mask_heads: int = 0,
) -> dict[str, Any]:
    """TinyGPT with Megatron placements (on a 1-D "tp" mesh, or a 2-D "dp" x "tp" one) against
    single-device training on the global batch. Returns the largest differences, the local shapes
    of the sharded weights and the report's bytes. ``mask_heads``: MaskedGPT instead, its
    explicit attention mask of that many heads."""
    torch.manual_seed(0)  # the same initial values on every rank
    model = shared.MaskedGPT(mask_heads=mask_heads) if mask_heads else shared.TinyGPT()
    ref = copy.deepcopy(model)
    initial = [p.detach().clone() for p in model.parameters()]
    if optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, fused=True)
    mode = spmd.DTensorExpandMode(
        mesh_shape,
        param_placements=_tp_placements(len(mesh_shape), TP_MASKED if mask_heads else TP),
        input_placements=None if "dp" in mesh_shape else (Replicate(),),
    )
    fn = train_step_clip if clip else train_step  # clip: a global norm over sharded gradients
    step = spmd.compile(parallel_mode=mode, check_invariants=True)(fn)
    dp = mesh_shape.get("dp", 1)
    dp_rank = rank // (world // dp)  # row-major mesh: ranks of one dp index are consecutive
    loss_diff = 0.0
    for i in range(steps):
        batches = [pm.batch("tinygpt", i, r) for r in range(dp)]  # every dp shard's batch
        x, y = batches[dp_rank]
        loss = step(model, opt, x, y)
        gx, gy = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        want = fn(ref, ref_opt, gx, gy)
        got = loss.clone()
        dist.all_reduce(got)  # the mean of the dp shards' local losses (each tp rank holds it too)
        loss_diff = max(loss_diff, _diff(got / world, want))
    param_diff = {
        n: _masked_diff(n, _full(p), q)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
    }
    moved = max(_diff(q, p0) for q, p0 in zip(ref.parameters(), initial))
    local_shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    placements = {n: tuple(str(x) for x in p.placements) for n, p in model.named_parameters()}
    report = step.report()
    gm = step.graphs["partitioned"]
    annotated = sum(1 for n in gm.graph.nodes if n.meta.get("spmd_expand_placements") is not None)
    return {
        "loss_diff": loss_diff,
        "param_diff": max(param_diff.values()),
        "worst": max(param_diff, key=param_diff.__getitem__),
        "moved": moved,
        "local_shapes": local_shapes,
        "placements": placements,
        "param_bytes": report.param_bytes,
        "optim_state_bytes": report.optim_state_bytes,
        "collectives": {k: v.count for k, v in report.collectives.items()},
        "annotated_nodes": annotated,
        "param_placement_comment": next(
            (n.meta.get("spmd_placement") for n in gm.graph.nodes if n.name == "p_blocks_0_fc_weight"), None
        ),
    }


# ----------------------------------------------------------------------------- Override with placements


@torch.library.custom_op("spmd_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, s: float) -> torch.Tensor:
    """An op DTensor has no sharding strategy for (elementwise, so any placement would do)."""
    return torch.tanh(x) * s


@scaled_tanh.register_fake
def _(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.s = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    (x,) = ctx.saved_tensors
    return grad * ctx.s * (1 - torch.tanh(x) ** 2), None


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class HostAct(torch.nn.Module):
    """A linear layer and an activation that reads a tensor's value in Python: untraceable."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * float(x.abs().max().item() > -1)


class ScaledTanh(torch.nn.Module):
    """The traceable stand-in: the original's linear layer, then the custom op."""

    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_tanh(self.lin(x), 1.0)


class ActMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.act = HostAct()
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LocalAct(spmd.Override):
    """Swap ``act`` for ScaledTanh; with ``declare``, say it takes and returns batch shards."""

    def __init__(self, declare: bool) -> None:
        self.declare = declare

    def replacement(self, fqn: str, orig: torch.nn.Module) -> torch.nn.Module:
        return ScaledTanh(orig.lin) if fqn == "act" else orig

    def placements(self, fqn: str) -> Any:
        return ((Shard(0),), (Shard(0),)) if self.declare and fqn == "act" else None


def override_vs_ddp(rank: int, world: int, steps: int = 4) -> list[str]:
    """An Override stand-in with a strategy-less custom op, declared Shard(0) in and out: trains
    bit for bit like DDP over a model with the same stand-in."""
    torch.manual_seed(0)
    model = ActMLP()
    ref = copy.deepcopy(model)
    ref.act = LocalAct(True).replacement("act", ref.act)
    ddp = DDP(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    ref_opt = torch.optim.SGD(ddp.module.parameters(), lr=0.1, momentum=0.9, fused=True)
    step = spmd.compile([LocalAct(True)], parallel_mode=spmd.DTensorExpandMode(), check_invariants=True)(
        train_step
    )
    problems = []
    for i in range(steps):
        x, y = pm.batch("mlp", i, rank)
        loss = step(model, opt, x, y)
        want = train_step(ddp, ref_opt, x, y)
        if not torch.equal(loss, want):
            problems.append(f"override: step {i} loss {loss.item()!r} != ddp {want.item()!r}")
    for (n, p), (_, q) in zip(model.named_parameters(), ddp.module.named_parameters()):
        if not torch.equal(_full(p), q):
            problems.append(f"override: param {n} differs from DDP by {_diff(_full(p), q)}")
    gm = step.graphs["partitioned"]
    if not any(n.meta.get("spmd_expand_placements") == "local (act)" for n in gm.graph.nodes):
        problems.append("override: no node of the stand-in is marked local")
    return problems


def data_parallel_cases(rank: int, world: int, combos: list[tuple[str, str]]) -> list[str]:
    """defaults_vs_ddp and override_vs_ddp in one spawned job."""
    return defaults_vs_ddp(rank, world, combos) + override_vs_ddp(rank, world)
