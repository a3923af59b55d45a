"""The graph after each stage of a compile, kept cheaply and turned into GraphModules on demand.

Later passes rewrite the graph in place, so a stage must be copied when it is recorded.
A full ``GraphModule`` copy is costly on a whole-step graph: the node copy is about a
third, generating and ``exec``-ing its Python (``recompile``) the rest, and a compile
records ten or more stages. :class:`Stages` keeps each stage as a bare ``fx.Graph`` copy
(no code generation) plus the attributes its ``get_attr`` nodes read, and builds the
``GraphModule`` the first time the stage is looked up (``step.graphs[name]``, a dump,
``report(stage=...)``). A stage whose graph is unchanged since the previous recording
(a no-op pass: same nodes, in the same order, with the same targets, arguments and meta
values) shares that recording's copy instead of taking another.

What a recording keeps is what the old eager copy kept: the node list, targets,
arguments and a shallow copy of each node's meta (meta values are shared, not
deep-copied; passes replace meta values rather than mutate them).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch.fx as fx


def rebuilt(gm: fx.GraphModule, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """A GraphModule of ``graph`` over ``gm``'s attributes that keeps ``gm.meta`` (copied
    shallowly): ``fx.GraphModule(gm, graph)`` alone starts with an empty ``meta``."""
    new = fx.GraphModule(gm, graph, class_name=class_name)
    new.meta = dict(getattr(gm, "meta", {}))
    return new


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """An independent copy of ``graph``: the same nodes, names, targets and arguments, each
    node's meta copied shallowly (the output node's too), as ``Graph.graph_copy`` makes it.

    Nodes are created without arguments and given them after: ``Graph.create_node`` walks
    every argument with pytree to warn about raw SymInts (torch 2.13), which is most of a
    copy's cost on a whole-step graph (the fused optimizer takes lists of hundreds of
    tensors); a copy of a valid graph has nothing to warn about.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        m = new.create_node(n.op, n.target, name=n.name, type_expr=n.type)
        m.args = fx.map_arg(n.args, env.__getitem__)
        m.kwargs = fx.map_arg(n.kwargs, env.__getitem__)
        m.meta = dict(n.meta)
        env[n] = m
    return new


def _attrs(gm: fx.GraphModule, graph: fx.Graph) -> dict[str, Any]:
    """The objects ``graph``'s get_attr / call_module nodes name, looked up in ``gm`` now."""
    out: dict[str, Any] = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            obj: Any = gm
            for atom in str(n.target).split("."):
                obj = getattr(obj, atom)
            out[str(n.target)] = obj
    return out


def _fingerprint(graph: fx.Graph) -> list[tuple[Any, ...]]:
    # References, not ids: holding the objects keeps an id from being reused by a new one.
    return [
        (n, n.op, n.target, n.name, n.args, n.kwargs, *n.meta.keys(), *n.meta.values()) for n in graph.nodes
    ]


def _same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Whether two fingerprints are of the same graph state. Identity for nodes and meta
    values; arguments by ``==`` (nodes compare by identity; a nan makes it False: a copy)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if len(x) != len(y) or x[0] is not y[0] or x[1:4] != y[1:4]:
            return False
        try:
            if x[4] != y[4] or x[5] != y[5]:
                return False
        except Exception:  # an argument whose == does not give a bool (a tensor)
            return False
        if any(u is not v for u, v in zip(x[6:], y[6:])):
            return False
    return True


class _Recording:
    """One copy of a graph state: the bare graph and the attributes it reads."""

    def __init__(self, gm: fx.GraphModule):
        self.graph = copy_graph(gm.graph)
        self.attrs = _attrs(gm, self.graph)
        self.fingerprint = _fingerprint(gm.graph)

    def module(self) -> fx.GraphModule:
        # Each lookup gets its own graph: two stages sharing a recording stay independent.
        return fx.GraphModule(self.attrs, copy_graph(self.graph))


class Stages(MutableMapping[str, fx.GraphModule]):
    """Ordered ``{stage name: GraphModule}``; :meth:`record` keeps a stage without building it.

    Setting a stage (``stages[name] = gm``) stores ``gm`` itself (used for ``final``, the
    live graph). :meth:`record` stores a copy of ``gm`` as it is now, materialized into a
    GraphModule on first lookup and cached.
    """

    def __init__(self) -> None:
        self._items: dict[str, fx.GraphModule | _Recording] = {}
        self._last: tuple[fx.Graph, _Recording] | None = None

    def record(self, name: str, gm: fx.GraphModule) -> None:
        """Keep ``gm``'s graph as it is now under ``name`` (later in-place changes do not show)."""
        last = self._last
        if last is not None and last[0] is gm.graph and _same(last[1].fingerprint, _fingerprint(gm.graph)):
            rec = last[1]
        else:
            rec = _Recording(gm)
        self._last = (gm.graph, rec)
        self._items[name] = rec  # like a dict: a name set again keeps its place

    def recordings(self) -> int:
        """How many distinct copies the stages hold (shared ones counted once; for tests)."""
        return len({id(v) for v in self._items.values() if isinstance(v, _Recording)})

    def __getitem__(self, name: str) -> fx.GraphModule:
        v = self._items[name]
        if isinstance(v, _Recording):
            v = self._items[name] = v.module()
        return v

    def __setitem__(self, name: str, gm: fx.GraphModule) -> None:
        self._items[name] = gm

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Stages({list(self._items)})"
