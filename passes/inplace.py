"""Reduce dead buffers in place: ``all_reduce(x)`` becomes ``all_reduce_(x)`` where ``x`` dies.

The functional ``all_reduce`` allocates a fresh output the size of its input. Where the
input is a buffer nothing else reads -- a bucket's packed gradients (``cat``), a gradient
scaled by ``1 / W`` before its reduction, a reduce-scatter's output that hybrid_shard
all-reduces over the replicate group -- that output is one bucket-sized allocation too many:
``torch.ops._c10d_functional.all_reduce_`` reduces the buffer in its own storage and returns
it (its ``wait_tensor`` then hands back the same storage), as DDP reduces its bucket in place.

Why legal: the collective's input is a fresh tensor (an op whose result aliases none of its
inputs, or the waited result of another collective), contiguous (the process group sends
dense memory), and the collective is its only reader, so nothing can observe that its
values change. Every rank sees the same graph, so every rank rewrites the same
collectives; the collective order, kinds, groups and sizes are unchanged (``all_reduce_``
is an all-reduce to :mod:`passes.collectives`).

Where: after bucketing (a bucket's packed buffer is the best candidate) and before the
passes that read storages to decide what may move (the collective's ``meta["val"]`` becomes
its input's value: it returns that storage). No-op (the same ``gm``) when no all-reduce
reads a dead, fresh, contiguous buffer.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.graph_utils import storage_of
from passes.torch_compat import OpOverload

INPLACE = C._c10d.all_reduce_.default


def inplace_all_reduce(gm: fx.GraphModule) -> fx.GraphModule:
    """Turn every all-reduce of a dead, fresh buffer into the in-place ``all_reduce_`` (see module doc)."""
    todo = [n for n in C.collectives(gm.graph) if n.target is C._c10d.all_reduce.default and _dead_fresh(n)]
    if not todo:
        return gm
    for coll in todo:
        x = coll.args[0]
        assert isinstance(x, fx.Node)
        with gm.graph.inserting_before(coll):
            new = gm.graph.call_function(INPLACE, coll.args, dict(coll.kwargs))
        new.meta = dict(coll.meta)
        new.meta["val"] = x.meta["val"]  # it returns its input
        coll.replace_all_uses_with(new)
        gm.graph.erase_node(coll)
    gm.graph.lint()
    gm.recompile()
    return gm


def _dead_fresh(coll: fx.Node) -> bool:
    """Whether ``coll``'s input is a fresh, contiguous tensor that only ``coll`` reads."""
    x = coll.args[0]
    if not isinstance(x, fx.Node) or x.op != "call_function" or list(x.users) != [coll]:
        return False
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_contiguous() or val.numel() == 0:
        return False
    if C.is_wait(x):
        src = C.collective_of(x)
        # a non-coalesced collective's own output, read by its wait alone
        return not C.is_coalesced(src) and x.args[0] is src and len(src.users) == 1
    if C.is_collective(x) or not isinstance(x.target, OpOverload):
        return False
    schema = torch_compat.op_schema(x.target)
    if any(r.alias_info is not None for r in schema.returns):
        return False  # a view or an in-place op: it returns (part of) an input
    # ``_unsafe_view`` and friends alias without saying so in their schema: check the storage.
    s = storage_of(x)
    return s is not None and all(storage_of(i) != s for i in x.all_input_nodes)
