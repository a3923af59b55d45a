"""overlap_optimizer on 2 gloo ranks: the fused optimizer, split into one call per bucket, still
matches DDP bit for bit (with clip_grad_norm_ too, which holds every update back until the norm
is complete); small buckets in replicate so that there is more than one bucket to split by."""

from __future__ import annotations

import pytest

from tests.dist import workers
from tests.dist.launcher import run_ranks

COMBOS = [("tinygpt", "adamw_fused"), ("uneven", "adam_fused"), ("mlp", "adamw_fused")]
SMALL_BUCKETS = {"bucket_cap_mb": 0.0002}  # ~200 bytes: several buckets even for the tiny models


@pytest.mark.timeout(300)
@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_split_optimizer_bitwise_with_ddp(style: str) -> None:
    knobs = SMALL_BUCKETS if style == "replicate" else {"min_unit_mb": 0}
    results = run_ranks(
        workers.parity, 2, style, True, COMBOS, 5, False, 0.0, False, knobs, True, timeout=280
    )
    assert not [p for r in results for p in r]


@pytest.mark.timeout(300)
def test_split_optimizer_with_clip_grad_norm_replicate_bitwise() -> None:
    """The clip scales every gradient by a global coefficient: the split calls all wait for it
    (one group, nothing to split), and the result is still DDP's bit for bit."""
    combos = [("tinygpt", "adamw_fused")]
    results = run_ranks(
        workers.parity, 2, "replicate", True, combos, 5, True, 0.0, False, SMALL_BUCKETS, False, timeout=280
    )
    assert not [p for r in results for p in r]


@pytest.mark.timeout(300)
def test_split_optimizer_with_clip_grad_norm_fully_shard() -> None:
    """fully_shard's global norm is summed in another order than DDP's (tolerance as in
    test_data_parallel.test_clip_grad_norm_fully_shard)."""
    combos = [("mlp", "adamw_fused")]
    results = run_ranks(
        workers.parity,
        2,
        "fully_shard",
        True,
        combos,
        5,
        True,
        1e-5,
        False,
        {"min_unit_mb": 0},
        False,
        timeout=280,
    )
    assert not [p for r in results for p in r]


ALL_FORMS = [
    ("tinygpt", "sgd_momentum_foreach"),
    ("tinygpt", "adam_foreach"),
    ("tinygpt", "adamw_forloop"),
    ("tinygpt", "adamw_fused"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_every_optimizer_form_split_bitwise(style: str) -> None:
    """SGD(momentum, foreach), Adam(foreach), AdamW(for-loop) and fused AdamW with the split on:
    bit for bit with the split off, and with DDP where the traced math is eager's (SGD, fused);
    the first bucket's update starts before the last bucket's wait; replicate reduces in place."""
    from tests.dist import workers_overlap

    knobs = SMALL_BUCKETS if style == "replicate" else {"min_unit_mb": 0}
    results = run_ranks(workers_overlap.split_parity, 2, style, ALL_FORMS, 4, knobs, timeout=580)
    assert not [p for r in results for p in r]
