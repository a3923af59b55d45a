"""The shared compile (spmd.backend.compile_once) on 2 gloo ranks of one host: one rank compiles with
inductor, the other waits and loads the result from inductor's FX graph cache.

One spawned job covers every case (inductor compiles take seconds each on these cores), with
a fresh TORCHINDUCTOR_CACHE_DIR shared by both ranks, as on a host.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import workers_compile_once as wc
from tests.dist.launcher import run_ranks

W = 2


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor_cache")))
        mp.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        mp.setenv("SPMD_SHARE_COMPILE", "1")  # off by default
        return run_ranks(wc.shared_compile, W, timeout=500, pg_timeout=300)


def test_follower_hits_the_cache(per_rank) -> None:
    """Same graph on both ranks: one leads and misses the FX graph cache, the other follows,
    waits, and hits it (no compile of its own); the report says so."""
    roles = sorted(out["shared"]["role"] for out in per_rank)
    assert roles == ["follower", "leader"], roles
    for out in per_rank:
        case = out["shared"]
        if case["role"] == "leader":
            assert case["cache"]["miss"] >= 1 and case["cache"]["hit"] == 0, case["cache"]
        else:
            assert case["cache"]["hit"] >= 1 and case["cache"]["miss"] == 0, case["cache"]
            assert case["wait_s"] > 0 and "waiting for another rank's compile" in case["report"]


def test_shared_compile_equals_own_compile(per_rank) -> None:
    """Parameters and losses after the shared compile equal, bit for bit, those of each rank
    compiling the graph itself (caches off: no sharing, both ranks miss)."""
    for out in per_rank:
        shared, own = out["shared"], out["own"]
        assert own["role"] == "alone" and own["cache"]["hit"] == 0
        for a, b in zip(shared["params"] + shared["losses"], own["params"] + own["losses"], strict=True):
            assert torch.equal(a, b)


def test_different_graphs_compile_alone(per_rank) -> None:
    """Uneven local batches give each rank its own graph: each leads its own compile (a cache
    miss on both; no waiting) and the step still runs."""
    for out in per_rank:
        case = out["uneven"]
        assert case["role"] == "leader" and case["cache"]["miss"] >= 1 and case["cache"]["hit"] == 0
        assert all(torch.isfinite(loss) for loss in case["losses"])


def test_leader_failure_fails_the_follower(per_rank) -> None:
    """The leader's inductor fails: it raises its own error, and the follower raises a
    LoweringError naming the leader's failure without compiling (no hang)."""
    by_calls = sorted((out["failure_compiled"], out["failure"] or "") for out in per_rank)
    (follower_calls, follower), (leader_calls, leader) = by_calls
    assert leader.startswith("spmd: inductor could not compile the final graph (RuntimeError: injected")
    assert leader_calls == 1
    assert follower.startswith("spmd: rank ") and "injected inductor failure" in follower, follower
    assert follower_calls == 0
