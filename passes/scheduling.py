"""Place waits: as late as their first use allows, as early as the in-flight cap demands.

``sink_waits``: a collective runs in the background from its issue until its
``wait_tensor``; every node between them is overlap. Moving each wait to just
before the first node that computes with its result maximises that window (views,
slices and detaches that merely pass the result on move along with it). Legal
because nothing but the wait's users depends on the wait, and the pass-through ops
read only the wait's result, which nothing writes. Run after bucketing (which
creates new waits). No-op when every wait already sits just before its first use.

``limit_inflight``: every collective in flight holds its unsharded buffer (an
all-gather's output, a reduce-scatter's full-size input). Walking the graph in
order, before a collective would push the bytes in flight above
``max_inflight_bytes``, the oldest outstanding collectives are waited on first
(their waits move up to just before it) -- the ``limit_all_gathers`` idea with a
byte budget. A single collective larger than the budget still runs, alone.
``max_inflight_collectives`` caps their number the same way: with 1, each
collective is waited before the next one is issued (it still overlaps the compute
between its issue and its wait). spmd sets 1 on gloo groups that run collectives on
more than one thread, where two at once can corrupt the heap (benchmarks/results/crashes.md). Run
after ``sink_waits``. No-op when neither cap is ever exceeded (or both are None).

Neither pass changes the order of collectives, only of waits, so the collective
sequence every rank issues is unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from passes import collectives as C
from passes.graph_utils import PASS_THROUGH_OPS


def _pass_through_chain(wait: fx.Node) -> list[fx.Node]:
    """``wait`` and the pass-through ops reading only from it (transitively)."""
    chain = [wait]
    members = {wait}
    stack = [wait]
    while stack:
        for u in stack.pop().users:
            if u in members or u.op != "call_function" or u.target not in PASS_THROUGH_OPS:
                continue
            if not all(i in members for i in u.all_input_nodes):
                continue
            members.add(u)
            chain.append(u)
            stack.append(u)
    return chain


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every wait (with its pass-through chain) to just before the first real use."""
    graph = gm.graph
    changed = False
    for wait in [n for n in graph.nodes if C.is_wait(n)]:
        # Positions by fx's node order (``a < b``, kept as nodes move), not a scan per wait.
        chain = _pass_through_chain(wait)
        members = set(chain)
        users = [u for n in chain for u in n.users if u not in members]
        if not users:
            continue
        first = min(users)
        # Members after ``first`` (a view read only later) stay where they are.
        before = sorted(n for n in chain if n < first)
        if before[-1].next is first and all(a.next is b for a, b in zip(before, before[1:])):
            continue  # already a contiguous run right before its first use
        for n in before:
            first.prepend(n)
        changed = True
    if not changed:
        return gm
    graph.lint()
    gm.recompile()
    return gm


def inflight_profile(gm: fx.GraphModule) -> list[tuple[fx.Node, int]]:
    """(collective, bytes in flight right after it is issued), in graph order."""
    out = []
    outstanding: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        if C.is_collective(n):
            outstanding[n] = C.bytes_of(n)
            out.append((n, sum(outstanding.values())))
        elif C.is_wait(n):
            outstanding.pop(C.collective_of(n), None)
    return out


def limit_inflight(
    gm: fx.GraphModule,
    *,
    max_inflight_bytes: int | str | None = "auto",
    max_inflight_collectives: int | None = None,
) -> fx.GraphModule:
    """Wait on the oldest collectives early so in-flight bytes (and, if given, the number of
    collectives in flight) stay within the budget.

    ``max_inflight_bytes="auto"`` allows twice the largest collective (one in use, one
    prefetched, like FSDP's ``limit_all_gathers``); None means no limit.
    ``max_inflight_collectives``: at most this many issued and not yet waited (>= 1); None
    means no limit. A collective carried to the next call (``cross_step_prefetch``) is added
    after this pass and is not counted.
    """
    if max_inflight_collectives is not None and max_inflight_collectives < 1:
        raise ValueError(f"max_inflight_collectives must be >= 1, got {max_inflight_collectives}")
    if max_inflight_bytes is None and max_inflight_collectives is None:
        return gm
    if max_inflight_bytes == "auto":
        sizes = [C.bytes_of(c) for c in C.collectives(gm.graph)]
        if not sizes:
            return gm
        max_inflight_bytes = 2 * max(sizes)
    assert max_inflight_bytes is None or isinstance(max_inflight_bytes, int)
    max_count = max_inflight_collectives
    graph = gm.graph
    changed = False
    outstanding: dict[fx.Node, int] = {}
    inflight = 0  # sum(outstanding.values())
    for n in list(graph.nodes):
        if C.is_wait(n):
            inflight -= outstanding.pop(C.collective_of(n), 0)
        elif C.is_collective(n):
            need = C.bytes_of(n)
            while outstanding and (
                (max_inflight_bytes is not None and inflight + need > max_inflight_bytes)
                or (max_count is not None and len(outstanding) >= max_count)
            ):
                oldest = next(iter(outstanding))
                for w in C.waits_of(oldest):
                    if w.args[0] is not oldest:  # coalesced: wait(getitem(coll, i))
                        n.prepend(w.args[0])
                    n.prepend(w)
                inflight -= outstanding.pop(oldest)
                changed = True
            outstanding[n] = need
            inflight += need
    if not changed:
        return gm
    graph.lint()
    gm.recompile()
    return gm
