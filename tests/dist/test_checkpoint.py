"""DTensor state saves and loads through torch.distributed.checkpoint; training resumes exactly."""

from __future__ import annotations

import pytest

from tests.dist import workers
from tests.dist.launcher import run_ranks


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_dcp_save_load_resume(style: str, tmp_path) -> None:
    results = run_ranks(workers.checkpoint_resume, 2, style, str(tmp_path / "ckpt"))
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_sync_module_states_and_full_state_dict(style: str) -> None:
    results = run_ranks(workers.sync_and_export, 2, style)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
