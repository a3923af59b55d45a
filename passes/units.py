"""Decide the communication units: which collectives travel together.

An FSDP unit is a block of the model (``layers.3``): its parameters are gathered
together, its gradients reduced together, and its gathered parameters freed
together. Every collective costs a fixed latency, though, and a model of many tiny
blocks pays it dozens of times a step (FSDP2's weak spot). This pass records in
``node.meta[UNIT]`` the unit of every all-gather and reduce-scatter, merging
neighbouring blocks, in the order the step needs them, until a merged unit holds at
least ``min_unit_bytes``; a last group still smaller than that (the head after a stack
of blocks) joins the group before it. Blocks at least that large stay units of their own, so a
large model keeps FSDP's memory profile, while a stack of tiny blocks becomes a few
well-sized buckets. An all-reduce of a reduce-scatter's result (hybrid_shard: reduce within
the shard group, then across replicas) belongs to the reduce-scatter's unit.

Why it is legal: it only annotates; the passes that read the unit (prefetch,
bucketing) keep their own guarantees. Units are computed per phase and kind from the
graph alone, hence identically on every rank.

Where it runs: after the partitioner and dedup, before prefetch and bucketing.
No-op (same gm) when the graph has no all-gather or reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from passes import collectives as C
from passes.graph_utils import PASS_THROUGH_OPS
from passes.meta import MICROBATCH, PHASE

UNIT = "spmd_unit"


def unit_from_meta(fallback: Callable[[fx.Node], str]) -> Callable[[fx.Node], str]:
    """A ``unit_of`` reading :data:`UNIT`, else ``fallback``."""

    def unit_of(node: fx.Node) -> str:
        return node.meta.get(UNIT) or fallback(node)

    return unit_of


def assign_units(
    gm: fx.GraphModule, *, unit_of: Callable[[fx.Node], str], min_unit_bytes: int
) -> fx.GraphModule:
    """Annotate gathers and reduce-scatters with merged units (see module doc)."""
    colls = [c for c in C.collectives(gm.graph) if C.kind_of(c) in (C.Kind.ALL_GATHER, C.Kind.REDUCE_SCATTER)]
    if not colls:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def needed_at(c: fx.Node) -> int:
        waits = C.waits_of(c)
        return min(order[w] for w in waits) if waits else order[c]

    streams: dict[tuple, list[fx.Node]] = {}
    for c in colls:
        streams.setdefault((C.kind_of(c), c.meta.get(PHASE), c.meta.get(MICROBATCH, 0)), []).append(c)
    for members in streams.values():
        # Blocks in the order the step needs them, with their sizes.
        blocks: dict[str, list[fx.Node]] = {}
        for c in sorted(members, key=needed_at):
            blocks.setdefault(unit_of(c), []).append(c)
        groups: list[list[str]] = []
        sizes: list[int] = []
        for name, nodes in blocks.items():
            if not groups or sizes[-1] >= min_unit_bytes:
                groups.append([])
                sizes.append(0)
            groups[-1].append(name)
            sizes[-1] += sum(C.bytes_of(c) for c in nodes)
        # A short remainder (the head after a stack of blocks) joins the group before it rather
        # than paying a collective's latency and a synchronisation of the ranks on its own; that
        # group grows by less than the threshold.
        if len(groups) > 1 and sizes[-1] < min_unit_bytes:
            last = groups.pop()
            groups[-1] += last
        for group in groups:
            _label(blocks, group)
    _label_follow_up_all_reduces(colls)
    return gm


def _label_follow_up_all_reduces(colls: list[fx.Node]) -> None:
    for c in colls:
        if C.kind_of(c) is not C.Kind.REDUCE_SCATTER or UNIT not in c.meta:
            continue
        stack = list(C.waits_of(c))
        while stack:
            for u in stack.pop().users:
                if C.is_collective(u) and C.kind_of(u) is C.Kind.ALL_REDUCE:
                    u.meta[UNIT] = c.meta[UNIT]
                elif u.op == "call_function" and u.target in PASS_THROUGH_OPS:
                    stack.append(u)


def _label(blocks: dict[str, list[fx.Node]], group: list[str]) -> None:
    label = group[0] if len(group) == 1 else f"{group[0]}..{group[-1]}"
    for name in group:
        for c in blocks[name]:
            c.meta[UNIT] = label
