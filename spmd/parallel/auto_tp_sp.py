"""Sequence parallelism in the automatic placements (:func:`spmd.parallel.auto_tp.choose`).

Once the column -> row regions, the vocabulary-parallel embedding and the head are chosen, the
values *between* them (the residual stream: the embedding's output, the row-parallel outputs,
the residual adds, the norms, dropout, the final norm before the head) are computed whole on
every tensor-parallel rank. Megatron's sequence parallelism splits them on the sequence instead:
each row-parallel output is reduce-scattered into the split (``RowwiseParallel(output_layouts=
Shard(1))``) rather than all-reduced, each column-parallel input all-gathered from it, and the
norms between run on 1/tp of the tokens (``SequenceParallel()``). A reduce-scatter and an
all-gather move the bytes of one all-reduce (ring: ``(n-1)/n`` of the value each, twice that for
the all-reduce), so the split saves ``1 - 1/tp`` of the stream's activations at no extra
communication, but for one small all-reduce per norm weight: its gradient is a partial sum over
the tokens each rank holds.

How it is chosen, from the graph (:func:`find_stream`): from the sharded row-parallel matmuls and
the embedding, the forward dataflow is followed until it enters a column-parallel module or the
head (where the all-gather goes); the nodes on the way are the stream. Modules whose every
activation op is on the stream (the norms, a dropout) get ``SequenceParallel``. The sequence is the
dimension before the features of the values leaving the row-parallel modules (dim 1 of
``(batch, seq, features)``) and must divide by tp.

It is one choice for the whole stream (the residual connects every layer's), checked like the
regions (:func:`spmd.parallel.auto_tp_check.dirty_nodes`): the forward runs on fake DTensors with
the sequence-parallel plan, and the split is taken only if no op on the stream makes DTensor
communicate (the planned boundaries' reduce-scatters and all-gathers excepted): an op that mixes
tokens (attention left replicated, a mixture of experts' token routing, a convolution over the
sequence) needs the whole sequence, so the stream stays replicated. Priced
(:func:`price`): activation bytes saved against the norm weights' gradient all-reduces added.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from passes.meta import MODULE, PHASE, ROLE, STATE_NAME, Phase, Role
from passes.torch_compat import pytree
from spmd.parallel.auto_tp import Decision, Price, _short, _size
from spmd.parallel.auto_tp_check import _Probe, _Stop
from spmd.parallel.auto_tp_graph import _LOSS, Region, nbytes
from spmd.parallel.expand_graph import _Expander


@dataclasses.dataclass
class Stream:
    """The values between the sharded regions, and how a plan splits them on the sequence."""

    nodes: set[fx.Node]  # forward nodes between the regions
    dim: int  # the sequence dimension of its values
    rows: dict[str, str]  # module fqn -> "row" / "embedding": its output reduce-scattered into the split
    heads: list[str]  # head modules: their input all-gathered from the split
    norms: list[str]  # modules wholly on the stream: SequenceParallel
    params: list[str]  # the norms' parameters (replicated; gradients all-reduced over tp)
    boundary: set[str]  # every module above, and the column-parallel ones the stream enters


@dataclasses.dataclass
class SequenceDecision(Decision):
    """The sequence-parallel choice: one for the whole stream, shown with its modules."""

    stream: Stream | None = None

    @property
    def params(self) -> list[str]:
        """The norms' parameters: the dump and the report show this decision on them."""
        return self.stream.params if self.stream is not None else []

    def describe(self) -> str:
        names = ", ".join(dict.fromkeys(_short(m) for m in (self.stream.norms if self.stream else [])))
        verdict = "sharded" if self.sharded else "replicated"
        return f"{names or 'the residual stream'}: sequence-parallel, {verdict}: {self.why}"


def _inside(mod: str, mods: Any) -> bool:
    return any(mod == b or mod.startswith(b + ".") for b in mods)


def find_stream(gm: fx.GraphModule, regions: list[Region], tp: int) -> Stream | str:
    """The stream between the sharded ``regions`` of ``gm`` (see the module docstring), or why
    there is none."""
    rows: dict[str, str] = {}
    cols: set[str] = set()
    heads: list[str] = []
    starts: list[fx.Node] = []
    for r in regions:
        if r.kind == "pair":
            starts += r.consumers
            rows.update((str(c.meta.get(MODULE) or ""), "row") for c in r.consumers)
            cols |= {str(p.meta.get(MODULE) or "") for p in r.producers}
        elif r.kind == "embedding":
            starts += r.producers
            rows[str(r.producers[0].meta.get(MODULE) or "")] = "embedding"
        else:
            heads.append(str(r.producers[0].meta.get(MODULE) or ""))
    if not starts:
        return "no row-parallel region or vocabulary-parallel embedding to split after"
    if "" in rows or "" in cols or "" in heads:
        return "a sharded matmul is not inside a module (no style can carry its layouts)"
    sinks = cols | set(heads)
    nodes: set[fx.Node] = set()
    exits: set[fx.Node] = set()
    seen, todo = set(starts), list(starts)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output" and n in nodes:
                return f"{n.name}, a value between the regions, is an output of the step"
            if u in seen or u.op != "call_function" or u.meta.get(PHASE) is not Phase.FORWARD:
                continue
            mod = str(u.meta.get(MODULE) or "")
            if _inside(mod, sinks) or u.target in _LOSS:
                continue  # a column-parallel input (the all-gather) or the loss
            seen.add(u)
            todo.append(u)
            if _inside(mod, rows):
                continue  # the row module's own output view
            nodes.add(u)
            if n not in nodes:
                exits.add(n)
    if not nodes:
        return "nothing runs between the regions"
    vals = [n.meta.get("val") for n in exits]
    ranks = {v.dim() for v in vals if isinstance(v, torch.Tensor)}
    if len(ranks) != 1 or min(ranks) < 2:
        return "the values leaving the regions have no common sequence dimension"
    dim = ranks.pop() - 2
    if any(isinstance(v, torch.Tensor) and v.shape[dim] % tp for v in vals):
        return f"the sequence (dim {dim}) is not a multiple of {tp} ranks"
    norms = _stream_modules(gm, nodes)
    params = [
        str(ph.meta.get(STATE_NAME))
        for ph in gm.graph.nodes
        if ph.op == "placeholder"
        and ph.meta.get(ROLE) is Role.PARAM
        and any(str(ph.meta.get(STATE_NAME)).startswith(m + ".") for m in norms)
    ]
    return Stream(nodes, dim, rows, heads, norms, params, set(rows) | sinks | set(norms))


def _stream_modules(gm: fx.GraphModule, nodes: set[fx.Node]) -> list[str]:
    """The outermost modules whose every forward op that depends on the batch is in ``nodes``."""
    reach: set[fx.Node] = set()
    by_mod: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.meta.get(ROLE) is Role.INPUT:
                reach.add(n)
            continue
        if n.meta.get(PHASE) is not Phase.FORWARD or not any(i in reach for i in n.all_input_nodes):
            continue
        reach.add(n)
        parts = str(n.meta.get(MODULE) or "").split(".")
        for i in range(1, len(parts) + 1):
            if parts[0]:
                by_mod.setdefault(".".join(parts[:i]), []).append(n)
    ok = [m for m, ns in by_mod.items() if all(x in nodes for x in ns)]
    return [m for m in ok if not any(m.startswith(o + ".") for o in ok)]


def restyle(
    entries: dict[str, Any], module: nn.Module, stream: Stream, placements: dict[str, Placement]
) -> str | None:
    """Rewrite a plan's entries (module fqn -> style, before collapsing) for ``stream``, as
    torchtitan's sequence-parallel plan writes them; None, or why the plan cannot express it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(stream.dim)
    for fqn, kind in stream.rows.items():
        if not isinstance(entries.get(fqn), RowwiseParallel):
            return f"{fqn} is placed without a RowwiseParallel style"
        if kind == "embedding":
            entries[fqn] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        else:
            entries[fqn] = RowwiseParallel(output_layouts=seq)
    for fqn in stream.heads:
        if fqn not in entries and not _colwise_fits(module, fqn, placements):
            return f"the head {fqn} is placed without a ColwiseParallel style"
        entries[fqn] = ColwiseParallel(input_layouts=seq)
    for fqn in stream.norms:
        if fqn in entries:
            return f"{fqn} is placed by the plan already"
        entries[fqn] = SequenceParallel(sequence_dim=stream.dim)
    return None


def _colwise_fits(module: nn.Module, fqn: str, placements: dict[str, Placement]) -> bool:
    """Whether ``ColwiseParallel`` on module ``fqn`` places its parameters as ``placements``
    does (a head tied to the embedding: its weight is placed under the embedding's name)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from spmd.errors import ConfigError
    from spmd.parallel.tensor_parallel import resolve_plan

    names: dict[int, str] = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    m = module.get_submodule(fqn)
    holder = nn.Module()
    holder.add_module("m", m)
    try:
        got = resolve_plan(holder, {"m": ColwiseParallel()}).params
    except ConfigError:
        return False
    own = dict(m.named_parameters(recurse=False))
    return all(placements.get(names.get(id(own[k[2:]]), ""), Replicate()) == v for k, v in got.items())


class OpProbe(_Probe):
    """The check's interpreter, recording a node only where its op itself makes DTensor
    communicate: a value redistributed to a planned module's boundary layout (the
    reduce-scatters and all-gathers sequence parallelism plans) is not an op's doing. A node of
    ``stream`` whose result is a partial sum is recorded too: it reduced over the split tokens
    (a loss summed over them), which no token-wise op does."""

    def __init__(
        self, *args: Any, stream: set[fx.Node] | frozenset[fx.Node] = frozenset(), **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.stream = stream

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "placeholder" and n.meta.get(PHASE) in (Phase.BACKWARD, Phase.OPTIMIZER):
            raise _Stop
        if n.op == "output":
            raise _Stop
        self._node = n
        try:
            return _Expander.run_node(self, n)
        except _Stop:
            raise
        except Exception:  # noqa: BLE001 - DTensor cannot propagate the candidate here
            self.dirty.add(n)
            raise _Stop from None

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with CommDebugMode() as comm:
            out = super().call_function(target, args, kwargs)
        partial = any(
            isinstance(t, DTensor) and any(isinstance(p, Partial) for p in t.placements)
            for t in pytree.tree_leaves(out)
        )
        if comm.get_total_counts() or (partial and self._node in self.stream):
            self.dirty.add(self._node)
        return out


def dirty(
    gm: fx.GraphModule, module: nn.Module, mesh: Any, plan: dict[str, Any], stream: Stream
) -> fx.Node | None:
    """The first node of the stream (or of a module at its boundary) whose op makes DTensor
    communicate under ``plan``, or None: the split is clean."""
    from spmd.parallel.auto_tp_check import dirty_nodes

    bad = dirty_nodes(gm, module, mesh, plan, probe=functools.partial(OpProbe, stream=stream.nodes))
    for n in gm.graph.nodes:
        if n in bad and (n in stream.nodes or _inside(str(n.meta.get(MODULE) or ""), stream.boundary)):
            return n
    return None


def price(gm: fx.GraphModule, stream: Stream, regions: list[Region], tp: int) -> tuple[Price, str]:
    """What the split saves and adds per rank, and the sentence that says so."""
    p = Price()
    p.activation_bytes = int(sum(nbytes(n) for n in stream.nodes) * (1.0 - 1.0 / tp))
    grads = [
        n for n in gm.graph.nodes if n.op == "placeholder" and str(n.meta.get(STATE_NAME)) in stream.params
    ]
    p.comms = [("all_reduce", nbytes(n)) for n in grads]
    p.collectives = len(grads)
    p.collective_bytes = sum(nbytes(n) for n in grads)
    # Megatron's all-reduces that become a reduce-scatter and an all-gather: a pair's two (its output
    # in forward, its input gradient in backward), the embedding's and the head's input gradient.
    swapped = sum(2 if r.kind == "pair" else 1 for r in regions)
    why = (
        f"the values between the regions split on the sequence (dim {stream.dim}): saves "
        f"{_size(p.activation_bytes)} of activations per rank; {swapped} all-reduces become "
        f"reduce-scatter + all-gather pairs (the same bytes); adds {p.collectives} all-reduce"
        f"{'s' if p.collectives != 1 else ''} of norm weight gradients ({_size(p.collective_bytes)})"
    )
    return p, why
