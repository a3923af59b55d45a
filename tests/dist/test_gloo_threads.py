"""spmd on a gloo group with two worker threads (torch's default) keeps one collective in flight
at a time: torch's gloo can corrupt the heap when two collectives run at once (benchmarks/results/crashes.md,
benchmarks/diagnostics/gloo_concurrent_collectives.py). On a group made under ``spmd.gloo_threads(1)`` the
collectives overlap each other as before, and cross_step_prefetch (a gather in flight across calls)
is on only there. Same values either way, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.dist import workers
from tests.dist.launcher import run_ranks

KNOBS = {"min_unit_mb": 0}  # a unit per block: gathers prefetched while the previous block computes


@pytest.mark.timeout(300)
def test_two_thread_gloo_group_runs_one_collective_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPMD_TEST_GLOO_THREADS", "default")
    default = run_ranks(workers.gloo_threads_step, 2, "fully_shard", KNOBS, timeout=280)
    monkeypatch.setenv("SPMD_TEST_GLOO_THREADS", "1")
    single = run_ranks(workers.gloo_threads_step, 2, "fully_shard", KNOBS, timeout=280)
    for rank in range(2):
        d, s = default[rank], single[rank]
        assert d["threads"] == 2 and s["threads"] == 1, (d["threads"], s["threads"])
        assert d["most_in_flight"] == 1, f"rank {rank}: {d['most_in_flight']} collectives in flight at once"
        assert s["most_in_flight"] >= 2, "the one-thread group should keep collectives overlapped"
        assert not d["carried"] and s["carried"], "cross_step_prefetch: off on two threads, on with one"
        assert d["losses"] == s["losses"]
        for name, p in d["params"].items():
            assert torch.equal(p, s["params"][name]), name
