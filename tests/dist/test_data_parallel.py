"""Data-parallel parity against DistributedDataParallel on 2 gloo ranks, different data per rank.

Each test spawns its ranks once and runs a batch of (model, optimizer) combos in
them, to keep process start-up out of the suite's time.
"""

from __future__ import annotations

import pytest

from tests.dist import workers
from tests.dist.launcher import run_ranks

MODELS = ["mlp", "tinygpt", "nested", "transformer", "uneven"]
OPTIMIZERS = ["sgd_momentum_foreach", "adam_fused", "adamw_fused"]
ALL = [(m, o) for m in MODELS for o in OPTIMIZERS]
# replicate and no-reshard run a rotation through the matrix (each model once, every optimizer
# on some model); fully_shard with resharding, where shard layouts meet the optimizer kernels,
# runs all of it. Together every (model, optimizer) pair runs in two styles or more.
ROTATION = {
    "replicate": [(m, OPTIMIZERS[i % 3]) for i, m in enumerate(MODELS)],
    "fully_shard_noreshard": [(m, OPTIMIZERS[(i + 1) % 3]) for i, m in enumerate(MODELS)],
    "fully_shard": ALL,
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "style,reshard,combos",
    [
        ("replicate", True, ROTATION["replicate"]),
        ("fully_shard", True, ROTATION["fully_shard"]),
        ("fully_shard", False, ROTATION["fully_shard_noreshard"]),
    ],
    ids=["replicate", "fully_shard", "fully_shard_noreshard"],
)
def test_bitwise_parity_with_ddp(style: str, reshard: bool, combos: list[tuple[str, str]]) -> None:
    """Every step's local loss, the final (gathered) parameters and an eval step's output equal
    DDP's bit for bit, with different data on each rank."""
    results = run_ranks(workers.parity, 2, style, reshard, combos, timeout=540)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def test_clip_grad_norm_replicate_bitwise() -> None:
    """Replicate sees full gradients, so clip_grad_norm_ computes exactly DDP's norm."""
    combos = [("mlp", "sgd_momentum_foreach"), ("tinygpt", "adamw_fused")]
    results = run_ranks(workers.parity, 2, "replicate", True, combos, 10, True, 0.0, False)
    assert not [p for r in results for p in r]


def test_clip_grad_norm_fully_shard() -> None:
    """fully_shard computes the global norm from per-rank partial sums of squares (all-reduced),
    so the norm is summed in a different order than DDP's: equal up to float32 rounding of the
    clip coefficient, which moves parameters by ~1e-7 per step (tolerance 1e-5 over 10 steps).

    TinyGPT runs with SGD here: its attention key bias has an exactly-zero true gradient, and
    Adam normalises whatever rounding noise sits there into steps of size lr, so one ulp in
    the clip coefficient becomes a 1e-3 difference there (and nowhere else)."""
    combos = [("mlp", "adamw_fused"), ("tinygpt", "sgd_momentum_foreach"), ("uneven", "adam_fused")]
    results = run_ranks(workers.parity, 2, "fully_shard", True, combos, 10, True, 1e-5, False)
    assert not [p for r in results for p in r]


@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_structure(reshard: bool) -> None:
    """Each parameter is gathered before forward (and again before backward when resharding),
    each gradient is reduce-scattered once, and every collective has exactly one wait."""
    out = run_ranks(workers.structure, 2, reshard)[0]
    assert out["waits_ok"]
    assert out["first_use_ok"]
    for p_name, phases in out["gathers"].items():
        if not reshard:
            assert phases == ["forward"], (p_name, phases)
        elif p_name == "p_pos_weight" or (p_name.endswith("_bias") and "_ln" not in p_name):
            # Backward never reads these (an embedding's backward needs only the indices, a
            # Linear bias's gradient is a sum), so no second gather. LayerNorm backward reads
            # its weight and bias.
            assert phases == ["forward"], (p_name, phases)
        else:
            assert phases == ["forward", "backward"], (p_name, phases)
    n_params = len(out["params"])
    assert len(out["gathers"]) == n_params
    assert sorted(out["scatters"]) == sorted(out["params"])
    assert set(out["scatters"].values()) == {1}
