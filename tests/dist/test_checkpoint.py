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


def test_dcp_resume_of_parameters_split_by_groups(tmp_path) -> None:
    """FSDP x TP, automatic placements, 2 x 2 ranks: a fused projection split by groups saves and
    loads through DCP (it refused: "overlapping chunks") and training resumes bit for bit."""
    results = run_ranks(workers.checkpoint_resume_tp, 4, str(tmp_path / "ckpt"), timeout=400)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_sync_module_states_and_full_state_dict(style: str) -> None:
    results = run_ranks(workers.sync_and_export, 2, style)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)  # five spawned runs; about 4 minutes on the 2 shared cores under load
def test_resume_at_other_world_sizes(tmp_path) -> None:
    """Elastic resume: a DCP checkpoint saved by fully_shard at 2 ranks loads at 4 and 3 ranks,
    at 1 process without a process group, and under replicate at 2 -- every parameter and
    optimizer state exact -- and training goes on (workers.elastic_resume). At 1 process it
    needs ``DataParallel.distribute`` to create the optimizer state DCP loads into."""
    ckpt = str(tmp_path)
    run_ranks(workers.elastic_save, 2, ckpt)
    problems = workers.elastic_resume(0, 1, "fully_shard", ckpt)  # this process: no process group
    for world, style in ((4, "fully_shard"), (3, "fully_shard"), (2, "replicate")):
        problems += [p for r in run_ranks(workers.elastic_resume, world, style, ckpt) for p in r]
    assert not problems, "\n".join(problems)
