"""Graph queries every pass needs: which nodes and storages an op writes to."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from passes import torch_compat
from passes.flat_ops import COPY_OUT
from passes.torch_compat import OpOverload


def _flat_nodes(arg: object) -> list[fx.Node]:
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, list | tuple):
        return [n for a in arg for n in _flat_nodes(a)]
    return []


# Ops that write to arguments their schema does not mark as written (a known lie in
# ATen): batch norm updates running_mean / running_var (args 3, 4) when training.
_UNANNOTATED_WRITES = {
    torch.ops.aten.native_batch_norm.default: (3, 4),
    torch.ops.aten.cudnn_batch_norm.default: (3, 4),
    torch.ops.aten.miopen_batch_norm.default: (3, 4),
}


def mutated_nodes(node: fx.Node) -> list[fx.Node]:
    """The argument nodes that ``node`` writes to in place (``add_``, ``_foreach_mul_``, ``copy_``...)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, OpOverload):
        return []
    out: list[fx.Node] = []
    if target in _UNANNOTATED_WRITES and len(node.args) > 5 and node.args[5]:
        out.extend(n for i in _UNANNOTATED_WRITES[target] for n in _flat_nodes(node.args[i]))
    schema = torch_compat.op_schema(target)
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        val = node.kwargs.get(a.name) if a.kwarg_only or i >= len(node.args) else node.args[i]
        out.extend(_flat_nodes(val))
    return out


def is_mutated(node: fx.Node) -> bool:
    """Whether any user of ``node`` writes to it in place."""
    return any(node in mutated_nodes(u) for u in node.users)


def storage_of(node: fx.Node) -> StorageWeakRef | None:
    """The storage behind ``node.meta["val"]`` (shared by all views of one tensor), if it is a tensor."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less tensors
        return None


def written_storages(node: fx.Node) -> set[StorageWeakRef]:
    """The storages ``node`` writes in place (through any view of them)."""
    return {s for s in map(storage_of, mutated_nodes(node)) if s is not None}


_aten = torch.ops.aten

# Ops that only reshape, view or copy their single tensor input. A chain of them that reads
# a collective's result (a bucket's unpacking, the un-padding slice of a shard, autograd's
# detach of a gradient) can move together with that result's wait: bucketing moves such
# chains after a bucket's wait, and sink_waits moves them with the wait they hang from.
PASS_THROUGH_OPS = {
    operator.getitem,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.narrow.default,
    _aten.slice.Tensor,
    _aten.select.int,
    _aten.alias.default,
    _aten.detach.default,
    _aten.t.default,
    _aten.permute.default,
    _aten.transpose.int,
    _aten.expand.default,
    _aten.squeeze.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.unsqueeze.default,
    _aten.as_strided.default,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.clone.default,
    _aten._to_copy.default,
    COPY_OUT,  # a unit's gathered flat buffer into its parameters (passes.flat_ops)
}
