"""The collective vocabulary: the only place that knows which ops communicate.

Everything else asks here: ``is_collective``, ``is_wait``, ``kind_of``,
``group_of``, ``bytes_of``, ``wait_of``/``collective_of``, and builds collectives
with the ``emit_*`` helpers (which also set ``node.meta["val"]`` and the spmd
role/phase/module metadata). Nobody matches nodes by name.

All collectives are ``torch.ops._c10d_functional`` ops: they return a tensor that
may not be read until ``wait_tensor`` has been called on it. Their shared-memory twins
(``torch.ops.spmd_shm``, :mod:`passes.shm_ops`) take the same arguments and are read the same
way; they return a finished tensor, and their ``wait_tensor`` returns it.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, cast

import torch
import torch.fx as fx

from passes import shm_ops
from passes.meta import Role, copy_meta

_c10d = torch.ops._c10d_functional


class Kind(str, enum.Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    # Only as passes.gloo_collectives writes a reduce-scatter: equal splits, one per rank.
    ALL_TO_ALL = "all_to_all"


# op overload -> (kind, coalesced?)
_OPS: dict[Any, tuple[Kind, bool]] = {
    _c10d.all_reduce.default: (Kind.ALL_REDUCE, False),
    _c10d.all_reduce_coalesced.default: (Kind.ALL_REDUCE, True),
    # In place (passes.inplace): the same collective, reducing its input's own storage.
    _c10d.all_reduce_.default: (Kind.ALL_REDUCE, False),
    _c10d.all_reduce_coalesced_.default: (Kind.ALL_REDUCE, True),
    _c10d.all_gather_into_tensor.default: (Kind.ALL_GATHER, False),
    _c10d.all_gather_into_tensor_coalesced.default: (Kind.ALL_GATHER, True),
    _c10d.reduce_scatter_tensor.default: (Kind.REDUCE_SCATTER, False),
    _c10d.reduce_scatter_tensor_coalesced.default: (Kind.REDUCE_SCATTER, True),
    _c10d.broadcast.default: (Kind.BROADCAST, False),
    _c10d.all_to_all_single.default: (Kind.ALL_TO_ALL, False),
    # Run through shared memory (passes.shm_collectives): the same collectives, finished when issued.
    shm_ops.ALL_REDUCE: (Kind.ALL_REDUCE, False),
    shm_ops.ALL_REDUCE_: (Kind.ALL_REDUCE, False),
    shm_ops.ALL_GATHER: (Kind.ALL_GATHER, False),
    shm_ops.REDUCE_SCATTER: (Kind.REDUCE_SCATTER, False),
    shm_ops.ALL_TO_ALL: (Kind.ALL_TO_ALL, False),
    shm_ops.BROADCAST: (Kind.BROADCAST, False),
}
WAIT = _c10d.wait_tensor.default


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _OPS


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def is_inplace(node: fx.Node) -> bool:
    """Whether the collective writes its result into its input (``all_reduce_``)."""
    return node.target in (
        _c10d.all_reduce_.default,
        _c10d.all_reduce_coalesced_.default,
        shm_ops.ALL_REDUCE_,
    )


def is_shared_memory(node: fx.Node) -> bool:
    """Whether the collective runs through shared memory (finished when issued; ``passes.shm_ops``)."""
    return node.target in shm_ops.SHM_OPS


def is_coalesced(node: fx.Node) -> bool:
    return _OPS[node.target][1]


def kind_of(node: fx.Node) -> Kind:
    return _OPS[node.target][0]


def group_of(node: fx.Node) -> str:
    """The process-group name the collective runs on (always its last argument)."""
    return str(node.args[-1])


def reduce_op_of(node: fx.Node) -> str | None:
    if kind_of(node) in (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER):
        return str(node.args[1])
    return None


def inputs_of(node: fx.Node) -> list[fx.Node]:
    """The tensors a collective sends (one, or several for coalesced ops)."""
    first = node.args[0]
    return list(first) if isinstance(first, list | tuple) else [first]  # type: ignore[arg-type,list-item]


def collectives(graph: fx.Graph) -> list[fx.Node]:
    """All collectives, in graph order (the order every rank issues them)."""
    return [n for n in graph.nodes if is_collective(n)]


def waits_of(node: fx.Node) -> list[fx.Node]:
    """The ``wait_tensor`` nodes of a collective (through ``getitem`` for coalesced ones)."""
    out = []
    for u in node.users:
        if is_wait(u):
            out.append(u)
        elif u.op == "call_function" and u.target is operator.getitem:
            out.extend(w for w in u.users if is_wait(w))
    return out


def wait_of(node: fx.Node) -> fx.Node:
    """The single wait of a non-coalesced collective."""
    ws = waits_of(node)
    assert len(ws) == 1, f"{node.name} has {len(ws)} waits"
    return ws[0]


def collective_of(wait: fx.Node) -> fx.Node:
    src = wait.args[0]
    assert isinstance(src, fx.Node)
    if is_collective(src):
        return src
    # coalesced: wait(getitem(coll, i))
    inner = src.args[0]
    assert isinstance(inner, fx.Node) and is_collective(inner), wait.name
    return inner


def _val(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def bytes_of(node: fx.Node) -> int:
    """Bytes a collective moves per rank, counted as the size of its larger side.

    all-reduce: the tensor; all-gather: the gathered output; reduce-scatter and
    all-to-all: the unsharded input (of which each sends (W-1)/W). This is the number a
    user compares with the model size.
    """
    total = 0
    for inp in inputs_of(node):
        v = _val(inp)
        if v is None:
            continue
        nbytes = v.numel() * v.element_size()
        if kind_of(node) is Kind.ALL_GATHER:
            nbytes *= cast(int, node.args[1])
        total += nbytes
    return total


def group_size_of(node: fx.Node) -> int | None:
    if kind_of(node) is Kind.ALL_GATHER:
        return cast(int, node.args[1])
    if kind_of(node) is Kind.REDUCE_SCATTER:
        return cast(int, node.args[2])
    if kind_of(node) is Kind.ALL_TO_ALL:
        return len(cast(list, node.args[1]))
    return None


# ----------------------------------------------------------------------------- emitters


def _fake_like(x: fx.Node, shape: list[int] | tuple[int, ...] | None = None) -> Any:
    v = _val(x)
    if v is None:
        return None
    return v.new_empty(tuple(shape) if shape is not None else v.shape)


def _finish(node: fx.Node, val: Any, like: fx.Node) -> fx.Node:
    if val is not None:
        node.meta["val"] = val
    copy_meta(node, like, role=Role.COMM)
    return node


def emit_all_reduce(
    graph: fx.Graph, x: fx.Node, *, reduce_op: str, group_name: str
) -> tuple[fx.Node, fx.Node]:
    """Insert ``all_reduce(x)`` and its wait at the graph's insert point; returns (collective, wait)."""
    coll = _finish(
        graph.call_function(_c10d.all_reduce.default, (x, reduce_op, group_name)), _fake_like(x), x
    )
    wait = _finish(graph.call_function(WAIT, (coll,)), _fake_like(x), x)
    return coll, wait


def emit_all_gather(
    graph: fx.Graph, x: fx.Node, *, group_size: int, group_name: str
) -> tuple[fx.Node, fx.Node]:
    """Gather ``x`` from every rank, concatenated along dim 0; returns (collective, wait)."""
    v = _val(x)
    shape = None if v is None else [v.shape[0] * group_size, *v.shape[1:]]
    coll = _finish(
        graph.call_function(_c10d.all_gather_into_tensor.default, (x, group_size, group_name)),
        _fake_like(x, shape),
        x,
    )
    wait = _finish(graph.call_function(WAIT, (coll,)), _fake_like(x, shape), x)
    return coll, wait


def emit_reduce_scatter(
    graph: fx.Graph, x: fx.Node, *, reduce_op: str, group_size: int, group_name: str
) -> tuple[fx.Node, fx.Node]:
    """Reduce ``x`` across ranks and keep this rank's dim-0 chunk; returns (collective, wait)."""
    v = _val(x)
    shape = None if v is None else [v.shape[0] // group_size, *v.shape[1:]]
    coll = _finish(
        graph.call_function(_c10d.reduce_scatter_tensor.default, (x, reduce_op, group_size, group_name)),
        _fake_like(x, shape),
        x,
    )
    wait = _finish(graph.call_function(WAIT, (coll,)), _fake_like(x, shape), x)
    return coll, wait


def emit_all_to_all(
    graph: fx.Graph, x: fx.Node, *, group_size: int, group_name: str
) -> tuple[fx.Node, fx.Node]:
    """Send dim-0 chunk ``r`` of ``x`` to rank ``r``, receive every rank's chunk of this rank in
    rank order (equal splits: ``x.shape[0]`` divisible by ``group_size``); returns (collective, wait)."""
    v = _val(x)
    assert v is not None and v.shape[0] % group_size == 0, x.name
    splits = [v.shape[0] // group_size] * group_size
    coll = _finish(
        graph.call_function(_c10d.all_to_all_single.default, (x, splits, splits, group_name)),
        _fake_like(x),
        x,
    )
    wait = _finish(graph.call_function(WAIT, (coll,)), _fake_like(x), x)
    return coll, wait
