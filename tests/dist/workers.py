"""Per-rank bodies of the data-parallel tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from passes.optimizer_overlap import is_fused_optimizer
from tests import models as shared
from tests.dist import parity_models as pm


def train_step(model, optim, *batch):
    *xs, y = batch
    loss = shared.loss_fn(model(*xs), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def train_step_clip(model, optim, *batch):
    *xs, y = batch
    loss = shared.loss_fn(model(*xs), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad()
    return loss


def eval_step(model, *xs):
    return model(*xs)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def parity(
    rank: int,
    world: int,
    style: str,
    reshard: bool,
    combos: list[tuple[str, str]],
    steps: int = 10,
    clip: bool = False,
    atol: float = 0.0,
    check_eval: bool = True,
    knobs: dict[str, Any] | None = None,
    expect_split: bool = False,
) -> list[str]:
    """Train every (model, optimizer) combo compiled and under DDP; return the mismatches.

    ``knobs`` go to ``DataParallel``; ``expect_split``: a fused optimizer must have been split
    into several calls by ``overlap_optimizer`` (else that is reported too)."""
    problems: list[str] = []
    for model_name, opt_name in combos:
        tag = f"{model_name}/{opt_name}/{style}/reshard={reshard}/clip={clip}"
        model = pm.build(model_name)
        ddp = DDP(copy.deepcopy(model))
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        fn = train_step_clip if clip else train_step
        step = spmd.compile(
            parallel_mode=spmd.DataParallel(style, reshard_after_forward=reshard, **(knobs or {})),
            check_invariants=True,
        )(fn)
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            torch.manual_seed(100 + i)
            loss = step(model, opt, *b)
            torch.manual_seed(100 + i)
            ref = fn(ddp, ref_opt, *b)
            # Keep stepping after a mismatch: a rank that stopped early would leave the other
            # waiting in a collective.
            if not (torch.equal(loss, ref) if atol == 0 else torch.allclose(loss, ref, rtol=0, atol=atol)):
                problems.append(f"{tag}: step {i} loss {loss.item()!r} != ddp {ref.item()!r}")
        if expect_split and "fused" in opt_name:
            calls = [n for n in step.graphs["final"].graph.nodes if is_fused_optimizer(n)]
            if len(calls) < 2:
                problems.append(f"{tag}: the fused optimizer was not split ({len(calls)} call)")
        for (n, p), (_, q) in zip(model.named_parameters(), ddp.module.named_parameters()):
            full = _full(p)
            if full.shape != q.shape or _diff(full, q) > atol:
                problems.append(f"{tag}: param {n} differs from DDP by {_diff(full, q)}")
        if check_eval:
            model.eval()
            ddp.eval()
            ev = spmd.compile(parallel_mode=spmd.DataParallel(style, reshard_after_forward=reshard))(
                eval_step
            )
            b = pm.batch(model_name, 99, rank)[:-1]
            with torch.no_grad():  # as users evaluate; also selects nn.Transformer's inference path
                want = ddp(*b)
                got = ev(model, *b)
            if _diff(got, want) > atol:
                problems.append(f"{tag}: eval output differs from DDP by {_diff(got, want)}")
    return problems


def structure(rank: int, world: int, reshard: bool) -> dict[str, Any]:
    """Collective counts of a fully_shard TinyGPT graph, per parameter."""
    from passes import collectives as C
    from passes.meta import GRAD_OF, PHASE, Phase

    model = pm.build("tinygpt")
    opt = shared.make_optimizer("adamw_fused", model)
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", reshard_after_forward=reshard))(
        train_step
    )
    step(model, opt, *pm.batch("tinygpt", 0, rank))
    gm = step.graphs["partitioned"]
    gathers: dict[str, list[str]] = {}
    scatters: dict[str, int] = {}
    waits_ok = True
    first_use_ok = True
    for n in gm.graph.nodes:
        if not C.is_collective(n):
            continue
        if len(C.waits_of(n)) != 1:
            waits_ok = False
        if C.kind_of(n) is C.Kind.ALL_GATHER:
            src = n.args[0]
            while src.op != "placeholder":
                src = src.args[0]
            gathers.setdefault(src.name, []).append(n.meta[PHASE].value)
        elif C.kind_of(n) is C.Kind.REDUCE_SCATTER:
            w = C.wait_of(n)
            users = list(w.users)
            name = next((u.meta.get(GRAD_OF) for u in [w, *users] if u.meta.get(GRAD_OF)), None)
            scatters[name] = scatters.get(name, 0) + 1
    # every use of a parameter placeholder outside the optimizer goes through a gather
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("p_"):
            for u in n.users:
                if u.meta.get(PHASE) is not Phase.OPTIMIZER and not (
                    C.is_collective(u) or u.target is torch.ops.aten.constant_pad_nd.default
                ):
                    first_use_ok = False
    params = [n for n, p in model.named_parameters()]
    return {
        "gathers": gathers,
        "scatters": scatters,
        "waits_ok": waits_ok,
        "first_use_ok": first_use_ok,
        "params": params,
    }


def _dcp_load(mode: spmd.DataParallel, model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt: str) -> None:
    """Distribute a fresh model and optimizer, then load a DCP checkpoint into them."""
    import torch.distributed.checkpoint as dcp

    mode.distribute(model, opt)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])


def checkpoint_resume_tp(rank: int, world: int, ckpt_dir: str) -> list[str]:
    """FSDP x TP with automatic placements on 2 x 2 ranks: TinyGPT's fused ``qkv`` is split by
    groups (``_StridedShard``: a rank's rows are not one block of the full tensor, which DCP's
    chunks must be). Train 2 steps, save with DCP, train 2 more; a fresh model (the placements
    given as ``tp_plan_of`` the first) loads the checkpoint and trains the same 2 steps: parameters
    and losses must equal the uninterrupted run (spmd.parallel.checkpoint_layout). A model distributed
    before its optimizer is built saves the optimizer's state too."""
    import torch.distributed.checkpoint as dcp

    problems: list[str] = []
    data = rank // 2  # the batch of this rank's data-parallel index (mesh dp x tp, tp inner)

    def fresh(mode: spmd.DataParallel) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
        model = pm.build("tinygpt")
        opt = shared.make_optimizer("adamw_fused", model)
        return model, opt, spmd.compile(parallel_mode=mode)(train_step)

    model, opt, step = fresh(spmd.DataParallel("fully_shard", tp_size=2, tp_plan="auto"))
    for i in range(2):
        step(model, opt, *pm.batch("tinygpt", i, data))
    strided = [n for n, p in model.named_parameters() if "_StridedShard(dim=0, sf=3)" in str(p.placements)]
    if not strided:
        problems.append(f"no parameter split by groups: {[str(p.placements) for p in model.parameters()]}")
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt_dir)
    losses = [step(model, opt, *pm.batch("tinygpt", i, data)) for i in range(2, 4)]

    mode2 = spmd.DataParallel("fully_shard", tp_size=2, tp_plan=spmd.tp_plan_of(model))
    # The model distributed alone, its optimizer built after (over the DTensors): the optimizer's
    # state saves too, hooked when the step first sees it.
    model3 = pm.build("tinygpt")
    mode2.distribute(model3)
    opt3 = shared.make_optimizer("adamw_fused", model3)
    spmd.compile(parallel_mode=mode2)(train_step)(model3, opt3, *pm.batch("tinygpt", 0, data))
    dcp.save({"optim": opt3.state_dict()}, checkpoint_id=ckpt_dir + "_later")

    model2, opt2, step2 = fresh(mode2)
    _dcp_load(mode2, model2, opt2, ckpt_dir)
    losses2 = [step2(model2, opt2, *pm.batch("tinygpt", i, data)) for i in range(2, 4)]
    for i, (a, b) in enumerate(zip(losses, losses2)):
        if not torch.equal(a, b):
            problems.append(f"resumed step {i} loss {b.item()!r} != {a.item()!r}")
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        if not torch.equal(_full(p), _full(q)) or p.placements != q.placements:
            problems.append(f"resumed {n}: {_diff(_full(p), _full(q))}, {p.placements} vs {q.placements}")
    return problems


def checkpoint_resume(rank: int, world: int, style: str, ckpt_dir: str) -> list[str]:
    """Train 3 steps, save with DCP, train 3 more; a fresh model loads the checkpoint and
    trains the same 3 steps: parameters and losses must equal the uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    mode = spmd.DataParallel(style)
    problems: list[str] = []

    def fresh():
        model = pm.build("tinygpt")
        opt = shared.make_optimizer("adamw_fused", model)
        step = spmd.compile(parallel_mode=mode)(train_step)
        return model, opt, step

    model, opt, step = fresh()
    for i in range(3):
        step(model, opt, *pm.batch("tinygpt", i, rank))
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt_dir)
    losses = [step(model, opt, *pm.batch("tinygpt", i, rank)) for i in range(3, 6)]

    model2, opt2, step2 = fresh()
    _dcp_load(mode, model2, opt2, ckpt_dir)
    losses2 = [step2(model2, opt2, *pm.batch("tinygpt", i, rank)) for i in range(3, 6)]
    for i, (a, b) in enumerate(zip(losses, losses2)):
        if not torch.equal(a, b):
            problems.append(f"{style}: resumed step {i} loss {b.item()!r} != {a.item()!r}")
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        if not torch.equal(_full(p), _full(q)):
            problems.append(f"{style}: resumed param {n} differs by {_diff(_full(p), _full(q))}")
        if type(p.data) is not type(q.data) or getattr(p, "placements", None) != getattr(
            q, "placements", None
        ):
            ours, theirs = getattr(p, "placements", None), getattr(q, "placements", None)
            problems.append(f"{style}: {n} placements {ours} vs {theirs}")
    return problems


def divergent(rank: int, world: int, style: str) -> str:
    """Rank 1 builds a model with an extra layer: compiling must fail on both ranks, not hang."""
    import time

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU()]
    if rank == 1:
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style))(train_step)
    t0 = time.perf_counter()
    try:
        step(model, opt, *pm.batch("mlp", 0, rank))
    except spmd.RankDivergenceError as exc:
        return f"{time.perf_counter() - t0:.1f}s {exc}"
    return "no error"


def sync_and_export(rank: int, world: int, style: str) -> list[str]:
    """Different initial values on every rank + sync_module_states=True train like DDP, which
    starts from rank 0's values; spmd.full_state_dict then loads into a plain model on rank 0."""
    problems: list[str] = []
    ref_model = pm.build("mlp")  # rank 0's values, seed 0 on every rank
    torch.manual_seed(1000 + rank)  # a different init on every rank
    model = pm.MODELS["mlp"][0]()
    if rank == 1 and all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters())):
        problems.append("test bug: ranks did not start from different values")
    ddp = DDP(copy.deepcopy(model))  # DDP broadcasts rank 0's values at construction
    opt = shared.make_optimizer("adamw_fused", model)
    ref_opt = shared.make_optimizer("adamw_fused", ddp.module)
    mode = spmd.DataParallel(style, sync_module_states=True)
    step = spmd.compile(parallel_mode=mode)(train_step)
    for i in range(5):
        b = pm.batch("mlp", i, rank)
        loss, ref = step(model, opt, *b), train_step(ddp, ref_opt, *b)
        if not torch.equal(loss, ref):
            problems.append(f"{style}: step {i} loss {loss.item()!r} != ddp {ref.item()!r}")
    sd = spmd.full_state_dict(model)
    if rank == 0:
        plain = pm.MODELS["mlp"][0]()
        plain.load_state_dict(sd)
        for (n, p), (_, q) in zip(plain.named_parameters(), ddp.module.named_parameters()):
            if type(p.data) is not torch.Tensor or not torch.equal(p, q):
                problems.append(f"{style}: full_state_dict {n} differs from DDP")
    elif sd:
        problems.append("full_state_dict returned values on rank 1 with rank0_only=True")
    return problems


# ----------------------------------------------------------------------------- elastic resume


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor as a full tensor, by name (``tok.weight``,
    ``tok.weight/exp_avg``); collective under fully_shard (every rank calls it)."""
    out = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"{n}/{k}"] = _full(v).detach().clone()
    return out


# An MLP: quick to compile, and its shards are uneven at 3 ranks (fc2's 4 rows: 2, 2, 0) and
# 1 row at 4 ranks, so a resume reshards padded and empty shards.
ELASTIC_MODEL = "mlp"


def elastic_save(rank: int, world: int, ckpt_dir: str) -> None:
    """fully_shard at ``world`` ranks: 2 steps, then a DCP checkpoint (``ckpt_dir/dcp``) and,
    from rank 0, the full tensors it holds (``ckpt_dir/full.pt``), the reference of a resume."""
    import torch.distributed.checkpoint as dcp

    model = pm.build(ELASTIC_MODEL)
    opt = shared.make_optimizer("adamw_fused", model)
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"))(train_step)
    for i in range(2):
        step(model, opt, *pm.batch(ELASTIC_MODEL, i, rank))
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{ckpt_dir}/dcp")
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, f"{ckpt_dir}/full.pt")


def elastic_resume(rank: int, world: int, style: str, ckpt_dir: str) -> list[str]:
    """Load the checkpoint :func:`elastic_save` wrote into a fresh model at this world size
    (world 1: no process group) with the documented recipe -- ``distribute``, DCP load,
    ``load_state_dict`` -- and check every parameter and optimizer state equals the saved full
    tensor. Then one more step on this rank's batch: its loss equals an eager forward of the
    saved parameters (the forward computes on exact gathered values at any world size), and
    where the math is identical (world 1: eager; replicate at 2: DDP) so do the parameters
    and optimizer state after the step."""
    import torch.distributed.checkpoint as dcp

    tag = f"{style} at {world} rank(s)"
    saved = torch.load(f"{ckpt_dir}/full.pt")
    mode = spmd.DataParallel(style)
    model = pm.build(ELASTIC_MODEL)
    opt = shared.make_optimizer("adamw_fused", model)
    mode.distribute(model, opt)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=f"{ckpt_dir}/dcp")
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    problems = []
    got = _full_state(model, opt)
    if got.keys() != saved.keys():
        problems.append(f"{tag}: resumed state has {sorted(got.keys() ^ saved.keys())} different from saved")
    for k in saved.keys() & got.keys():
        if got[k].shape != saved[k].shape or not torch.equal(got[k], saved[k]):
            problems.append(f"{tag}: {k} differs from the saved value")

    # The reference: a plain model and optimizer holding the saved values.
    ref = pm.build(ELASTIC_MODEL)
    ref_opt = shared.make_optimizer("adamw_fused", ref)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(saved[n])
            ref_opt.state[p] = {k.split("/")[1]: v.clone() for k, v in saved.items() if k.startswith(f"{n}/")}
    b = pm.batch(ELASTIC_MODEL, 2, rank)
    with torch.no_grad():
        want = shared.loss_fn(ref(*b[:-1]), b[-1])
    step = spmd.compile(parallel_mode=mode)(train_step)
    loss = step(model, opt, *b)
    if not (torch.isfinite(loss) and torch.equal(loss, want)):
        problems.append(f"{tag}: loss {loss.item()!r} after resuming, eager forward {want.item()!r}")
    exact = world == 1 or (style == "replicate" and world == 2)
    if exact:
        train_step(ref if world == 1 else DDP(ref), ref_opt, *b)
        after, ref_after = _full_state(model, opt), _full_state(ref, ref_opt)
        for k, v in ref_after.items():
            if not torch.equal(after[k], v):
                problems.append(
                    f"{tag}: {k} after one step differs from the reference by {_diff(after[k], v)}"
                )
    return problems


def gloo_threads_step(
    rank: int, world: int, style: str, knobs: dict[str, Any], user_mesh: bool = False
) -> dict[str, Any]:
    """Three fused-AdamW steps of TinyGPT on the group the launcher made (``user_mesh``: on a
    mesh the script made with ``init_device_mesh``, else on spmd's default mesh): the gloo worker
    threads of the default group and of the group spmd's collectives run on, the most
    collectives the final graph has in flight at once, losses and the full parameters after
    the steps."""
    from torch.distributed.device_mesh import init_device_mesh

    from passes import collectives as C
    from passes import torch_compat

    if user_mesh:
        knobs = {**knobs, "mesh": init_device_mesh("cpu", (world,))}
    torch.manual_seed(0)
    model = pm.build("tinygpt")
    opt = shared.make_optimizer("adamw_fused", model)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style, **knobs))(train_step)
    losses = [step(model, opt, *pm.batch("tinygpt", i, rank)).item() for i in range(3)]
    outstanding: set[Any] = set()
    most = 0
    for n in step.graphs["final"].graph.nodes:
        if C.is_collective(n):
            outstanding.add(n)
            most = max(most, len(outstanding))
        elif C.is_wait(n):
            outstanding.discard(C.collective_of(n))
    # cross_step_prefetch carries a gather in flight across calls: off where one is the limit.
    from passes.cross_step import CARRIED

    carry_model = pm.build("tinygpt")
    carry_opt = shared.make_optimizer("adamw_fused", carry_model)
    carry_mode = spmd.DataParallel(style, **knobs)
    carry = spmd.compile(parallel_mode=carry_mode, cross_step_prefetch=True)(train_step)
    carry(carry_model, carry_opt, *pm.batch("tinygpt", 0, rank))
    carried = any(CARRIED in n.meta for n in carry.graphs["final"].graph.nodes)
    groups = {C.group_of(n) for n in C.collectives(step.graphs["final"].graph)}
    default = torch_compat.get_default_group()
    return {
        "threads": torch_compat.gloo_threads(default),
        "spmd_threads": {torch_compat.gloo_threads(torch_compat.resolve_process_group(g)) for g in groups},
        "spmd_on_default": any(torch_compat.resolve_process_group(g) is default for g in groups),
        "most_in_flight": most,
        "carried": carried,
        "losses": losses,
        "params": {n: _full(p) for n, p in model.named_parameters()},
    }
