"""Per-rank bodies of the shared-memory collective tests (``test_shm``)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import spmd
from passes import collectives as C
from spmd.backend import shm
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _full, train_step

_f = torch.ops._c10d_functional
_s = torch.ops.spmd_shm
# Slots of 64 KiB (the smallest the transport makes): the 1 MB tensors below run in 16+ rounds.
SMALL_SLOT = 64 * 1024


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def ops_against_gloo(rank: int, world: int) -> list[str]:
    """Every shared-memory op against the gloo functional collective it replaces, on random data
    (different per rank), several dtypes and sizes from one element to many rounds of a slot."""
    shm._SLOT_BYTES = SMALL_SLOT
    group = dist.group.WORLD
    assert group is not None
    made = shm.transports([group])
    name = group.group_name
    if made != {name: world}:
        return [f"rank {rank}: no shared memory for the default group: {made}"]
    torch.manual_seed(100 + rank)
    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for rows in (1, 5, 40_000):
            x = (torch.randn(world * rows, 3) * 100).to(dtype)
            splits = [rows] * world
            pairs = {
                "all_gather": (
                    lambda x=x: _f.all_gather_into_tensor(x, world, name),
                    lambda x=x: _s.all_gather_into_tensor(x, world, name),
                ),
                "all_to_all": (
                    lambda x=x, sp=splits: _f.all_to_all_single(x, sp, sp, name),
                    lambda x=x, sp=splits: _s.all_to_all_single(x, sp, sp, name),
                ),
                "broadcast": (
                    lambda x=x: _f.broadcast(x, world - 1, name),
                    lambda x=x: _s.broadcast(x, world - 1, name),
                ),
            }
            if world == 2 and dtype.is_floating_point:
                for op in ("sum", "avg"):
                    pairs[f"reduce_scatter {op}"] = (
                        lambda x=x, op=op: _f.reduce_scatter_tensor(x, op, world, name),
                        lambda x=x, op=op: _s.reduce_scatter_tensor(x, op, world, name),
                    )
                    pairs[f"all_reduce {op}"] = (
                        lambda x=x, op=op: _f.all_reduce(x, op, name),
                        lambda x=x, op=op: _s.all_reduce(x, op, name),
                    )
                    pairs[f"all_reduce_ {op}"] = (
                        lambda x=x, op=op: _f.all_reduce_(x.clone(), op, name),
                        lambda x=x, op=op: _s.all_reduce_(x.clone(), op, name),
                    )
            for what, (gloo, ours) in pairs.items():
                want, got = _f.wait_tensor(gloo()), ours()
                if not _same_bits(want, got):
                    problems.append(f"rank {rank}: {what} {dtype} {rows} rows differs from gloo's")
    return problems


def graph_collectives(rank: int, world: int, style: str, env: dict[str, str]) -> dict[str, Any]:
    """Three steps of ``style`` on the uneven model; the final graph's collectives as (kind, shared
    memory?) and the parameters."""
    os.environ.update(env)
    model = pm.build("uneven")
    opt = shared.make_optimizer("adamw_fused", model)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style), check_invariants=True)(train_step)
    for i in range(3):
        step(model, opt, *pm.batch("uneven", i, rank))
    final = step.graphs["final"]
    return {
        "collectives": [(C.kind_of(c).value, C.is_shared_memory(c)) for c in C.collectives(final.graph)],
        "params": [_full(p).detach().clone() for p in model.parameters()],
    }


def on_two_hosts(rank: int, world: int, style: str) -> dict[str, Any]:
    """``graph_collectives`` with each rank reporting a host of its own: the transports are refused
    at setup, after the pipeline put the collectives in shared memory; they must go back to gloo."""
    shm._host_id = lambda: f"host-{rank}"  # type: ignore[assignment]
    return graph_collectives(rank, world, style, {})


def peer_exits(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 leaves after its transport is made; rank 0's next collective must raise, not wait."""
    group = dist.group.WORLD
    assert group is not None
    shm.transports([group])
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    t0 = time.perf_counter()
    try:
        _s.all_gather_into_tensor(torch.ones(4), world, group.group_name)
    except spmd.CollectiveError as e:
        first, seconds = str(e), time.perf_counter() - t0
    else:
        return {"error": None}
    try:  # the counters no longer agree: the next collective must refuse, not read stale slots
        _s.all_gather_into_tensor(torch.ones(4), world, group.group_name)
    except spmd.CollectiveError as e:
        return {"error": first, "seconds": seconds, "then": str(e)}
    return {"error": first, "seconds": seconds, "then": None}
