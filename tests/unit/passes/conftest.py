"""Process groups for the pass tests: real gloo at world size 1, fake at world size 2.

``world`` is module-scoped and parametrized, so every test that takes it runs once
per world; pytest finishes one world (and destroys its process group) before it
initialises the next.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.unit.passes.graphs import World


@pytest.fixture(scope="module", params=[("gloo", 1), ("fake", 2)], ids=["gloo-w1", "fake-w2"])
def world(request: pytest.FixtureRequest):
    backend, size = request.param
    assert not dist.is_initialized(), "a process group leaked from another test"
    store = dist.HashStore() if backend == "gloo" else FakeStore()
    dist.init_process_group(backend, rank=0, world_size=size, store=store)
    try:
        yield World(backend=backend, size=size, group=dist.group.WORLD.group_name)
    finally:
        dist.destroy_process_group()
