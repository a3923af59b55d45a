"""Parity at a world size that is not a power of two: 3 gloo ranks, different data per rank.

At W=2 dividing by the world size is exact, so "divide, then sum" and "sum, then divide" agree
and so do any two summation orders of two values. At W=3 neither holds:

* DDP (no comm hook) copies each gradient into its bucket as ``grad * (1 / W)`` and all-reduces
  with SUM; FSDP2 (fp32/bf16 reduce dtype) reduce-scatters with ``ReduceOp.AVG``, which gloo
  computes as sum then divide. replicate and fully_shard follow each.
* gloo's ring sums the three values in an order that depends on an element's offset in the
  buffer, so the bucket layout matters. DDP's first iteration lays buckets out in parameter
  order, and rebuilds them after it in the order gradients became ready, which is the order
  spmd's (static) bucketing uses at every step. The DDP reference here therefore runs one
  backward (gradients dropped, no optimizer step) before training; against a fresh DDP the
  first step differs in the last bits of some gradients (docs/parallel.md, "Parity with DDP and
  FSDP2": "World sizes that are not a power of two").
"""

from __future__ import annotations

import pytest

from tests.dist import workers_odd_world
from tests.dist.launcher import run_ranks


@pytest.mark.timeout(600)
def test_replicate_bitwise_with_ddp_three_ranks() -> None:
    """Losses and final parameters equal DDP's (buckets rebuilt) bit for bit at W=3."""
    combos = [
        ("mlp", "adamw_fused"),
        ("mlp", "sgd_momentum_foreach"),
        ("tinygpt", "adamw_fused"),
        ("uneven", "sgd_momentum_foreach"),
        ("nested", "adam_fused"),
        ("transformer", "sgd_momentum_foreach"),
    ]
    results = run_ranks(workers_odd_world.parity, 3, "replicate", combos, 6, timeout=540)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_fully_shard_bitwise_with_fsdp2_three_ranks() -> None:
    """Losses and final parameters equal FSDP2's (one unit per Linear, as ``workers_grads``)
    bit for bit at W=3, uneven shards included (16 rows over 3 ranks: 6, 6, 4)."""
    combos = [
        ("mlp", "sgd_momentum_foreach"),
        ("uneven", "adam_fused"),
        ("uneven", "sgd_momentum_foreach"),
        ("nested", "adamw_fused"),
    ]
    results = run_ranks(workers_odd_world.parity, 3, "fully_shard", combos, 6, timeout=540)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
@pytest.mark.xfail(strict=True, reason="known: <=1.5e-8 from FSDP2 after 6 steps, cause not found")
def test_fully_shard_mlp_fused_adamw_three_ranks() -> None:
    """MLP with fused AdamW: equal to FSDP2 after 1 step, not after 6 (largest difference
    1.5e-8; fused Adam 1e-9; SGD equal). Not the bucket layout: spmd's bucket mode and cap
    do not change it. Strict, so that a fix shows."""
    results = run_ranks(workers_odd_world.parity, 3, "fully_shard", [("mlp", "adamw_fused")], 6, timeout=540)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
