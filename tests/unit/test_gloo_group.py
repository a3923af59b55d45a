"""spmd.parallel.gloo_group in one process (a gloo group of one rank): where torch's default group is
gloo with several threads, spmd's meshes get one-thread groups of their own; on a one-thread
default group nothing new is made. The two-rank check (collectives overlapped on the default
group, a user's mesh left alone) is tests/dist/test_gloo_threads.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import spmd
from passes import torch_compat
from spmd.parallel import gloo_group, plan, sharding


@pytest.fixture
def default_group(request: pytest.FixtureRequest) -> Iterator[None]:
    assert not dist.is_initialized(), "a process group leaked from another test"
    saved = dict(sharding._DEFAULT_MESHES)
    sharding._DEFAULT_MESHES.clear()
    threads = request.param
    with spmd.gloo_threads(threads) if threads else _nothing():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()
        sharding._DEFAULT_MESHES.update(saved)


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


def test_a_new_default_group_gets_a_new_copy() -> None:
    """The copy of the world is made per default group: after destroy_process_group and a new
    init_process_group, spmd's mesh is on a new, live group (never the destroyed one's copy)."""
    groups = []
    for _ in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            own = gloo_group.world_group("cpu")
            assert own is not torch_compat.get_default_group() and _threads(own) == 1
            assert sharding.default_mesh("cpu").get_group() is own
            dist.all_reduce(torch.ones(1), group=own)  # live
            groups.append(own)
        finally:
            dist.destroy_process_group()
    assert groups[0] is not groups[1]


def test_spmd_world_group_keeps_the_users_timeout() -> None:
    """``init_process_group(timeout=10 s)``: spmd's copy of the world takes that timeout, not
    ``new_group``'s 30-minute default (a rank whose peer died waited 30 minutes)."""
    import datetime

    assert not dist.is_initialized(), "a process group leaked from another test"
    gloo_group._WORLD.clear()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
    )
    try:
        group = gloo_group.world_group("cpu")
        assert group is not torch_compat.get_default_group() and _threads(group) == 1
        assert torch_compat.pg_timeout_s(group) == 10.0
    finally:
        dist.destroy_process_group()
        gloo_group._WORLD.clear()


@pytest.mark.parametrize("threads", [0, 1])
def test_mesh_dimension_groups_keep_the_users_timeout(threads: int) -> None:
    """``init_process_group(timeout=10 s)``: every dimension of a 2-D mesh spmd makes (hybrid_shard,
    FSDP x TP) and its flattened dimension take that timeout, on the default group's threads or on
    spmd's own one-thread groups; ``init_device_mesh`` alone gives them torch's 30-minute default,
    so a rank whose peer died waited 30 minutes."""
    import datetime

    assert not dist.is_initialized(), "a process group leaked from another test"
    saved = dict(sharding._DEFAULT_MESHES)
    sharding._DEFAULT_MESHES.clear()
    with spmd.gloo_threads(threads) if threads else _nothing():
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=10)
        )
    try:
        mesh = sharding.default_mesh("cpu", (1, 1), ("dp", "tp"))
        assert [torch_compat.pg_timeout_s(mesh.get_group(d)) for d in range(2)] == [10.0, 10.0]
        assert torch_compat.pg_timeout_s(gloo_group.flatten(mesh).get_group()) == 10.0
    finally:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()
        sharding._DEFAULT_MESHES.update(saved)
        gloo_group._WORLD.clear()


def test_default_meshes_are_not_reused_across_default_groups() -> None:
    """A default group made after another was destroyed may get the same ``id()`` (CPython reuses
    freed objects' addresses); the mesh cached for the old one must not come back: its groups are
    dead. The cache entry is rewritten to the new group's id, as such a reuse would leave it."""
    saved = dict(sharding._DEFAULT_MESHES)
    sharding._DEFAULT_MESHES.clear()
    try:
        with spmd.gloo_threads(1):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            old = sharding.default_mesh("cpu", (1, 1))
        finally:
            dist.destroy_process_group()
        with spmd.gloo_threads(1):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            new_id = id(torch_compat.get_default_group())
            stale = {(k[0], new_id, *k[2:]): v for k, v in sharding._DEFAULT_MESHES.items()}
            sharding._DEFAULT_MESHES.clear()
            sharding._DEFAULT_MESHES.update(stale)
            mesh = sharding.default_mesh("cpu", (1, 1))
            assert mesh is not old
            dist.all_reduce(torch.ones(1), group=mesh.get_group(0))  # live
        finally:
            dist.destroy_process_group()
    finally:
        sharding._DEFAULT_MESHES.clear()
        sharding._DEFAULT_MESHES.update(saved)
