"""The test launcher itself: a native crash of a rank is retried once, a second one fails."""

from __future__ import annotations

import os

import pytest

from tests.dist.launcher import RankCrashed, run_ranks


def _abort_first_time(rank: int, world: int, marker: str) -> int:
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()  # as glibc does on a corrupted heap
    return rank


def _abort_always(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()
    return rank


@pytest.mark.timeout(200)
def test_native_crash_is_retried_once(tmp_path) -> None:
    with pytest.warns(UserWarning, match="SIGABRT"):
        assert run_ranks(_abort_first_time, 2, str(tmp_path / "crashed"), timeout=60) == [0, 1]


@pytest.mark.timeout(200)
def test_native_crash_twice_fails() -> None:
    with pytest.warns(UserWarning, match="running once more"), pytest.raises(RankCrashed, match="SIGABRT"):
        run_ranks(_abort_always, 2, timeout=60)
