"""Data-parallel training stays exact when the data is awkward: ranks with different local batch
sizes, random model shapes; and it is reproducible: the same seed gives the same bits.

Every comparison is against DistributedDataParallel on 2 gloo ranks, bit for bit (SGD and
fused Adam/AdamW, whose math is identical). Each test spawns its ranks once.
"""

from __future__ import annotations

from tests.dist import workers_reliability as w
from tests.dist.launcher import run_ranks


def _ok(results: list[list[str]]) -> None:
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def test_uneven_local_batches_match_ddp() -> None:
    """Rank 0 trains on 4 samples a step, rank 1 on 3: gradients are averaged over ranks (not
    samples), exactly as DDP does, for both styles."""
    combos = [
        ("replicate", "mlp", "sgd_momentum_foreach"),
        ("fully_shard", "mlp", "adamw_fused"),
        ("fully_shard", "tinygpt", "sgd_momentum_foreach"),
    ]
    _ok(run_ranks(w.uneven, 2, [4, 3], combos, timeout=200))


def test_last_batch_smaller_on_one_rank_matches_ddp() -> None:
    """The end of an epoch: three batches of 4 everywhere, then 3 samples on rank 1 only, so
    rank 1 traces a new graph (same collectives) while rank 0 reuses its own."""
    _ok(run_ranks(w.last_batch_smaller, 2, "replicate", timeout=120, pg_timeout=10))


def test_random_mlps_match_ddp() -> None:
    """A fixed sample of random MLPs (depth 1-4, widths 1-24), per-rank batch sizes (1-6),
    optimizer and style: the world-size-2 counterpart of tests/unit/test_properties.py."""
    configs = w.random_configs(6, seed=7)
    assert {c["style"] for c in configs} == {"replicate", "fully_shard"}
    _ok(run_ranks(w.random_mlps, 2, configs, timeout=200))


def test_same_seed_same_bits() -> None:
    """Two runs from one seed, with dropout in the graph: identical losses and parameters, in
    both styles."""
    _ok(run_ranks(w.determinism, 2, ["replicate", "fully_shard"], timeout=200))
