"""StepReport on 2 real gloo ranks: collective counts and bytes, per-rank state, by formula.

Stack's parameters have 5, 5, 7 and 3 rows (uneven at W=2), so fully_shard pads them:
rank 0 holds ceil(rows/2) rows, rank 1 the rest, and the collectives move padded buffers.
"""

from __future__ import annotations

import pytest

from tests.dist import workers_report as wr
from tests.dist.launcher import run_ranks

W = 2


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_ranks(wr.reports, W)


def test_replicate_one_all_reduce_per_gradient(per_rank) -> None:
    """Before bucketing: one all_reduce per gradient, moving exactly the gradient's bytes. Bucketing
    merges them without changing the bytes. Every rank holds everything."""
    for r, out in enumerate(per_rank):
        exp = wr.expected(out["shapes"], W, r)
        part, final = out["replicate"]["partitioned"], out["replicate"]["final"]
        assert part["world_size"] == W and part["parallel_style"] == "replicate"
        assert set(part["collectives"]) == {"all_reduce"}
        assert part["collectives"]["all_reduce"] == {"count": 4, "bytes": exp["full"]}
        assert part["grad_bytes"] == exp["full"] and part["num_grads"] == 4
        assert set(final["collectives"]) == {"all_reduce"}
        assert 1 <= final["collectives"]["all_reduce"]["count"] <= 4
        assert final["collectives"]["all_reduce"]["bytes"] == exp["full"]
        assert final["param_bytes"] == final["grad_bytes"] == exp["full"]
        # fused AdamW: exp_avg and exp_avg_sq like the parameter, plus a float32 step per parameter
        assert final["optim_state_bytes"] == 2 * exp["full"] + 4 * 4
        assert final["peak_memory_bytes"] >= final["param_bytes"] + final["optim_state_bytes"]


@pytest.mark.parametrize("style,gathers", [("fully_shard", 2), ("fully_shard_noreshard", 1)])
def test_fully_shard_bytes(per_rank, style: str, gathers: int) -> None:
    """all_gather moves every padded parameter once per gather (twice with reshard in the
    partitioned graph: Stack's backward reads every parameter; once in the final graph, where
    Stack, one unit and so the last of forward, stays gathered into backward: passes.last_unit);
    reduce_scatter moves every padded gradient (full size); each rank holds its own shard of
    parameters, gradients and optimizer state (about 1/2). The final graph's collectives run
    through shared memory (the ranks share this host: passes.shm_collectives), with the same kinds
    and bytes, and the report counts them."""
    for r, out in enumerate(per_rank):
        exp = wr.expected(out["shapes"], W, r)
        for stage in ("partitioned", "final"):
            rep = out[style][stage]
            red = "reduce_scatter"
            assert rep["parallel_style"].startswith("fully_shard")
            assert set(rep["collectives"]) == {"all_gather", red}
            total = sum(c["count"] for c in rep["collectives"].values())
            assert rep["shared_memory_collectives"] == (total if stage == "final" else 0)
            once = 1 if stage == "final" else gathers
            assert rep["collectives"]["all_gather"]["bytes"] == once * exp["padded"]
            assert rep["collectives"][red]["bytes"] == exp["padded"]
            assert rep["param_bytes"] == rep["grad_bytes"] == exp["local"]
            assert rep["optim_state_bytes"] == 2 * exp["local"] + 4 * 4
        part = out[style]["partitioned"]
        assert part["collectives"]["all_gather"]["count"] == gathers * 4
        assert part["collectives"]["reduce_scatter"]["count"] == 4
    full = wr.expected(per_rank[0]["shapes"], 1)["full"]
    locals_ = [out[style]["final"]["param_bytes"] for out in per_rank]
    assert sum(locals_) == full and locals_[0] >= locals_[1] > 0
