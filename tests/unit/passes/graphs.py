"""Hand-built graphs for the pass tests, and a way to run them on several simulated ranks.

``Builder`` makes an ``fx.Graph`` whose nodes carry what the tracer and partitioner
would give them: ``meta["val"]`` fake tensors and spmd ROLE/PHASE/MODULE metadata.
``run_ranks`` runs a graph for ``W`` ranks in one process, lockstep, computing each
collective from every rank's input; it checks buffer layouts (which rank's data lands
where) that a world-size-1 run cannot see.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from passes import collectives as C
from passes.meta import PHASE, Phase, Role, set_meta

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class World:
    backend: str
    size: int
    group: str

    @property
    def real(self) -> bool:
        """Whether collectives compute real values (gloo); the fake backend only gets shapes right."""
        return self.backend == "gloo"


class Builder:
    def __init__(self, group: str = "0", world_size: int = 2):
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.group = group
        self.w = world_size
        self.phase = Phase.FORWARD
        self.module = ""

    def input(
        self,
        name: str,
        *shape: int,
        dtype: torch.dtype = torch.float32,
        role: Role = Role.PARAM,
        module: str = "",
    ) -> fx.Node:
        # Placeholders come first, as in a traced graph.
        first_op = next((n for n in self.graph.nodes if n.op != "placeholder"), None)
        if first_op is None:
            node = self.graph.placeholder(name)
        else:
            with self.graph.inserting_before(first_op):
                node = self.graph.placeholder(name)
        node.meta["val"] = self.mode.from_tensor(torch.empty(shape, dtype=dtype))
        set_meta(node, role=role, phase=Phase.FORWARD, module=module)
        return node

    def op(self, target: Any, *args: Any, role: Role = Role.ACTIVATION, module: str | None = None) -> fx.Node:
        node = self.graph.call_function(target, args)
        vals = fx.node.map_arg(args, lambda n: n.meta.get("val"))
        with self.mode:
            out = target(*vals)
        if out is not None:
            node.meta["val"] = out
        set_meta(node, role=role, phase=self.phase, module=self.module if module is None else module)
        return node

    def _served(self, pair: tuple[fx.Node, fx.Node]) -> fx.Node:
        # The emitters copy phase and module from the tensor they send; here the collective
        # belongs to the builder's current phase (a placeholder is always "forward").
        for n in pair:
            n.meta[PHASE] = self.phase
        return pair[1]

    def all_reduce(self, x: fx.Node, op: str = "avg", group: str | None = None) -> fx.Node:
        """all_reduce + wait; returns the wait."""
        return self._served(C.emit_all_reduce(self.graph, x, reduce_op=op, group_name=group or self.group))

    def all_gather(self, x: fx.Node, group: str | None = None) -> fx.Node:
        """all_gather_into_tensor + wait; returns the wait."""
        return self._served(
            C.emit_all_gather(self.graph, x, group_size=self.w, group_name=group or self.group)
        )

    def reduce_scatter(self, x: fx.Node, op: str = "avg") -> fx.Node:
        """reduce_scatter_tensor + wait; returns the wait."""
        pair = C.emit_reduce_scatter(self.graph, x, reduce_op=op, group_size=self.w, group_name=self.group)
        return self._served(pair)

    def coalesced(self, target: Any, xs: list[fx.Node], *args: Any) -> list[fx.Node]:
        """A coalesced collective with one getitem and one wait per output; returns the waits."""
        coll = self.graph.call_function(target, (xs, *args))
        vals = [x.meta["val"] for x in xs]
        if target is c10d.all_gather_into_tensor_coalesced.default:
            outs = [v.new_empty((v.shape[0] * args[0], *v.shape[1:])) for v in vals]
        else:
            outs = [v.new_empty(v.shape) for v in vals]
        coll.meta["val"] = outs
        set_meta(coll, role=Role.COMM, phase=self.phase, module=self.module)
        waits = []
        for i, out in enumerate(outs):
            item = self.graph.call_function(operator.getitem, (coll, i))
            item.meta["val"] = out
            set_meta(item, role=Role.COMM, phase=self.phase, module=self.module)
            wait = self.graph.call_function(C.WAIT, (item,))
            wait.meta["val"] = out.new_empty(out.shape)
            set_meta(wait, role=Role.COMM, phase=self.phase, module=self.module)
            waits.append(wait)
        return waits

    def finish(self, *outputs: fx.Node) -> fx.GraphModule:
        out = self.graph.output(tuple(outputs))
        set_meta(out, role=Role.ACTIVATION, phase=self.phase)
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        gm.graph.lint()
        return gm


def colls(gm: fx.GraphModule) -> list[str]:
    """The collective sequence as short strings: ``["all_reduce", "all_gather", ...]``."""
    return [C.kind_of(n).value for n in C.collectives(gm.graph)]


def inputs_for(gm: fx.GraphModule, seed: int = 0) -> list[torch.Tensor]:
    """Random real tensors shaped like the placeholders' fake values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            out.append(torch.randn(tuple(v.shape), generator=g).to(v.dtype))
    return out


def clone_gm(gm: fx.GraphModule) -> fx.GraphModule:
    """An independent copy that a pass may rewrite without touching ``gm``."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def flat(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, list | tuple) else [out]


def run_ranks(gm: fx.GraphModule, per_rank: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Run ``gm`` as ``len(per_rank)`` ranks in lockstep; each rank's outputs.

    Non-collective nodes run once per rank on that rank's values. A collective sees every
    rank's input: all_reduce sums in rank order (divides for "avg"), all_gather
    concatenates on dim 0, reduce_scatter sums then keeps rank ``r``'s dim-0 chunk,
    all_to_all_single (equal splits) gives rank ``r`` every rank's chunk ``r``.
    """
    w = len(per_rank)
    envs: list[dict[fx.Node, Any]] = [{} for _ in range(w)]
    for r in range(w):
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        envs[r].update(zip(phs, [t.clone() for t in per_rank[r]]))
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        args = [fx.node.map_arg(node.args, lambda n, r=r: envs[r][n]) for r in range(w)]
        kwargs = [fx.node.map_arg(node.kwargs, lambda n, r=r: envs[r][n]) for r in range(w)]
        if C.is_collective(node):
            outs = _simulate(node, [a[0] for a in args])
            for r in range(w):
                envs[r][node] = outs[r]
        elif C.is_wait(node):
            for r in range(w):
                envs[r][node] = args[r][0]
        else:
            for r in range(w):
                envs[r][node] = node.target(*args[r], **kwargs[r])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [flat(fx.node.map_arg(out.args[0], lambda n, r=r: envs[r][n])) for r in range(w)]


def _simulate(node: fx.Node, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    w, kind = len(xs), C.kind_of(node)
    assert not C.is_coalesced(node), "run_ranks simulates plain collectives only"
    if kind is C.Kind.ALL_GATHER:
        assert C.group_size_of(node) == w
        return [torch.cat(xs, 0) for _ in range(w)]
    if kind is C.Kind.ALL_TO_ALL:  # equal splits: rank r gets chunk r of every rank, in rank order
        assert C.group_size_of(node) == w
        return [torch.cat([x.chunk(w, 0)[r] for x in xs], 0) for r in range(w)]
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    if C.reduce_op_of(node) == "avg":
        total = total / w
    if kind is C.Kind.ALL_REDUCE:
        return [total.clone() for _ in range(w)]
    assert kind is C.Kind.REDUCE_SCATTER and C.group_size_of(node) == w
    return [c.clone() for c in total.chunk(w, 0)]


def assert_untouched(graph_pass: Any, gm: fx.GraphModule) -> None:
    """``graph_pass`` had nothing to do: it returned ``gm`` itself with the same nodes and code."""
    nodes, code, forward = list(gm.graph.nodes), gm.code, type(gm).forward
    assert graph_pass(gm) is gm
    assert list(gm.graph.nodes) == nodes
    assert gm.code == code
    assert type(gm).forward is forward, "recompiled although nothing changed"


def check_same_results(before: fx.GraphModule, after: fx.GraphModule, world) -> None:
    """Same output shapes at any world size; identical values where collectives are real (gloo, W=1)."""
    args = inputs_for(before)
    ref, out = flat(before(*[a.clone() for a in args])), flat(after(*[a.clone() for a in args]))
    assert [o.shape for o in out] == [r.shape for r in ref]
    if world.real:
        assert all(torch.equal(o, r) for o, r in zip(out, ref))
