"""One in-process fake process group for the unit tests that partition real steps."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from spmd.parallel import sharding


@contextlib.contextmanager
def fake_process_group(world_size: int = 2, rank: int = 0) -> Iterator[None]:
    """A fake default group of ``world_size`` ranks seen from ``rank``; destroyed on exit,
    with the meshes made on it."""
    assert not dist.is_initialized(), "a process group leaked from another test"
    sharding._DEFAULT_MESHES.clear()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()
