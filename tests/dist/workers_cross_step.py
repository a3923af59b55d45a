"""Per-rank bodies of tests/dist/test_cross_step.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
import spmd.backend.carry as carry_module
from passes import collectives as C
from passes.cross_step import CARRIED
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import eval_step, train_step


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _compile(carry: bool, reshard: bool = True) -> spmd.CompiledStep:
    return spmd.compile(
        parallel_mode=spmd.DataParallel("fully_shard", reshard_after_forward=reshard),
        check_invariants=True,
        cross_step_prefetch=carry,
    )(train_step)


def parity(rank: int, world: int, combos: list[tuple[str, str]], steps: int = 6) -> dict[str, Any]:
    """fully_shard with cross-step prefetch against DDP, bit for bit; plus what the graph shows."""
    problems: list[str] = []
    reused: dict[str, int] = {}
    for model_name, opt_name in combos:
        tag = f"{model_name}/{opt_name}"
        model = pm.build(model_name)
        ddp = DDP(copy.deepcopy(model))
        opt, ref_opt = shared.make_optimizer(opt_name, model), shared.make_optimizer(opt_name, ddp.module)
        step = _compile(True)
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
                problems.append(f"{tag}: param {n} differs from DDP")
        reused[tag] = step._carry.reused
        step._carry.drain()
    final = step.graphs["final"]
    carried_in = [n.name for n in final.graph.nodes if n.op == "placeholder" and CARRIED in n.meta]
    outs = final.graph.output_node().args[0]
    carried_out = [o.name for o in outs if C.is_collective(o) and CARRIED in o.meta]
    return {"problems": problems, "reused": reused, "in": carried_in, "out": carried_out, "code": final.code}


def _pair(model_name: str, opt_name: str) -> tuple[Any, ...]:
    """Two identical models, one stepped with carried gathers, one without."""
    a, b = pm.build(model_name), pm.build(model_name)
    oa, ob = shared.make_optimizer(opt_name, a), shared.make_optimizer(opt_name, b)
    return a, b, oa, ob, _compile(True), _compile(False)


def _compare(tag: str, a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    return [
        f"{tag}: param {n} differs from the step without carried gathers"
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters())
        if not torch.equal(_full(p), _full(q))
    ]


def between_calls(
    rank: int, world: int, model_name: str, what: str, trust: bool = False, ckpt_dir: str = ""
) -> dict[str, Any]:
    """Train with and without carried gathers, doing ``what`` to both models between calls;
    every loss and the final parameters must agree bit for bit.

    ``trust=True`` disables the runtime's validity check (the carried gathers are always used),
    to show that the scenario would go wrong without it."""
    a, b, oa, ob, sa, sb = _pair(model_name, "adamw_fused")
    if trust:
        carry_module._keys = lambda params, shards: []  # every snapshot equal: never invalidated
    problems: list[str] = []
    saved: dict[str, Any] = {}

    def both(i: int, batch: tuple[torch.Tensor, ...]) -> None:
        try:
            la = sa(a, oa, *batch)
        except spmd.StalePrefetchError:
            problems.append("StalePrefetchError")
            la = None
        lb = sb(b, ob, *batch)
        if la is None:
            return
        if not torch.equal(la, lb):
            problems.append(f"{what}: step {i} loss {la.item()!r} != {lb.item()!r}")

    for i in range(6):
        batch = pm.batch(model_name, i, rank)
        if i == 1:
            saved = {k: v.detach().clone() for k, v in a.state_dict().items()}
            if what == "dcp":
                dcp.save({"model": a.state_dict()}, checkpoint_id=ckpt_dir)
        if i == 3:
            for m in (a, b):
                if what == "load_state_dict":
                    m.load_state_dict(saved)
                elif what == "dcp":  # loads in place into the parameters (DTensors)
                    dcp.load({"model": m.state_dict()}, checkpoint_id=ckpt_dir)
                elif what == "inplace":
                    with torch.no_grad():
                        for p in m.parameters():
                            p.mul_(0.5)
                elif what == "to_local":
                    with torch.no_grad():
                        for p in m.parameters():
                            p.to_local().mul_(0.5)
                elif what in ("dot_data", "dot_data_unseen"):  # .data has its own version counter
                    for p in m.parameters():
                        p.to_local().data.mul_(0.5)
                    if what == "dot_data" and m is a:
                        sa.invalidate_prefetch()
                elif what == "data":
                    for p in m.parameters():
                        p.data = p.data * 0.5
                elif what == "shape":
                    batch = tuple(torch.cat([t, t.flip(0)]) for t in batch)
                elif what == "eval":
                    m.eval()
                elif what == "eval_step":
                    ev = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"))(eval_step)
                    with torch.no_grad():
                        ev(m, *batch[:-1])
        if i == 4 and what == "eval":
            a.train()
            b.train()
        both(i, batch)
        if "StalePrefetchError" in problems:
            return {"problems": problems}
    problems += _compare(what, a, b)
    out = {"problems": problems, "reused": sa._carry.reused, "issued": sa._carry.issued}
    sa(a, oa, *pm.batch(model_name, 9, rank), last_train_step=True)
    sb(b, ob, *pm.batch(model_name, 9, rank))
    out["after_last"] = len(sa._carry.tensors)
    return out


def leave_in_flight(rank: int, world: int) -> int:
    """Return with a carried gather in flight (no last_train_step): the exit must not warn."""
    model = pm.build("mlp")
    opt = shared.make_optimizer("adamw_fused", model)
    step = _compile(True)
    for i in range(3):
        step(model, opt, *pm.batch("mlp", i, rank))
    _KEEP.append(step)  # alive until exit: drained by its finalizer then
    return len(step._carry.tensors)


_KEEP: list[Any] = []
