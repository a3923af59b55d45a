"""spmd on torch's default gloo group (``init_process_group("gloo")``: two worker threads, on which
torch's gloo can corrupt the heap when two collectives run at once: benchmarks/results/crashes.md,
benchmarks/diagnostics/gloo_concurrent_collectives.py). spmd's own mesh gets a one-thread group of its own
(``spmd.parallel.gloo_group``), so its collectives overlap each other and cross_step_prefetch (a
gather in flight across calls) is on, with no action of the user's. A mesh the user made on the
two-thread group is left as it is, and there spmd keeps one collective in flight at a time. Same
values either way, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.dist import workers
from tests.dist.launcher import run_ranks

KNOBS = {"min_unit_mb": 0}  # a unit per block: gathers prefetched while the previous block computes


@pytest.mark.timeout(300)
def test_default_gloo_group_spmd_overlaps_on_its_own_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPMD_TEST_GLOO_THREADS", "default")
    own = run_ranks(workers.gloo_threads_step, 2, "fully_shard", KNOBS, False, timeout=280)
    users = run_ranks(workers.gloo_threads_step, 2, "fully_shard", KNOBS, True, timeout=280)
    for rank in range(2):
        o, u = own[rank], users[rank]
        assert o["threads"] == 2 and u["threads"] == 2, (o["threads"], u["threads"])
        # spmd's mesh: a one-thread group of its own, collectives overlapped, a gather carried.
        assert o["spmd_threads"] == {1} and not o["spmd_on_default"], o["spmd_threads"]
        assert o["most_in_flight"] >= 2, "spmd's own one-thread group should keep collectives overlapped"
        assert o["carried"], "cross_step_prefetch should be on, on spmd's own one-thread group"
        # The user's mesh on the two-thread default group: one collective at a time, nothing carried.
        assert u["spmd_threads"] == {2} and u["spmd_on_default"], u["spmd_threads"]
        assert u["most_in_flight"] == 1, f"rank {rank}: {u['most_in_flight']} collectives in flight at once"
        assert not u["carried"], "cross_step_prefetch: off on a two-thread group"
        assert o["losses"] == u["losses"]
        for name, p in o["params"].items():
            assert torch.equal(p, u["params"][name]), name


def test_a_one_thread_default_group_reaches_spmds_mesh_groups() -> None:
    """Under ``spmd.gloo_threads(1)`` (the launcher's default group: one thread, a 60 s timeout) the
    groups of a 2-D mesh spmd makes take one thread and that timeout: ``init_device_mesh`` alone gave
    its dimensions torch's two threads (spmd then kept one collective in flight on them) and 30
    minutes."""
    from tests.dist import workers_gloo

    for out in run_ranks(workers_gloo.mesh_groups, 4):
        assert out["default"] == (1, 60.0), out
        assert out["mesh"] == [(1, 60.0)] * 3, out
