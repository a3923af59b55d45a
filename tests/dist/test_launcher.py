"""The test launcher itself: a native crash of a rank fails the run at once, never retried,
with the signal named and every rank's Python stacks in the failure."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from tests.dist.launcher import RankCrashed, run_ranks, torchrun_crash


def _rank1_aborts_once(rank: int, world: int, marker: str) -> int:
    """Rank 1 aborts as glibc does on a corrupted heap -- the first time only, so a retry would pass."""
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    if rank == 0:
        time.sleep(120)  # still running when rank 1 dies: its stack must show this line
    return rank


def _segfault_at_exit(rank: int, world: int) -> int:
    """Rank 1 returns its result and then dies of SIGSEGV (as a crash at interpreter exit would)."""
    if rank == 1:
        import atexit

        atexit.register(lambda: ctypes.string_at(0))  # reads address 0
    return rank


@pytest.mark.timeout(120)
def test_native_crash_fails_at_once_with_every_ranks_stacks(tmp_path) -> None:
    marker = tmp_path / "crashed"
    start = time.monotonic()
    with pytest.raises(RankCrashed) as info:
        run_ranks(_rank1_aborts_once, 2, str(marker), timeout=100)
    msg = str(info.value)
    assert "rank 1 killed by SIGABRT" in msg and "not retried" in msg
    # rank 1's stack as faulthandler wrote it when the signal hit, and rank 0's, asked for.
    assert "Fatal Python error: Aborted" in msg and "_rank1_aborts_once" in msg
    assert "--- rank 0 (stopped after the crash)" in msg
    rank0 = msg.split("--- rank 0")[1].split("--- rank 1")[0]
    assert "_rank1_aborts_once" in rank0, rank0  # rank 0 was in the same function, sleeping
    # Not retried: the marker exists, so a second run would have passed -- and rank 0's sleep
    # was cut short rather than waited for.
    assert marker.exists() and time.monotonic() - start < 100


@pytest.mark.timeout(120)
def test_crash_after_the_result_fails() -> None:
    with pytest.raises(RankCrashed, match="rank 1 killed by SIGSEGV"):
        run_ranks(_segfault_at_exit, 2, timeout=100)


def test_torchrun_crash_reads_the_signal() -> None:
    assert torchrun_crash("... exitcode: -6 ... Signal 6 (SIGABRT) received by PID 12") == "SIGABRT"
    assert torchrun_crash("Fatal Python error: Segmentation fault\n\nThread 0x...") == "SIGSEGV"
    assert torchrun_crash("step 4: val loss 2.1") is None
