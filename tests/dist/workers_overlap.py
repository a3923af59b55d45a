"""Per-rank bodies of tests/dist/test_optimizer_overlap.py's split-versus-unsplit tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from passes import collectives as C
from passes.graph_utils import mutated_nodes, storage_of
from passes.meta import PHASE, ROLE, Phase, Role
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _diff, _full, train_step


def first_bucket_updated_before_last_wait(gm: fx.GraphModule) -> bool:
    """Whether a parameter update that reads the first gradient reduction issued runs before
    the wait of the last one (the last bucket's reduction overlaps the first bucket's update)."""
    nodes = list(gm.graph.nodes)
    reductions = [
        n
        for n in nodes
        if C.is_collective(n)
        and C.kind_of(n) in (C.Kind.ALL_REDUCE, C.Kind.REDUCE_SCATTER, C.Kind.ALL_TO_ALL)
        and n.meta.get(PHASE) is Phase.BACKWARD
    ]
    last_wait = nodes.index(C.wait_of(reductions[-1]))
    params = {storage_of(n) for n in nodes if n.op == "placeholder" and n.meta.get(ROLE) is Role.PARAM}
    reached = {C.wait_of(reductions[0])}
    for i, n in enumerate(nodes):
        if n not in reached and not any(x in reached for x in n.all_input_nodes):
            continue
        reached.add(n)
        written = mutated_nodes(n)
        reached.update(written)  # state written from the gradient carries it on (exp_avg, momentum)
        if any(storage_of(m) in params for m in written):  # through the alias ``mul_`` returns, too
            return i < last_wait
    return False


def split_parity(
    rank: int, world: int, style: str, combos: list[tuple[str, str]], steps: int, knobs: dict[str, Any]
) -> list[str]:
    """Train each (model, optimizer) with overlap_optimizer on, with it off, and under DDP.

    Reports: any difference between on and off (they must agree bit for bit, every
    optimizer); a difference from DDP for the optimizers whose traced math is eager's
    (``EXACT_OPTIMIZERS``); a graph where the first bucket's update does not start before
    the last bucket's wait; an all-reduce (replicate) that is not in place."""
    problems: list[str] = []
    for model_name, opt_name in combos:
        tag = f"{model_name}/{opt_name}/{style}"
        model = pm.build(model_name)
        off_model, ddp = copy.deepcopy(model), DDP(copy.deepcopy(model))
        opt = shared.make_optimizer(opt_name, model)
        off_opt = shared.make_optimizer(opt_name, off_model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        mode = spmd.DataParallel(style, **knobs)
        on = spmd.compile(parallel_mode=mode, check_invariants=True)(train_step)
        off = spmd.compile(parallel_mode=mode, disabled_passes=("overlap_optimizer",))(train_step)
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            got, base, ref = on(model, opt, *b), off(off_model, off_opt, *b), train_step(ddp, ref_opt, *b)
            if not torch.equal(got, base):
                problems.append(f"{tag}: step {i} loss {got.item()!r} != unsplit {base.item()!r}")
            if opt_name in shared.EXACT_OPTIMIZERS and not torch.equal(got, ref):
                problems.append(f"{tag}: step {i} loss {got.item()!r} != ddp {ref.item()!r}")
        for (n, p), (_, q), (_, r) in zip(
            model.named_parameters(), off_model.named_parameters(), ddp.module.named_parameters()
        ):
            if _diff(_full(p), _full(q)) > 0:
                problems.append(f"{tag}: param {n} differs from unsplit by {_diff(_full(p), _full(q))}")
            if opt_name in shared.EXACT_OPTIMIZERS and _diff(_full(p), r) > 0:
                problems.append(f"{tag}: param {n} differs from DDP by {_diff(_full(p), r)}")
        if not first_bucket_updated_before_last_wait(on.graphs["final"]):
            problems.append(f"{tag}: the first bucket's update does not start before the last wait")
        if style == "replicate":
            reduces = [n for n in on.graphs["final"].graph.nodes if C.is_collective(n)]
            if not reduces or not all(C.is_inplace(n) for n in reduces):
                problems.append(f"{tag}: not every all-reduce is in place: {[n.target for n in reduces]}")
    return problems
