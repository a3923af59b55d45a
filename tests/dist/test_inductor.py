"""backend='inductor' on 2 gloo ranks: replicate and fully_shard against the eager backend.

One spawned job covers every case (inductor compiles take tens of seconds each on
these cores): an MLP, fused AdamW, the steps of the measured choice between inductor's code
and the eager backend's graph (spmd.backend.step_aside, up to its cap) and one more, each,
then a deliberately reordered lowering that must raise LoweringError.
"""

from __future__ import annotations

import pytest

from spmd.backend import step_aside
from tests.dist import workers_inductor as wi
from tests.dist.launcher import run_ranks

W = 2
CASES = [("replicate", "mlp", "adamw_fused"), ("fully_shard", "mlp", "adamw_fused")]


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory, monkeypatch_module) -> list[dict]:
    # A fresh inductor cache: a .so truncated by a killed run corrupts later runs.
    monkeypatch_module.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor_cache")))
    monkeypatch_module.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return run_ranks(wi.inductor_vs_eager, W, CASES, timeout=400, pg_timeout=300)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_inductor_matches_eager_backend_in_place(per_rank) -> None:
    """Loss and every parameter within wi.TOL (1e-5) of the eager backend after each step (those
    that alternate inductor's code and the eager runtime included); parameters keep their storage
    (updated in place); the report names the backend."""
    for r, out in enumerate(per_rank):
        assert out["problems"] == [], f"rank {r}: {out['problems']}"
        assert set(out["max_diff"]) == {"/".join(c) for c in CASES}


def test_eager_candidate_is_the_eager_backends_graph(per_rank) -> None:
    """The eager candidate of the measured choice is the eager backend's final graph (with its
    in-place all-reduces and buffer reuse), on every rank and style."""
    for r, out in enumerate(per_rank):
        assert all(out["alt_is_eager"].values()) and len(out["alt_is_eager"]) == len(CASES), (
            r,
            out["alt_is_eager"],
        )


def test_generated_code_keeps_collective_order(per_rank) -> None:
    """The generated code issues exactly the final graph's collectives, in its order
    (checked inside compile_graph too; here the counts are pinned)."""
    for out in per_rank:
        assert out["orders"]["replicate/mlp/adamw_fused"] >= 1
        assert out["orders"]["fully_shard/mlp/adamw_fused"] >= 3  # gather, re-gather, reduce-scatter


def test_fully_shard_reduces_by_all_to_all_on_gloo(per_rank) -> None:
    """On gloo the inductor backend gets the eager backend's reduce_scatter_as_all_to_all too (gloo's
    reduce-scatter all-reduces the whole input: 38 vs 28 MiB on the wire per step on the bench
    encoder), and its code issues the all-to-all in the graph's order (checked when lowering)."""
    for out in per_rank:
        kinds = out["kinds"]["fully_shard/mlp/adamw_fused"]
        assert "all_to_all" in kinds and "reduce_scatter" not in kinds, kinds


def test_gemm_policy_is_the_same_on_every_rank(per_rank) -> None:
    """inductor_gemm='auto' (the default): with GEMM timings that disagree across ranks (replicate
    case: rank 0 finds oneDNN faster, rank 1 ATen) every rank lowers with rank 0's choice; with
    real timings (fully_shard case) the ranks' choices agree too."""
    for r, out in enumerate(per_rank):
        assert out["onednn"]["replicate/mlp/adamw_fused"], f"rank {r} did not follow rank 0's oneDNN choice"
    assert len({out["onednn"]["fully_shard/mlp/adamw_fused"] for out in per_rank}) == 1


def test_reordered_lowering_raises(per_rank) -> None:
    """A post-grad pass that issues one all-gather before another is caught, on every rank."""
    for out in per_rank:
        msg = out["reorder"]
        assert msg.startswith("spmd: inductor's code issues the collectives in a different order"), msg
        assert "first difference at collective #" in msg


def test_ranks_keep_the_same_callable(per_rank) -> None:
    """Replicate, injected step times (wi.STEP_MS): rank 0's own would stop after MIN_PAIRS and
    keep eager, rank 1's run to MAX_PAIRS and keep inductor; from the medians and spreads agreed
    over the ranks (max) both stop together, at MAX_PAIRS, and keep eager.
    fully_shard, real timings: the ranks agree on the choice, the medians and the length."""
    tag = "replicate/mlp/adamw_fused"
    pairs = step_aside.MAX_PAIRS
    for r, out in enumerate(per_rank):
        assert out["kept"][tag] == "eager", f"rank {r} kept {out['kept'][tag]}"
        assert out["measured_ms"][tag] == {"inductor": 10.0, "eager": 9.5}, out["measured_ms"][tag]
        assert out["measured_steps"][tag] == {"inductor": pairs, "eager": pairs}, out["measured_steps"][tag]
    tag = "fully_shard/mlp/adamw_fused"
    assert len({out["kept"][tag] for out in per_rank}) == 1
    assert per_rank[0]["kept"][tag] in ("inductor", "eager")
    assert all(out["measured_ms"][tag] == per_rank[0]["measured_ms"][tag] for out in per_rank)
    assert all(out["measured_steps"][tag] == per_rank[0]["measured_steps"][tag] for out in per_rank)
