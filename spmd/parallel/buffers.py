"""Buffers mutated by the step (BatchNorm running stats): broadcast from rank 0 before use.

As DDP's ``broadcast_buffers`` does, across the whole mesh. A no-op for steps (and models)
that mutate no buffer, and for the buffers of ignored modules, which stay rank-local.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from passes import collectives as C
from passes.graph_utils import mutated_nodes
from spmd.parallel.partition_state import PartitionState

# model -> names of buffers any compiled step on it mutates (see broadcast_mutated_buffers)
_MUTATED_BUFFERS: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
aten = torch.ops.aten


def broadcast_mutated_buffers(ps: PartitionState) -> None:
    """Broadcast, before first use, the buffers some step on this model mutates.

    DDP broadcasts every buffer at every forward; buffers no step ever writes are
    equal on all ranks already, so only the written ones travel. An eval step
    compiled after the train step still broadcasts them (it reads stats that
    drifted apart on each rank during training), as DDP's eval forward does.
    """
    mutated = {m for n in ps.graph.nodes for m in mutated_nodes(n)}
    known = _MUTATED_BUFFERS.setdefault(ps.args.module, set())
    known.update(name for name, _ in ps.state.buffers if ps.by_name[name] in mutated)
    for name, _ in ps.state.buffers:
        b = ps.by_name[name]
        users = list(b.users)
        if name not in known or not users or name in ps.ignored_buffers:
            continue
        with ps.graph.inserting_before(ps.first(users)):
            coll = ps.call(C._c10d.broadcast.default, (b, 0, ps.group), b)
            wait = ps.call(C.WAIT, (coll,), b)
            ps.call(aten.copy_.default, (b, wait), b)
