"""Keep the last unit of forward gathered into backward: one all-gather less per micro-batch.

With ``reshard_after_forward`` the partitioner gathers every sharded parameter twice: before
its first forward use, and again before its first backward use (its forward copy is freed at
the end of its unit's forward). The unit forward needs last is the unit backward needs first:
between the end of its forward and the start of its backward sit only the loss and the
loss's gradient. Freeing it there and gathering it back costs a collective (on the critical
path: backward cannot start without it) and saves memory only while the loss runs. FSDP2
never reshards its root module after forward for this reason, and torchtitan turns
resharding off for the last transformer block by hand; here the compiler finds that unit in
the graph, whatever the model.

What it does: for each micro-batch, the unit whose gathers forward waits on last (by
:data:`passes.units.UNIT`); for each of its gathers, the backward gather of the same
parameter (the same placeholder, through the same cast / pad / permute, in the same group)
is removed and its readers read the forward gather's result. The placeholders of the unit's
parameters are marked as not resharded (:data:`passes.meta.RESHARD` False), so
``check_reshard`` (the ``reshard`` invariant) exempts them and still holds every other
parameter to a backward gather of its own. All or nothing: the graph is left as it is unless
every backward gather of the unit's parameters matches a forward one, and every micro-batch
has the same last unit (its forward gathers share buckets, resharded or not together).

Why it is legal: a gather reads only its parameter shard, which nothing writes before the
optimizer phase, so the backward gather would return the forward gather's values.

Cost: the unit's gathered parameters live from their forward gather to their last backward
use instead of being freed at the end of their forward and gathered again at the start of
backward; the memory estimate and the plan see it (it is in the graph).

Where it runs: after ``assign_units`` (reads the units), before ``prefetch_all_gathers`` (which
then issues the next unit's gathers at the start of backward). No-op (same gm) without
resharded gathers in both phases.
"""

from __future__ import annotations

import torch.fx as fx

from passes import collectives as C
from passes.meta import MICROBATCH, PHASE, RESHARD, Phase
from passes.units import UNIT


def keep_last_unit_gathered(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop the backward re-gathers of the last forward unit's parameters (see module doc)."""
    gathers = [c for c in C.collectives(gm.graph) if C.kind_of(c) is C.Kind.ALL_GATHER]
    segments: dict[tuple[int, Phase], list[fx.Node]] = {}
    for c in gathers:
        phase = c.meta.get(PHASE)
        if phase in (Phase.FORWARD, Phase.BACKWARD) and _source(c) is not None:
            segments.setdefault((c.meta.get(MICROBATCH, 0), phase), []).append(c)
    micros = sorted({m for m, _ in segments})
    pairs: list[tuple[fx.Node, fx.Node]] = []
    kept: set[fx.Node] | None = None  # the placeholders of the last unit, the same in every micro-batch
    for micro in micros:
        fwd, bwd = segments.get((micro, Phase.FORWARD), []), segments.get((micro, Phase.BACKWARD), [])
        if not fwd or any(UNIT not in c.meta for c in fwd):
            return gm
        last = max(fwd, key=_needed_at).meta[UNIT]
        members = [f for f in fwd if f.meta[UNIT] == last]
        backward_of = {_signature(b): b for b in bwd}
        if len(backward_of) != len(bwd):
            return gm
        for f in members:
            # A parameter backward does not read (a bias: its gradient needs no value) has no
            # backward gather; one whose backward gather differs is not kept, nor is its unit
            # (its forward gather shares a bucket with the others', resharded or not together).
            b = backward_of.pop(_signature(f), None)
            if len(C.waits_of(f)) != 1 or (b is not None and len(C.waits_of(b)) != 1):
                return gm
            if b is not None:
                pairs.append((f, b))
        sources = {p for f in members if (p := _source(f)) is not None}
        if any(_source(b) in sources for b in backward_of.values()):
            return gm  # a backward gather of a kept parameter that matches none of its forward ones
        if kept is not None and sources != kept:
            return gm
        kept = sources
    if not pairs:
        return gm
    for f, b in pairs:
        wait_b = C.waits_of(b)[0]
        wait_b.replace_all_uses_with(C.waits_of(f)[0])
        _erase_with_inputs(gm.graph, wait_b)
    for p in kept or ():
        p.meta[RESHARD] = False
    gm.graph.lint()
    gm.recompile()
    return gm


def _needed_at(c: fx.Node) -> fx.Node:
    waits = C.waits_of(c)
    return min(waits) if waits else c


def _chain(c: fx.Node) -> list[fx.Node] | None:
    """The single-input, single-user nodes from the gather back to its placeholder (gather first),
    or None when the gather reads anything computed from more than one node."""
    out = []
    n = c.args[0]
    while isinstance(n, fx.Node) and n.op == "call_function":
        if len(n.all_input_nodes) != 1 or len(n.users) != 1:
            return None
        out.append(n)
        n = n.all_input_nodes[0]
    if not isinstance(n, fx.Node) or n.op != "placeholder":
        return None
    out.append(n)
    return out


def _source(c: fx.Node) -> fx.Node | None:
    """The resharded parameter placeholder ``c`` gathers, or None."""
    chain = _chain(c)
    if chain is None or not chain[-1].meta.get(RESHARD):
        return None
    return chain[-1]


def _signature(c: fx.Node) -> tuple:
    """What ``c`` gathers: its placeholder, the ops between (with their constant arguments) and
    the gather's own arguments. Equal for a parameter's forward and backward gathers."""
    chain = _chain(c) or []
    consts = lambda n: repr([a for a in n.args if not isinstance(a, fx.Node)])  # noqa: E731
    ops = tuple((n.target, consts(n), repr(n.kwargs)) for n in chain[:-1])
    return (chain[-1] if chain else None, ops, c.target, repr(c.args[1:]))


def _erase_with_inputs(graph: fx.Graph, wait: fx.Node) -> None:
    """Erase ``wait``, its gather and the gather's input chain (each left without readers)."""
    todo = [wait]
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function":
            continue
        ins = n.all_input_nodes
        graph.erase_node(n)
        todo.extend(ins)
