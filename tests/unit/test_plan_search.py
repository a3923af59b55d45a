"""How spmd.plan narrows its grid (spmd/plan/__init__.py, spmd/plan/bounds.py): configurations
whose state alone is over the budget are not lowered, each partitioning is lowered once with the
default pass options, remat policies stop at the first that fits, and the pass options are
searched around the best partitionings only. Stand-in lowerings: nothing is traced."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.nn as nn

from spmd.parallel import MixedPrecision
from spmd.plan import PlanRow, bounds
from spmd.plan.search import in_processes, refined_search, shares, within_budget
from tests.unit.test_spmd_plan import _row as stand_in_row

GiB = 2**30


def test_state_over_the_budget_is_not_lowered() -> None:
    """1 GiB of fp32 parameters + 2 GiB of AdamW state: replicate needs 3 GiB per rank, fully_shard
    on 8 ranks 0.375 GiB, hybrid_shard on a node of 4 0.75 GiB; keeping the gathered bf16
    parameters adds 0.5 GiB."""
    model = nn.Linear(2**14, 2**14, bias=False)  # 2**28 parameters: 1 GiB in fp32
    optim = torch.optim.AdamW(model.parameters())
    assert bounds.state_bytes(model, optim) == 3 * GiB
    bf16 = MixedPrecision(param_dtype=torch.bfloat16)
    configs = [
        {"parallel_style": "replicate"},
        {"parallel_style": "fully_shard"},
        {"parallel_style": "fully_shard", "reshard_after_forward": False, "mixed_precision": bf16},
        {"parallel_style": "hybrid_shard"},
        {"parallel_style": "replicate", "tp_size": 4},
    ]
    keep, skipped = within_budget(configs, (model, optim), {}, int(0.8 * GiB), 8, 4)
    assert keep == [configs[1], configs[3], configs[4]]
    assert [label for label, _ in skipped] == ["replicate", "fully_shard, no reshard, prefetch 1"]
    assert "parameters and optimizer state alone need 3.0 GiB" in skipped[0][1]
    assert "and gathered parameters alone need 0.9 GiB" in skipped[1][1]  # 0.375 + 0.5
    assert within_budget(configs, (model, optim), {}, None, 8, 4) == (configs, [])


def _row(opts: dict[str, Any], peak: float, step_s: float) -> PlanRow:
    row = stand_in_row(repr(opts), int(peak * GiB), step_s)
    return dataclasses.replace(row, options=opts, lower_s=0.0, exact=True)


def test_each_partitioning_once_remat_until_it_fits_pass_options_around_the_best() -> None:
    """Two partitionings (reshard on, off) x remat none/selective/full x prefetch 0/1/2 x unit
    1/64: 36 configurations. Stand-in predictions (budget 80): with reshard full fits (60),
    selective does not (90), so none (140) is not tried; without, full (20) and selective (50)
    fit, none (100) does not; prefetch 2 is faster, the unit size changes nothing."""
    configs = [
        {
            "parallel_style": "fully_shard",
            "reshard_after_forward": rs,
            "forward_prefetch": d,
            "backward_prefetch": d,
            "min_unit_mb": u,
            "remat": rm,
        }
        for rs in (True, False)
        for d in (0, 1, 2)
        for u in (1.0, 64.0)
        for rm in (None, "selective", "full")
    ]
    lowered: list[dict[str, Any]] = []

    def search(batch: list[dict[str, Any]]) -> list[PlanRow]:
        out = []
        for o in batch:
            lowered.append(o)
            peak = {None: 100, "selective": 50, "full": 20}[o["remat"]]
            peak += 40 if o["reshard_after_forward"] else 0
            step = {None: 1.0, "selective": 1.2, "full": 1.5}[o["remat"]] - 0.1 * o["forward_prefetch"]
            out.append(_row(o, peak, step))
        return out

    rows = refined_search(configs, search, 80 * GiB, refine=1)
    names = ("reshard_after_forward", "forward_prefetch", "min_unit_mb", "remat")
    keys = [tuple(o[k] for k in names) for o in lowered]
    assert keys == [
        # each partitioning with the default pass options (prefetch 1, unit 1 MiB), remat from full
        (True, 1, 1.0, "full"),
        (True, 1, 1.0, "selective"),
        (False, 1, 1.0, "full"),
        (False, 1, 1.0, "selective"),
        (False, 1, 1.0, None),
        # the best that fits (no reshard, selective): prefetch searched, then unit at prefetch 2
        (False, 0, 1.0, "selective"),
        (False, 2, 1.0, "selective"),
        (False, 2, 64.0, "selective"),
    ]
    assert len(rows) == 8
    best = min(rows, key=lambda r: (r.peak_bytes > 80 * GiB, r.step_s))
    assert best.options["forward_prefetch"] == 2 and best.options["remat"] == "selective"
    # refine=None: the whole grid
    lowered.clear()
    assert len(refined_search(configs, search, 80 * GiB, refine=None)) == 36
    # no budget: every remat policy (nothing fits or not), default pass options only
    lowered.clear()
    refined_search(configs, search, None, refine=0)
    assert len(lowered) == 6 and all(o["forward_prefetch"] == 1 for o in lowered)


def test_the_grid_splits_by_tp_size_into_forked_processes() -> None:
    """Whole tp sizes per share (their copies share traces and the automatic choice), the larger
    work first onto the least loaded share; each share runs in a child process."""
    configs = [
        {"parallel_style": "fully_shard", "tp_size": t, "remat": r} for t in (1, 2, 4) for r in (None, "full")
    ]
    parts = shares(configs, 2)
    assert [[o["tp_size"] for o in p] for p in parts] == [[2, 2, 1, 1], [4, 4]]
    assert shares(configs, 1) == [configs]
    assert shares(configs[:2], 4) == [configs[:2]]  # one tp size: one process
    pids = in_processes([os.getpid, os.getpid])
    assert len(pids) == 2 and os.getpid() not in pids  # run in children (one may take both)
