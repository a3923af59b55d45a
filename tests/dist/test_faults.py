"""A rank that dies or stops mid-training: the survivor raises spmd.CollectiveError within the
process group's timeout and exits; nothing hangs.

The process group timeout is 10 s here (``pg_timeout``); the launcher's own deadline backs
up every test, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import time

import pytest

from tests.dist import workers_reliability as w
from tests.dist.launcher import run_ranks

PG_TIMEOUT = 10


def _assert_clear_collective_error(out: dict, limit_s: float) -> None:
    assert out["type"] == "CollectiveError", out
    assert out["step"] == 3, out
    assert out["seconds"] < limit_s, out
    msg = out["msg"]
    assert "collective" in msg and "failed or timed out" in msg, msg
    assert "peer rank probably died" in msg and "diverged" in msg, msg
    assert "init_process_group(..., timeout=" in msg, msg
    assert "rank 0" in msg, msg
    assert f"timeout (now {PG_TIMEOUT} s)" in msg, msg


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_killed_rank_survivor_raises_and_exits(style: str) -> None:
    t0 = time.perf_counter()
    survivor, dead = run_ranks(w.killed_rank, 2, style, timeout=90, pg_timeout=PG_TIMEOUT, may_die={1})
    assert dead is None  # SIGKILLed: no result
    _assert_clear_collective_error(survivor, limit_s=30)
    # which collective: its kind and module are named
    assert "(collective #" in survivor["msg"], survivor["msg"]
    assert time.perf_counter() - t0 < 60


def test_stalled_rank_survivor_times_out() -> None:
    """The peer lives but stops calling the step: the survivor waits one process-group timeout."""
    survivor, stalled = run_ranks(w.stalled_rank, 2, "replicate", timeout=90, pg_timeout=PG_TIMEOUT)
    assert stalled == {"type": "stalled"}
    _assert_clear_collective_error(survivor, limit_s=PG_TIMEOUT + 20)
    assert survivor["seconds"] >= PG_TIMEOUT * 0.9, survivor  # it did wait for the peer
