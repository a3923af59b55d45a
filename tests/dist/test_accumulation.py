"""Gradient accumulation: a step of k micro-batches is one graph with one reduction per gradient.

Compared with DDP's ``no_sync`` idiom on 2 gloo ranks with different data per rank.
"""

from __future__ import annotations

import pytest

from tests.dist import workers_accum
from tests.dist.launcher import run_ranks

COMBOS = [("mlp", "sgd_momentum_foreach"), ("tinygpt", "adamw_fused"), ("uneven", "adam_fused")]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "style,reshard",
    [("replicate", True), ("fully_shard", True), ("fully_shard", False)],
    ids=["replicate", "fully_shard", "fully_shard_noreshard"],
)
def test_accumulation_matches_ddp_no_sync(style: str, reshard: bool) -> None:
    """Every step's loss and the final parameters equal DDP's bit for bit, and the step
    reduces exactly the elements a one-micro-batch step reduces (not k times as many)."""
    results = run_ranks(workers_accum.parity, 2, style, reshard, COMBOS, timeout=360)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(300)
def test_accumulation_with_replicated_head_and_ignored_expert() -> None:
    """Micro-batches combined with per-parameter plans (a replicated head and a rank-local
    expert inside a fully_shard model): equal to DDP with no_sync, bit for bit."""
    results = run_ranks(workers_accum.combined, 2, timeout=240)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
