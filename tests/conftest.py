"""Session-wide test settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def _spmd_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """spmd's on-disk caches (inductor_gemm='auto' decisions, spmd.backend.gemm_policy) and profiles go
    to a tmp dir, never the user's ~/.cache/spmd; spawned ranks and example scripts inherit them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPMD_CACHE_DIR", str(tmp_path_factory.mktemp("spmd_cache")))
        # No calibrated cpu-local profile from ~/.cache: what prices automatic tp placements on
        # the CPU (spmd.parallel.auto_tp_solve.local_profile) is then the same on every machine.
        mp.setenv("SPMD_PROFILE_DIR", str(tmp_path_factory.mktemp("spmd_profiles")))
        yield
