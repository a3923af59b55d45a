"""Split the fused optimizer update so each bucket's update overlaps the next bucket's reduction.

After bucketing and wait placement, every gradient reduction is waited on just before
the one fused optimizer call (``_fused_adamw_`` and friends) that reads all gradients,
so that call waits for the last bucket and the last reduction is exposed. This pass
splits each fused call into one call per group of parameters that become ready
together, and places each call right where its inputs are ready: the update of the
parameters of bucket ``k`` runs right after bucket ``k``'s wait, while bucket ``k+1`` is
still being reduced (under fully_shard: right after the unit's reduce-scatter wait).
Groups are issued in the order their inputs become ready, so the earliest-arriving
bucket is updated first.

Why legal: the fused CPU and CUDA kernels compute each tensor's update from that
tensor's own elements and the shared scalars/tensors (``lr``, ``grad_scale``,
``found_inf``); how tensors are grouped into calls never changes a value. Each call
gets, for its parameters, exactly the per-parameter arguments (``self``, ``grads``,
state lists, ``state_steps``) the original call gave them, and the original's shared
arguments. A call moves up only past nodes it does not conflict with: it is placed
after every node (before the original call) that writes a storage it reads or writes,
or reads a storage it writes -- so a global quantity (a ``clip_grad_norm_`` over all
gradients, the ``_foreach_mul_`` that scales them, the step counter ``_foreach_add_``,
a grad scaler's ``found_inf``) holds every update back until it is complete, and a
split that would not move anything is not made. The pure ops that exist only to feed
one parameter's slot (the alignment pads of fully_shard, a gradient's view) move with
its call. Collectives and waits do not move, so the collective order is unchanged.

The invariant, checked by :func:`check_optimizer_split` (and by
``passes.invariants.check_invariants``): every parameter of an original call is
updated exactly once, by a call whose inputs all precede it, with the same
per-parameter arguments and the same shared arguments as before.

Where: after the passes that place collectives and waits (bucketing, ``sink_waits``,
``limit_inflight``), which it reads and does not move. No-op (the same ``gm``) when the
graph has no fused optimizer call, or when every parameter becomes ready at the same
point (one group).

Foreach and for-loop optimizers (chains of ``_foreach_*`` or per-tensor ops) are then
reordered by :func:`passes.update_schedule.schedule_updates`: each op runs as early as its
dependencies allow, foreach ops split into one call per group of elements ready together.
"""

from __future__ import annotations

import bisect
from typing import Any, cast

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from passes import collectives as C
from passes.cleanup import untagged_name
from passes.fused_align import ALIGNED_FUSED
from passes.graph_utils import mutated_nodes, storage_of
from passes.update_schedule import check_foreach_split, schedule_updates

_aten = torch.ops.aten

# Fused optimizer kernels: elementwise per tensor; every ``Tensor[]`` argument is per parameter.
FUSED_OPTIMIZERS = {
    _aten._fused_adam_.default,
    _aten._fused_adam_.tensor_lr,
    _aten._fused_adamw_.default,
    _aten._fused_adamw_.tensor_lr,
    _aten._fused_sgd_.default,
    _aten._fused_sgd_.tensor_lr,
    ALIGNED_FUSED,  # a fused kernel on aligned shard copies (passes.fused_align): also per tensor
}

# On each call this pass made: what it was split from, so the checker can verify it.
SPLIT_OF = "spmd_optimizer_split"


class OptimizerSplitError(AssertionError):
    """A split optimizer call breaks the split invariant (see :func:`check_optimizer_split`)."""


def is_fused_optimizer(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in FUSED_OPTIMIZERS


def _nodes(node: fx.Node, i: int) -> list[fx.Node]:
    """Argument ``i`` of ``node``, a list of nodes."""
    return cast(list[fx.Node], list(cast(list, node.args[i])))


def _list_positions(node: fx.Node) -> list[int] | None:
    """Positions of the per-parameter list arguments of a fused call (all of the same length,
    or empty); None if the call does not have that shape (then it is left alone)."""
    n_params = len(_nodes(node, 0))
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, list | tuple):
            if len(a) == n_params and all(isinstance(x, fx.Node) for x in a):
                out.append(i)
            elif len(a) != 0 and i not in _int_lists(node):
                return None
    return out


def _int_lists(node: fx.Node) -> list[int]:
    """Positions of per-parameter int arguments (the alignment of ``spmd::aligned_fused_optimizer_``)."""
    if node.target is not ALIGNED_FUSED:
        return []
    n_params = len(_nodes(node, 0))
    return [
        i
        for i, a in enumerate(node.args)
        if isinstance(a, list | tuple) and len(a) == n_params and a and all(type(x) is int for x in a)
    ]


def _signature(node: fx.Node, k: int, lists: list[int]) -> tuple[tuple[int, str], ...]:
    """Parameter ``k``'s per-parameter arguments of ``node``, by name through grad tags (or value)."""
    return tuple((i, untagged_name(_nodes(node, i)[k])) for i in lists) + tuple(
        (i, repr(cast(list, node.args[i])[k])) for i in _int_lists(node)
    )


def _shared(node: fx.Node, lists: list[int]) -> tuple[Any, ...]:
    """What every split call shares with the original: non-list args, empty lists, kwargs."""
    per_param = set(lists) | set(_int_lists(node))
    args = tuple("<per-param>" if i in per_param else repr(a) for i, a in enumerate(node.args))
    return args, tuple(sorted((k, repr(v)) for k, v in node.kwargs.items()))


def _storages(nodes: list[fx.Node]) -> set[StorageWeakRef]:
    return {s for s in map(storage_of, nodes) if s is not None}


def overlap_optimizer(gm: fx.GraphModule, *, chains: bool = True) -> fx.GraphModule:
    """Split every fused optimizer call into one call per group of parameters that become
    ready together, each placed right after its inputs are ready (see module doc).

    Args:
        chains: reorder foreach and for-loop updates (:mod:`passes.update_schedule`) when the
            graph has no fused optimizer call (a fused update is placed by its split alone).
    """
    changed = False
    fused = [n for n in gm.graph.nodes if is_fused_optimizer(n)]
    for node in fused:
        changed |= _split(gm.graph, node)
    if chains and not fused:
        changed |= schedule_updates(gm.graph)
    if not changed:
        return gm
    gm.graph.lint()
    gm.recompile()
    return gm


def _feeders(node: fx.Node, lists: list[int], n_params: int) -> list[list[fx.Node]]:
    """Per parameter ``k``: the pure ops that exist only to feed ``k``'s slots of ``node``
    (transitively), which move with ``k``'s call."""
    slot_of: dict[fx.Node, set[int]] = {}
    for i in lists:
        for k, a in enumerate(_nodes(node, i)):
            slot_of.setdefault(a, set()).add(k)
    shared = set(node.all_input_nodes) - set(slot_of)
    out: list[list[fx.Node]] = []
    for k in range(n_params):
        mine: set[fx.Node] = set()
        stack = [a for a, ks in slot_of.items() if ks == {k}]
        while stack:
            n = stack.pop()
            if n in mine or n in shared or slot_of.get(n, {k}) != {k}:
                continue
            if n.op != "call_function" or C.is_collective(n) or C.is_wait(n) or mutated_nodes(n):
                continue
            if not all(u is node or u in mine for u in n.users):
                continue
            mine.add(n)
            stack.extend(n.all_input_nodes)
        out.append(list(mine))
    return out


def _split(graph: fx.Graph, node: fx.Node) -> bool:
    if node.users or not node.args or not isinstance(node.args[0], list | tuple) or len(node.args[0]) < 2:
        return False
    lists = _list_positions(node)
    if lists is None:
        return False
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    pos = order[node]
    n_params = len(_nodes(node, 0))
    feeders = _feeders(node, lists, n_params)
    moving = {f for fs in feeders for f in fs} | {node}
    per_param = {a for i in lists for a in _nodes(node, i)}
    shared_inputs = [i for i in node.all_input_nodes if i not in per_param]
    # Last writer / reader of each storage among the nodes that stay before the call.
    last_write: dict[StorageWeakRef, int] = {}
    last_read: dict[StorageWeakRef, int] = {}
    for n in nodes[:pos]:
        if n in moving:
            continue
        for s in _storages(n.all_input_nodes):
            last_read[s] = order[n]
        for s in _storages(mutated_nodes(n)):
            last_write[s] = order[n]
    written = set(mutated_nodes(node))
    ready: list[int] = []
    for k in range(n_params):
        slot = [_nodes(node, i)[k] for i in lists]
        group = set(feeders[k])
        readers = [n for n in slot if n not in group] + [i for f in group for i in f.all_input_nodes]
        inputs = [i for i in readers + shared_inputs if i not in group]
        writes = _storages([s for s in slot if s in written])
        touched = _storages(inputs) | writes
        r = max(
            [order[i] for i in inputs]
            + [last_write.get(s, -1) for s in touched]
            + [last_read.get(s, -1) for s in writes]
        )
        # A feeder may not move later past a write to what it reads.
        for f in group:
            if any(order[f] < last_write.get(s, -1) for s in _storages(f.all_input_nodes)):
                return False
        ready.append(r)
    # Group by the latest wait at or before each parameter's ready point: the bucket it waits for.
    wait_pos = [order[n] for n in nodes[:pos] if C.is_wait(n)]  # ascending

    def segment(r: int) -> int:
        i = bisect.bisect_right(wait_pos, r)
        return wait_pos[i - 1] if i else -1

    groups: dict[int, list[int]] = {}
    for k in sorted(range(n_params), key=lambda k: (segment(ready[k]), k)):
        groups.setdefault(segment(ready[k]), []).append(k)
    if len(groups) < 2:
        return False
    lists_set = set(lists) | set(_int_lists(node))
    total = n_params
    for members in groups.values():
        anchor = nodes[max(ready[k] for k in members)]
        args = tuple(
            [a[k] for k in members] if i in lists_set else a  # type: ignore[index]
            for i, a in enumerate(node.args)
        )
        own = sorted((f for k in members for f in feeders[k]), key=order.__getitem__)
        with graph.inserting_after(anchor):
            call = graph.call_function(cast(Any, node.target), args, dict(node.kwargs))
        call.meta = {key: v for key, v in node.meta.items() if key != SPLIT_OF}
        call.meta[SPLIT_OF] = {
            "source": node.meta.get(SPLIT_OF, {}).get("source", node.name),
            "total": node.meta.get(SPLIT_OF, {}).get("total", total),
            "params": {_nodes(node, 0)[k].name: _signature(node, k, lists) for k in members},
            "shared": _shared(node, lists),
        }
        for f in own:
            call.prepend(f)
    graph.erase_node(node)
    return True


def check_optimizer_split(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The split invariant, as ``(node name, message)`` violations (empty: it holds).

    For the calls split from one original call: every parameter is updated exactly once
    in all, with the per-parameter arguments recorded for it at the split, the same shared
    arguments, and every input before the call.
    """
    out: list[tuple[str, str]] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_source: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if is_fused_optimizer(n) and SPLIT_OF in n.meta:
            by_source.setdefault(n.meta[SPLIT_OF]["source"], []).append(n)
    for source, calls in by_source.items():
        seen: dict[str, str] = {}
        totals = {c.meta[SPLIT_OF]["total"] for c in calls}
        shared = {repr(c.meta[SPLIT_OF]["shared"]) for c in calls}
        if len(shared) != 1:
            out.append((calls[0].name, f"calls split from {source} disagree on their shared arguments"))
        for c in calls:
            info = c.meta[SPLIT_OF]
            lists = _list_positions(c) or []
            if repr(_shared(c, lists)) != repr(info["shared"]):
                out.append((c.name, f"shared arguments differ from those of {source}"))
            for i in c.all_input_nodes:
                if order[i] >= order[c]:
                    out.append((c.name, f"reads {i.name}, which comes after it"))
            names = [p.name for p in _nodes(c, 0)]
            if set(names) != set(info["params"]):
                out.append((c.name, f"updates {sorted(names)}, recorded {sorted(info['params'])}"))
            for k, name in enumerate(names):
                if name in seen:
                    out.append((c.name, f"parameter {name} also updated by {seen[name]}"))
                seen[name] = c.name
                if info["params"].get(name) != _signature(c, k, lists):
                    out.append((c.name, f"per-parameter arguments of {name} changed"))
        if totals != {len(seen)}:
            out.append((calls[0].name, f"{len(seen)} parameters updated, {source} updated {totals}"))
    return out + check_foreach_split(gm)
