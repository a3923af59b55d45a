"""Merge identical collectives into one.

A partitioner that emits one collective per use produces duplicates: a tied weight
(one placeholder read by two modules) is all-gathered twice, a parameter read twice
in forward is gathered twice, a gradient can be reduced twice. Sending the same
bytes twice is pure waste.
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch.fx as fx

from passes import collectives as C
from passes.graph_utils import storage_of, written_storages
from passes.meta import MICROBATCH, PHASE


def dedup_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every collective identical to an earlier one by the earlier one's result.

    Identical means: the same op, the same input node(s), the same non-tensor
    arguments (reduce op, group size, group) and the same phase. Users of the
    duplicate's wait(s) read the kept collective's wait(s) instead; when a kept wait
    comes after the first such user, it moves up to just before it. Works for every
    collective kind, coalesced ones output by output.

    Why legal: the two collectives send the same values on every rank (same input
    node, and nothing writes its storage in between: checked), so they return the
    same result; and nothing writes either result in place (checked), so sharing one
    buffer is unobservable. The collective order of the remaining collectives is
    unchanged, and every rank removes the same ones because the decision reads only
    the graph.

    Phase is part of the identity on purpose: with ``reshard_after_forward`` the
    partitioner gathers a parameter in forward and again in backward; merging them
    would keep the full parameter alive across the step (SHARD_GRAD_OP memory). The
    micro-batch is part of it for the same reason: a step that accumulates gradients
    gathers each parameter again for every micro-batch.

    Where: right after the partitioner, before bucketing (a bucket holding the same
    tensor twice sends it twice). No-op (the same ``gm``, untouched) when no two
    collectives are identical.
    """
    graph = gm.graph
    colls = [c for c in C.collectives(graph) if _well_formed(c)]
    if len({_identity(c) for c in colls}) == len(colls):
        return gm
    written_by = {n: written_storages(n) for n in graph.nodes}
    kept: dict[Any, fx.Node] = {}
    merged = False
    for coll in colls:
        key = _identity(coll)
        keep = kept.get(key)
        if keep is not None and _can_merge(graph, keep, coll, written_by):
            _merge(graph, keep, coll)
            merged = True
        else:
            # The first of its kind, or one that cannot share the earlier one's result:
            # later duplicates are compared with this one.
            kept[key] = coll
    if not merged:
        return gm
    graph.lint()
    gm.recompile()
    return gm


def _freeze(arg: Any) -> Any:
    if isinstance(arg, list | tuple):
        return tuple(_freeze(a) for a in arg)
    if isinstance(arg, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in arg.items()))
    return arg


def _identity(coll: fx.Node) -> tuple:
    return (
        coll.target,
        _freeze(coll.args),
        _freeze(coll.kwargs),
        coll.meta.get(PHASE),
        coll.meta.get(MICROBATCH),
    )


def _outputs(coll: fx.Node) -> list[tuple[fx.Node | None, fx.Node]]:
    """(getitem or None, wait) for each output of ``coll``, by output index."""
    if not C.is_coalesced(coll):
        return [(None, next(iter(coll.users)))]
    items = sorted(coll.users, key=lambda u: cast(int, u.args[1]))
    return [(item, next(iter(item.users))) for item in items]


def _well_formed(coll: fx.Node) -> bool:
    """Exactly one wait per output and nothing else reading the result (what the checker demands)."""
    if not C.is_coalesced(coll):
        return len(coll.users) == 1 and C.is_wait(next(iter(coll.users)))
    n = len(C.inputs_of(coll))
    items = list(coll.users)
    if sorted(cast(int, u.args[1]) if u.target is operator.getitem else -1 for u in items) != list(range(n)):
        return False
    return all(len(i.users) == 1 and C.is_wait(next(iter(i.users))) for i in items)


def _can_merge(graph: fx.Graph, keep: fx.Node, dup: fx.Node, written_by: dict[fx.Node, set]) -> bool:
    inputs = {s for s in map(storage_of, C.inputs_of(keep)) if s is not None}
    results = {s for _, w in _outputs(keep) + _outputs(dup) if (s := storage_of(w)) is not None}
    between = False
    for node in graph.nodes:
        if node is keep:
            between = True
        elif node is dup:
            between = False
        written = written_by.get(node, set())
        if written & results:
            return False  # someone writes a result in place: sharing it would be observable
        if between and written & inputs:
            return False  # the input changed between the two: they do not send the same values
    return True


def _merge(graph: fx.Graph, keep: fx.Node, dup: fx.Node) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    for (keep_item, keep_wait), (dup_item, dup_wait) in zip(_outputs(keep), _outputs(dup)):
        first_use = min(dup_wait.users, key=order.__getitem__, default=None)
        if first_use is not None and order[keep_wait] > order[first_use]:
            if keep_item is not None and order[keep_item] > order[first_use]:
                first_use.prepend(keep_item)
            first_use.prepend(keep_wait)
        dup_wait.replace_all_uses_with(keep_wait)
        graph.erase_node(dup_wait)
        if dup_item is not None:
            graph.erase_node(dup_item)
    graph.erase_node(dup)
