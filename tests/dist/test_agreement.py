"""Ranks that compile different graphs get a clear error on every rank instead of a hang."""

from __future__ import annotations

import pytest

from tests.dist import workers
from tests.dist.launcher import run_ranks


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_rank_divergent_models_fail_fast(style: str) -> None:
    results = run_ranks(workers.divergent, 2, style, timeout=120)
    for r in results:
        assert r != "no error"
        seconds = float(r.split("s ", 1)[0])
        assert seconds < 60, r
        assert "collective #" in r and "rank 1" in r, r
        assert "module" in r, r
