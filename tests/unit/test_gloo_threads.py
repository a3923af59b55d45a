"""spmd.gloo_threads: gloo process groups made inside the block get the thread count, and nothing
changes outside it (the class name it swaps is the one torch 2.13 constructs). The end-to-end
check (a group made by init_process_group, and spmd's one-at-a-time collectives on a two-thread
group) is tests/dist/test_gloo_threads.py."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import spmd
from spmd.errors import ConfigError


def _threads_of_a_new_group() -> int:
    pg = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    return pg.options._threads


def test_groups_made_inside_get_the_thread_count_and_outside_torchs_default() -> None:
    default = _threads_of_a_new_group()
    assert default == 2  # torch 2.13's default for a group made by init_process_group
    with spmd.gloo_threads(3):
        assert _threads_of_a_new_group() == 3
        made = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
        assert isinstance(made, dist.ProcessGroupGloo)  # torch's isinstance checks still hold
    assert c10d.ProcessGroupGloo is dist.ProcessGroupGloo
    assert _threads_of_a_new_group() == default


def test_the_class_is_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), spmd.gloo_threads(1):
        raise RuntimeError("boom")
    assert c10d.ProcessGroupGloo is dist.ProcessGroupGloo


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "1"])
def test_a_bad_thread_count_is_a_config_error(n: object) -> None:
    with pytest.raises(ConfigError, match="int >= 1"), spmd.gloo_threads(n):  # type: ignore[arg-type]
        pass
