"""DTensorExpandMode on gloo ranks: data parallelism against DDP bit for bit, tensor parallelism
(1-D) and data x tensor parallelism (2-D) against single-device training."""

from __future__ import annotations

import pytest

from tests.dist import workers_expand
from tests.dist.launcher import run_ranks

# Tensor parallelism reorders the sums of row-parallel matmuls and of the vocab-sharded head:
# equal to single-device training up to float rounding, not bit for bit.
TOL = 1e-5


@pytest.mark.timeout(500)
def test_defaults_and_override_match_ddp_bitwise() -> None:
    """One job of 2 ranks, different data on each:

    * defaults (inputs Shard(0), parameters Replicate()): every loss, the final parameters and an
      eval step's output equal DDP's and DataParallel('replicate')'s bit for bit;
    * an Override stand-in whose custom op has no sharding rule, declared Shard(0) -> Shard(0), runs
      on local tensors; the step equals DDP over the same stand-in bit for bit.
    """
    combos = [("tinygpt", "adamw_fused"), ("mlp", "sgd_momentum_foreach"), ("nested", "sgd_momentum_fused")]
    results = run_ranks(workers_expand.data_parallel_cases, 2, combos, timeout=480)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def _check_tp(results: list[dict], tp: int) -> None:
    for rank, r in enumerate(results):
        assert r["moved"] > 1e-3, "the reference did not train"
        assert r["param_diff"] < TOL, f"rank {rank}: {r['worst']} differs by {r['param_diff']}"
        assert r["loss_diff"] < TOL, f"rank {rank}: loss differs by {r['loss_diff']}"
        shapes = r["local_shapes"]
        # Each rank holds only its slice of the sharded weights (d_model 32, vocab 64).
        assert shapes["blocks.0.qkv.weight"] == (96 // tp, 32)
        assert shapes["blocks.0.qkv.bias"] == (96 // tp,)
        assert shapes["blocks.0.fc.weight"] == (128 // tp, 32)
        assert shapes["blocks.0.proj.weight"] == (32, 32 // tp)
        assert shapes["blocks.0.out.weight"] == (32, 128 // tp)
        assert shapes["tok.weight"] == (64 // tp, 32)
        assert shapes["pos.weight"] == (16, 32 // tp)
        assert shapes["blocks.0.ln1.weight"] == (32,)
        assert r["annotated_nodes"] > 100, "placements are not recorded on the partitioned graph's nodes"
        assert "Shard(0)" in r["param_placement_comment"]


@pytest.mark.timeout(400)
def test_tensor_parallel_1d_matches_single_device() -> None:
    """Megatron TP on a 1-D mesh of 2 ranks, replicated inputs, clip_grad_norm_ (a norm over sharded
    gradients), fused SGD (spmd's own rule)."""
    results = run_ranks(workers_expand.tensor_parallel, 2, {"tp": 2}, "sgd", True, timeout=380)
    _check_tp(results, 2)


@pytest.mark.timeout(500)
def test_data_x_tensor_parallel_2d_matches_single_device() -> None:
    """A 2 x 2 ("dp", "tp") mesh on 4 ranks: DP composes with Megatron TP."""
    results = run_ranks(workers_expand.tensor_parallel, 4, {"dp": 2, "tp": 2}, timeout=480)
    _check_tp(results, 2)
    # Sharded weights take half the bytes of replicated ones; the report sees the local shards.
    assert results[0]["param_bytes"] < 0.75 * 4 * sum(
        (
            64 * 32,
            16 * 32,
            2 * (96 * 32 + 96 + 32 * 32 + 32 + 128 * 32 + 128 + 32 * 128 + 32 + 4 * 32),
            2 * 32,
        )
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2, "tp": 1}], ids=["heads", "batch"])
def test_attn_mask_matches_single_device(mesh) -> None:
    """MaskedGPT (an explicit [B, H, T, T] attention mask from the batch, as Hugging Face's sdpa
    path passes one) on 2 ranks: the mask is sharded with q on the heads ("tp") or the batch ("dp")."""
    results = run_ranks(workers_expand.tensor_parallel, 2, mesh, "sgd", False, 3, 4, timeout=280)
    for rank, r in enumerate(results):
        assert r["moved"] > 1e-3, "the reference did not train"
        assert r["param_diff"] < TOL, f"rank {rank}: {r['worst']} differs by {r['param_diff']}"
        assert r["loss_diff"] < TOL, f"rank {rank}: loss differs by {r['loss_diff']}"
        assert r["local_shapes"]["blocks.0.q.weight"] == (32 // mesh["tp"], 32)
