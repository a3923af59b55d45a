"""Per-rank bodies of tests/dist/test_optimizer_overlap.py's split-versus-unsplit tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from passes import collectives as C
from passes.graph_utils import mutated_nodes
from passes.meta import ROLE, Role
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _diff, _full, train_step


def first_update_and_last_wait(gm: fx.GraphModule) -> tuple[int, int]:
    """Graph positions of the first node that writes a parameter and of the last wait."""
    nodes = list(gm.graph.nodes)
    update = next(
        i for i, n in enumerate(nodes) if any(m.meta.get(ROLE) is Role.PARAM for m in mutated_nodes(n))
    )
    last_wait = max(i for i, n in enumerate(nodes) if C.is_wait(n))
    return update, last_wait


def split_parity(
    rank: int, world: int, style: str, combos: list[tuple[str, str]], steps: int, knobs: dict[str, Any]
) -> list[str]:
    """Train each (model, optimizer) with overlap_optimizer on, with it off, and under DDP.

    Reports: any difference between on and off (they must agree bit for bit, every
    optimizer); a difference from DDP for the optimizers whose traced math is eager's
    (``EXACT_OPTIMIZERS``); a graph whose first parameter update does not come before its
    last wait; an all-reduce (replicate) that is not in place."""
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
        update, last_wait = first_update_and_last_wait(on.graphs["final"])
        if update > last_wait:
            problems.append(f"{tag}: the first parameter update (node {update}) is after the last wait")
        if style == "replicate":
            reduces = [n for n in on.graphs["final"].graph.nodes if C.is_collective(n)]
            if not reduces or not all(C.is_inplace(n) for n in reduces):
                problems.append(f"{tag}: not every all-reduce is in place: {[n.target for n in reduces]}")
    return problems
