"""spmd.parallel.gloo_group in one process (a gloo group of one rank): where torch's default group is
gloo with several threads, spmd's meshes get one-thread groups of their own; on a one-thread
default group nothing new is made. The two-rank check (collectives overlapped on the default
group, a user's mesh left alone) is tests/dist/test_gloo_threads.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

import spmd
from passes import torch_compat
from spmd.parallel import gloo_group, plan, sharding


@pytest.fixture
def default_group(request: pytest.FixtureRequest) -> Iterator[None]:
    threads = request.param
    with spmd.gloo_threads(threads) if threads else _nothing():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _threads(group: dist.ProcessGroup) -> int:
    return torch_compat.gloo_threads(group)


@pytest.mark.parametrize("default_group", [0], indirect=True)
def test_a_two_thread_default_group_gets_spmd_one_thread_groups(default_group: None) -> None:
    default = torch_compat.get_default_group()
    assert _threads(default) == 2  # torch's init_process_group("gloo")
    assert gloo_group.wanted("cpu") and not gloo_group.wanted("cuda")
    mesh = sharding.default_mesh("cpu")
    assert mesh.get_group() is not default and _threads(mesh.get_group()) == 1
    assert gloo_group.world_group("cpu") is mesh.get_group()  # one copy of the world, reused
    hybrid = sharding.default_mesh("cpu", (1, 1))
    assert all(_threads(hybrid.get_group(d)) == 1 for d in range(2))
    assert plan.whole_group(hybrid) is mesh.get_group()
    assert _threads(gloo_group.flatten(hybrid).get_group()) == 1


@pytest.mark.parametrize("default_group", [1], indirect=True)
def test_a_one_thread_default_group_is_used_as_it_is(default_group: None) -> None:
    default = torch_compat.get_default_group()
    assert not gloo_group.wanted("cpu")
    assert gloo_group.world_group("cpu") is default
    assert sharding.default_mesh("cpu").get_group() is default
