"""Start each bucket's optimizer update right after its wait, for foreach and for-loop optimizers.

``passes.optimizer_overlap`` splits a *fused* optimizer call per bucket. The other two forms
torch's optimizers take are chains of ops: ``foreach=True`` is a chain of ``_foreach_*`` ops,
each over the list of all parameters (so each op waits for the last bucket); the for-loop
(single-tensor) form is one chain of ``aten`` ops per parameter, traced in parameter order
(so the update of parameter 0 waits for nothing but it still runs after every wait the
partitioner sank before it). This module reorders the optimizer phase so that every update
op runs as early as its inputs allow:

1. Each ``_foreach_*`` op of the phase is seen as one element op per list index (the
   ``_foreach_*`` kernels compute element ``k`` from the ``k``-th entry of every list
   argument and the shared arguments only: ``lr``, ``alpha``, a clip coefficient).
2. The ops of the phase, foreach elements included, are put in the earliest order their
   dependencies allow: data inputs, and storage conflicts in the original order (a write
   after a read or a write of the same storage, a read after a write). Waits (and the ops
   whose effects are not known: Python functions, writes to storage-less values) are
   barriers: no op moves past one downward. Waits are taken in the order their collectives
   were issued (the order they complete in), unless the phase issues collectives itself
   (then every barrier keeps its place). Among ops ready together, the one earliest in the
   original graph goes first (foreach elements by list index), so the elements of one
   foreach op that become ready together stay adjacent.
3. Adjacent elements of one foreach op become one ``_foreach_*`` call on the sub-lists of
   those elements: one call per bucket, each right after its bucket's wait.

Why legal: the new order is a topological order of the dependency graph, which includes
every storage conflict, so every op reads what it read before; a global quantity (a
``clip_grad_norm_`` that reads every gradient and the ``_foreach_mul_`` that scales them, a
step counter shared by all parameters) is a dependency of every update and holds them all
back. Elementwise math per tensor is unchanged, so the result is bit for bit the same.
Collectives keep their order, so the collective order is unchanged; a wait only moves up,
never before its collective.

Each split foreach call records what it was split from (``SPLIT_OF``); the ``optimizer-split``
invariant (:func:`check_foreach_split`) checks that the calls split from one op cover each
of its list indices exactly once, with the same per-index and shared arguments.

No-op (returns False, the graph untouched) when no op would move past a wait.
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
from typing import Any, cast

import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from passes import collectives as C
from passes import torch_compat
from passes.cleanup import untagged_name
from passes.graph_utils import mutated_nodes, storage_of
from passes.meta import PHASE, Phase
from passes.torch_compat import OpOverload

SPLIT_OF = "spmd_optimizer_split"  # the same key as passes.optimizer_overlap


def is_foreach(node: fx.Node) -> bool:
    t = node.target
    return (
        node.op == "call_function"
        and isinstance(t, OpOverload)
        and t.namespace == "aten"
        and torch_compat.op_schema(t).name.split("::")[-1].startswith("_foreach_")
    )


def _length(node: fx.Node) -> int | None:
    """The common length of the list arguments of a foreach op (None: no lists or mixed lengths)."""
    lens = {len(a) for a in (*node.args, *node.kwargs.values()) if isinstance(a, list | tuple)}
    return lens.pop() if len(lens) == 1 else None


def _splittable(node: fx.Node) -> int | None:
    """How many elements ``node`` splits into, if it is a foreach op whose result (if any) is
    only taken apart by ``getitem``; None otherwise."""
    if not is_foreach(node):
        return None
    n = _length(node)
    if n is None or n < 2:
        return None
    if not all(u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users):
        return None
    return n


def _elem(a: Any, n: int, ks: list[int]) -> Any:
    return [a[k] for k in ks] if isinstance(a, list | tuple) and len(a) == n else a


def element_signature(node: fx.Node, j: int) -> tuple[tuple[str, str], ...]:
    """Element ``j`` of a foreach call's per-element arguments, by name through grad tags (or value)."""
    n = _length(node)
    items = [*enumerate(node.args), *node.kwargs.items()]
    return tuple(
        (str(i), untagged_name(a[j]) if isinstance(a[j], fx.Node) else repr(a[j]))
        for i, a in items
        if isinstance(a, list | tuple) and len(a) == n
    )


def shared_args(node: fx.Node) -> str:
    """What every call split from one foreach op shares: the non-list arguments."""
    n = _length(node)
    items = [*enumerate(node.args), *sorted(node.kwargs.items())]
    return repr(
        tuple(
            (i, "<per-element>" if isinstance(a, list | tuple) and len(a) == n else repr(a)) for i, a in items
        )
    )


@dataclasses.dataclass(eq=False)
class _Item:
    node: fx.Node
    k: int | None  # element of a split foreach op; None: the whole node
    key: tuple[int, int]  # priority: original position, element
    barrier: bool
    deps: set[_Item] = dataclasses.field(default_factory=set)
    users: list[_Item] = dataclasses.field(default_factory=list)

    def __lt__(self, other: _Item) -> bool:
        return self.key < other.key


def _is_barrier(node: fx.Node) -> bool:
    if node.op != "call_function" or C.is_collective(node) or C.is_wait(node):
        return True
    if node.target is operator.getitem:
        return False
    if not isinstance(node.target, OpOverload):
        return True  # a Python function: what it touches is unknown
    return any(storage_of(m) is None for m in mutated_nodes(node))


def _io(node: fx.Node, k: int | None, n: int) -> tuple[list[fx.Node], list[fx.Node]]:
    """(inputs read, inputs written) of a node, or of its element ``k``."""
    if k is None:
        return node.all_input_nodes, mutated_nodes(node)
    ins: list[fx.Node] = []
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, list | tuple) and len(a) == n:
            ins.extend(x for x in [a[k]] if isinstance(x, fx.Node))
        elif isinstance(a, list | tuple):
            ins.extend(x for x in a if isinstance(x, fx.Node))
        elif isinstance(a, fx.Node):
            ins.append(a)
    written = set(mutated_nodes(node))
    return ins, [x for x in ins if x in written and _is_elem(node, x, k, n)]


def _is_elem(node: fx.Node, x: fx.Node, k: int, n: int) -> bool:
    return any(isinstance(a, list | tuple) and len(a) == n and a[k] is x for a in node.args)


def schedule_updates(graph: fx.Graph) -> bool:
    """Reorder the optimizer phase (see module doc); whether the graph changed."""
    nodes = list(graph.nodes)
    start = next((i for i, n in enumerate(nodes) if n.meta.get(PHASE) is Phase.OPTIMIZER), None)
    if not start:  # no optimizer phase (or nothing before it: no placeholders, nothing to wait for)
        return False
    region = [n for n in nodes[start:] if n.op != "output"]
    sizes = {n: size for n in region if (size := _splittable(n)) is not None}
    items: list[_Item] = []
    of: dict[tuple[fx.Node, int | None], _Item] = {}
    for pos, n in enumerate(region):
        for k in range(sizes[n]) if n in sizes else [None]:
            it = _Item(n, k, (pos, k or 0), _is_barrier(n))
            items.append(it)
            of[(n, k)] = it
    last_write: dict[StorageWeakRef, _Item] = {}
    readers: dict[StorageWeakRef, list[_Item]] = {}
    for it in items:
        ins, outs = _io(it.node, it.k, sizes.get(it.node, 0))
        for x in ins:
            src: _Item | None
            if it.node.target is operator.getitem and x in sizes:
                src = of[(x, cast(int, it.node.args[1]))]
            else:
                src = of.get((x, None))
            if src is not None:
                it.deps.add(src)
        reads = {s for s in map(storage_of, ins) if s is not None}
        writes = {s for s in map(storage_of, outs) if s is not None}
        for s in reads | writes:
            if s in last_write:
                it.deps.add(last_write[s])
        for s in writes:
            it.deps.update(readers.get(s, []))
        for s in reads:
            readers.setdefault(s, []).append(it)
        for s in writes:
            last_write[s] = it
            readers[s] = []
        it.deps.discard(it)
        for d in it.deps:
            d.users.append(it)
    if not any(C.is_collective(n) for n in region):
        # Waits in issue order: the collectives complete in that order, so a wait on an
        # earlier one may come first (a wait only depends on its collective, issued before).
        index = {n: i for i, n in enumerate(nodes)}
        waits = sorted((it for it in items if it.barrier), key=lambda it: _issued(it.node, index))
    else:
        waits = [it for it in items if it.barrier]
    order = _topo(items, waits)
    if not _moves_past_a_wait(items, order):
        return False
    _materialize(graph, nodes[start - 1], region, order, sizes)
    return True


def _issued(node: fx.Node, pos: dict[fx.Node, int]) -> tuple[int, int]:
    return (pos[C.collective_of(node)], pos[node]) if C.is_wait(node) else (pos[node], pos[node])


def _topo(items: list[_Item], barriers: list[_Item]) -> list[_Item]:
    """Earliest order: drain every ready op (earliest original first) before the next barrier."""
    missing = {it: len(it.deps) for it in items}
    ready = [it for it in items if not it.barrier and not it.deps]
    heapq.heapify(ready)
    out: list[_Item] = []

    def emit(it: _Item) -> None:
        out.append(it)
        for u in it.users:
            missing[u] -= 1
            if missing[u] == 0 and not u.barrier:
                heapq.heappush(ready, u)

    for b in [*barriers, None]:
        while ready:
            emit(heapq.heappop(ready))
        if b is not None:
            assert missing[b] == 0, f"{b.node.name}: a barrier whose inputs were not scheduled"
            emit(b)
    assert len(out) == len(items)
    return out


def _moves_past_a_wait(items: list[_Item], order: list[_Item]) -> bool:
    def waits_before(seq: list[_Item]) -> dict[_Item, int]:
        count, out = 0, {}
        for it in seq:
            out[it] = count
            count += C.is_wait(it.node)
        return out

    before, after = waits_before(items), waits_before(order)
    return any(after[it] < before[it] for it in items)


def _materialize(
    graph: fx.Graph, cursor: fx.Node, region: list[fx.Node], order: list[_Item], sizes: dict
) -> None:
    # Runs of adjacent elements of one foreach op: one call each.
    runs: list[tuple[fx.Node, list[int] | None]] = []
    for it in order:
        if it.k is not None and runs and runs[-1][0] is it.node and runs[-1][1] is not None:
            cast(list, runs[-1][1]).append(it.k)
        else:
            runs.append((it.node, None if it.k is None else [it.k]))
    where: dict[tuple[fx.Node, int], tuple[fx.Node, int]] = {}
    split = [n for n in sizes if sum(1 for m, ks in runs if m is n) > 1]
    for node, ks in runs:
        if ks is not None and node not in split:
            ks = None  # one run of all elements, in order: the node itself
        if ks is None:
            new = node
        else:
            n = sizes[node]
            args = tuple(_elem(a, n, ks) for a in node.args)
            kwargs = {k: _elem(v, n, ks) for k, v in node.kwargs.items()}
            new = graph.create_node("call_function", node.target, args, kwargs)
            new.meta = {k: v for k, v in node.meta.items() if k != SPLIT_OF}
            val = node.meta.get("val")
            if isinstance(val, list | tuple):
                new.meta["val"] = [val[k] for k in ks]
            new.meta[SPLIT_OF] = {
                "source": node.name,
                "total": n,
                "index": list(ks),
                "elements": {k: element_signature(node, k) for k in ks},
                "shared": shared_args(node),
            }
            for j, k in enumerate(ks):
                where[(node, k)] = (new, j)
        cursor.append(new)
        cursor = new
    for node in split:
        for u in list(node.users):
            new, j = where[(node, cast(int, u.args[1]))]
            u.args = (new, j)
        graph.erase_node(node)


def check_foreach_split(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The split invariant for foreach calls, as ``(node name, message)`` violations: the
    calls split from one foreach op cover each of its elements exactly once, each with the
    per-element arguments recorded at the split and the same shared arguments."""
    out: list[tuple[str, str]] = []
    by_source: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if is_foreach(n) and SPLIT_OF in n.meta and "index" in n.meta[SPLIT_OF]:
            by_source.setdefault(n.meta[SPLIT_OF]["source"], []).append(n)
    for source, calls in by_source.items():
        seen: dict[int, str] = {}
        total = calls[0].meta[SPLIT_OF]["total"]
        for c in calls:
            info = c.meta[SPLIT_OF]
            if shared_args(c) != info["shared"]:
                out.append((c.name, f"shared arguments differ from those of {source}"))
            if _length(c) != len(info["index"]):
                out.append((c.name, f"has {_length(c)} elements, recorded {len(info['index'])}"))
                continue
            for j, k in enumerate(info["index"]):
                if k in seen:
                    out.append((c.name, f"element {k} of {source} also computed by {seen[k]}"))
                seen[k] = c.name
                if element_signature(c, j) != info["elements"].get(k):
                    out.append((c.name, f"per-element arguments of element {k} of {source} changed"))
        if sorted(seen) != list(range(total)):
            out.append((calls[0].name, f"{len(seen)} of the {total} elements of {source} computed"))
    return out
