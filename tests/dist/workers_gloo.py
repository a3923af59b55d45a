"""Per-rank bodies of the gloo collective-rewrite tests (``test_gloo_collectives``)."""

from __future__ import annotations

import os
from typing import Any

import spmd
from passes import collectives as C
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _full, train_step
from tests.dist.workers_odd_world import parity

PASS = "reduce_scatter_as_all_to_all"


def kinds_and_params(rank: int, world: int, model_name: str, disabled: tuple[str, ...]) -> dict[str, Any]:
    """Train ``model_name`` (fully_shard, fused AdamW) 3 steps; the final graph's collective kinds,
    whether the pass ran, and the full parameters."""
    model = pm.build(model_name)
    opt = shared.make_optimizer("adamw_fused", model)
    # gloo's path (ranks on several hosts): shared memory would run the reduce-scatters itself.
    step = spmd.compile(
        parallel_mode=spmd.DataParallel("fully_shard"),
        disabled_passes=(*disabled, "shared_memory_collectives"),
        check_invariants=True,
    )(train_step)
    for i in range(3):
        step(model, opt, *pm.batch(model_name, i, rank))
    final = step.graphs["final"]
    return {
        "kinds": [C.kind_of(c).value for c in C.collectives(final.graph)],
        "ran": PASS in step.graphs,
        "params": [_full(p).detach().clone() for p in model.parameters()],
    }


def fsdp2_parity(rank: int, world: int) -> dict[str, Any]:
    """Bit for bit with FSDP2, the pass on (the default on gloo across hosts; shared memory off, which
    would run the reduce-scatters itself): padded shards and nested units."""
    os.environ["SPMD_SHM"] = "0"
    return parity(rank, world, "fully_shard", [("uneven", "adam_fused"), ("nested", "adamw_fused")], 4)


def mesh_groups(rank: int, world: int) -> dict[str, Any]:
    """The thread counts and timeouts of the groups of a 2 x 2 mesh spmd makes (hybrid_shard's, FSDP
    x TP's) and of its flattened dimension, with the default group's beside them."""
    from passes import torch_compat
    from spmd.parallel import gloo_group, sharding

    default = torch_compat.get_default_group()
    mesh = sharding.default_mesh("cpu", (2, 2))
    groups = [mesh.get_group(0), mesh.get_group(1), gloo_group.flatten(mesh).get_group()]
    return {
        "default": (torch_compat.gloo_threads(default), torch_compat.pg_timeout_s(default)),
        "mesh": [(torch_compat.gloo_threads(g), torch_compat.pg_timeout_s(g)) for g in groups],
    }
