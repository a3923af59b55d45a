"""Place waits: as late as their first use allows, as early as the in-flight cap demands.

``sink_waits``: a collective runs in the background from its issue until its
``wait_tensor``; every node between them is overlap. Moving each wait to just
before the first node that reads its result maximises that window. Legal because
nothing but the wait's users depends on the wait. Run after bucketing (which
creates new waits). No-op when every wait already sits just before its first use.

``limit_inflight``: every collective in flight holds its unsharded buffer (an
all-gather's output, a reduce-scatter's full-size input). Walking the graph in
order, before a collective would push the bytes in flight above
``max_inflight_bytes``, the oldest outstanding collectives are waited on first
(their waits move up to just before it) -- the ``limit_all_gathers`` idea with a
byte budget. A single collective larger than the budget still runs, alone. Run
after ``sink_waits``. No-op when the budget is never exceeded or is None.

Neither pass changes the order of collectives, only of waits, so the collective
sequence every rank issues is unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from passes import collectives as C


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move every wait to just before its first user (see module doc)."""
    graph = gm.graph
    changed = False
    order = {n: i for i, n in enumerate(graph.nodes)}
    for wait in [n for n in graph.nodes if C.is_wait(n)]:
        if not wait.users:
            continue
        first = min(wait.users, key=order.__getitem__)
        if wait.next is first:
            continue
        first.prepend(wait)
        changed = True
        order = {n: i for i, n in enumerate(graph.nodes)}
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


def limit_inflight(gm: fx.GraphModule, *, max_inflight_bytes: int | None) -> fx.GraphModule:
    """Wait on the oldest collectives early so in-flight bytes stay within the budget."""
    if max_inflight_bytes is None:
        return gm
    graph = gm.graph
    changed = False
    outstanding: dict[fx.Node, int] = {}
    for n in list(graph.nodes):
        if C.is_wait(n):
            outstanding.pop(C.collective_of(n), None)
        elif C.is_collective(n):
            need = C.bytes_of(n)
            while outstanding and sum(outstanding.values()) + need > max_inflight_bytes:
                oldest = next(iter(outstanding))
                for w in C.waits_of(oldest):
                    if w.args[0] is not oldest:  # coalesced: wait(getitem(coll, i))
                        n.prepend(w.args[0])
                    n.prepend(w)
                del outstanding[oldest]
                changed = True
            outstanding[n] = need
    if not changed:
        return gm
    graph.lint()
    gm.recompile()
    return gm
