"""Issue all-gathers ahead of their use, one FSDP unit at a time.

After partitioning, each parameter's all-gather sits right before its first use,
so every gather stalls compute. This pass groups the gathers of each unit (the
module a parameter belongs to, e.g. ``blocks.3``) and issues the whole unit
``forward_prefetch`` (or ``backward_prefetch``) units early: the gathers of unit
``i`` are placed right after the first wait of unit ``i - depth``, i.e. when that
unit starts computing, so they overlap its compute. Units closer to the start of
a phase than ``depth`` are issued at the start of the phase. Waits are not moved
(the partitioner put each just before its first use; see :mod:`passes.scheduling`).

Why it is legal: a gather reads only its parameter shard (a placeholder, maybe
padded), which no node writes before the optimizer phase, so it may be issued
anywhere earlier in the same phase. The new order of collectives is a function of
the graph alone, hence the same on every rank.

Where it runs: after dedup and before bucketing, so that each unit's gathers are
adjacent and bucketing can merge them into one collective per unit. A depth of 0
still groups units but issues each just before its own first use. No-op (same gm
returned) when the graph has no all-gather or nothing moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from passes import collectives as C
from passes.meta import MICROBATCH, PHASE, Phase, module_of


def default_unit_of(node: fx.Node) -> str:
    """The FSDP unit of a collective: its module path up to the first numeric component
    (``blocks.3.attn.qkv`` -> ``blocks.3``), else its first component (``tok_emb``)."""
    return unit_path(module_of(node))


def unit_path(path: str) -> str:
    """The FSDP unit of a module path (see :func:`default_unit_of`)."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _input_chain(coll: fx.Node) -> list[fx.Node] | None:
    """The nodes that exist only to feed ``coll`` (pads, flattens) back to placeholders,
    in graph order; None if ``coll`` depends on anything computed (then it cannot move)."""
    chain: list[fx.Node] = []
    stack = list(coll.all_input_nodes)
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        # Communication is computed too: moving it would carry another collective and its wait along.
        if n.op != "call_function" or len(n.users) != 1 or C.is_collective(n) or C.is_wait(n):
            return None
        chain.append(n)
        stack.extend(n.all_input_nodes)
    return sorted(chain)  # graph order (fx nodes compare by position)


def _first_use(coll: fx.Node) -> fx.Node:
    waits = C.waits_of(coll)
    return min(waits) if waits else coll


def prefetch_all_gathers(
    gm: fx.GraphModule,
    *,
    forward_prefetch: int = 1,
    backward_prefetch: int = 1,
    unit_of: Callable[[fx.Node], str] | None = None,
) -> fx.GraphModule:
    """Group all-gathers by unit and issue each unit ``depth`` units ahead (see module doc).

    Args:
        forward_prefetch: units of look-ahead in forward (FSDP ``forward_prefetch``).
        backward_prefetch: units of look-ahead in backward (FSDP ``BACKWARD_PRE``).
        unit_of: maps a collective to its unit name; default :func:`default_unit_of`.
    """
    unit_of = unit_of or default_unit_of
    graph = gm.graph
    gathers = [c for c in C.collectives(graph) if C.kind_of(c) is C.Kind.ALL_GATHER]
    if not gathers:
        return gm
    changed = False
    segments = sorted({c.meta.get(MICROBATCH, 0) for c in gathers})
    for micro in segments:
        for phase, depth in ((Phase.FORWARD, forward_prefetch), (Phase.BACKWARD, backward_prefetch)):
            changed |= _prefetch_segment(graph, gathers, phase, micro, depth, unit_of)
    if not changed:
        return gm
    graph.lint()
    gm.recompile()
    return gm


def _prefetch_segment(
    graph: fx.Graph,
    gathers: list[fx.Node],
    phase: Phase,
    micro: int,
    depth: int,
    unit_of: Callable[[fx.Node], str],
) -> bool:
    """Prefetch the gathers of one phase of one micro-batch; whether anything moved.

    Positions are compared with fx's node order (``a < b``), kept by fx as nodes move: a scan
    of the graph per unit made this pass quadratic on big graphs."""
    changed = False
    in_segment = lambda n: n.meta.get(PHASE) is phase and n.meta.get(MICROBATCH, 0) == micro  # noqa: E731
    in_phase = [c for c in gathers if in_segment(c)]
    if not in_phase:
        return False
    # Units in order of first use.
    units: dict[str, list[fx.Node]] = {}
    for c in sorted(in_phase, key=_first_use):
        units.setdefault(unit_of(c), []).append(c)
    unit_list = list(units.values())
    # The phase starts at its first node that stays put: skipping the input chains too keeps
    # the units issued at the start in order (else unit 1 lands before unit 0's pad).
    movable = set(in_phase) | {n for c in in_phase for n in _input_chain(c) or []}
    phase_start = next(n for n in graph.nodes if n.op != "placeholder" and in_segment(n) and n not in movable)
    for i, members in enumerate(unit_list):
        if i - depth >= 0 and depth > 0:
            prev = unit_list[i - depth]
            anchor_wait = min(w for c in prev for w in C.waits_of(c))
            anchor = anchor_wait.next
        elif depth > 0:
            anchor = phase_start
        else:
            anchor = min(w for c in members for w in C.waits_of(c))
        # The unit's own nodes may already sit at the anchor: insert after them instead.
        own = {n for c in members for n in [c, *(_input_chain(c) or [])]}
        while anchor in own:
            anchor = anchor.next
        for c in members:
            chain = _input_chain(c)
            if chain is None or c <= anchor and all(n <= anchor for n in chain):
                continue
            for n in [*chain, c]:
                anchor.prepend(n)
            changed = True
    return changed
