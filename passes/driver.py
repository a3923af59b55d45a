"""Run an ordered list of named passes, with the bookkeeping done once, here.

Every pass is a plain ``GraphModule -> GraphModule`` function. The driver:
asserts it returned a GraphModule; re-raises a failure naming the pass and the
ones that ran before it; logs time and node-count change; hands the graph after
every pass to ``record`` under the pass's name (a :class:`passes.stages.Stages`
keeps a cheap copy of it); and, when asked, runs the invariant checker after
every pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import torch.fx as fx

from passes.stages import copy_graph, rebuilt

log = logging.getLogger("spmd.passes")

GraphPass = Callable[[fx.GraphModule], fx.GraphModule]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NamedPass:
    name: str
    fn: GraphPass
    reason: str = ""  # why it sits where it does in the list


class PassFailure(RuntimeError):
    """A pass raised or returned something other than a GraphModule."""

    def __init__(self, name: str, ran_before: list[str], cause: BaseException | str):
        before = ", ".join(ran_before) or "none"
        super().__init__(f"graph pass {name!r} failed (passes run before it: {before}): {cause}")
        self.pass_name = name
        self.ran_before = ran_before


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """An independent copy of ``gm``'s graph (node meta copied shallowly; tensors shared)."""
    return rebuilt(gm, copy_graph(gm.graph))


def run_passes(
    gm: fx.GraphModule,
    passes: Iterable[NamedPass],
    *,
    disabled: Iterable[str] = (),
    check: Callable[[fx.GraphModule, str], None] | None = None,
    record: Callable[[str, fx.GraphModule], None] | None = None,
) -> fx.GraphModule:
    """Apply ``passes`` in order, skipping the names in ``disabled``.

    ``record(name, gm)`` gets the live graph after each pass; later passes change it in
    place, so it must copy what it keeps (``Stages.record`` does, cheaply).
    """
    disabled = set(disabled)
    ran: list[str] = []
    for p in passes:
        if p.name in disabled:
            log.info("pass %s disabled", p.name)
            continue
        before = len(gm.graph.nodes)
        t0 = time.perf_counter()
        try:
            out = p.fn(gm)
        except Exception as exc:
            raise PassFailure(p.name, ran, exc) from exc
        if not isinstance(out, fx.GraphModule):
            raise PassFailure(p.name, ran, f"returned {type(out).__name__}, expected a GraphModule")
        gm = out
        if check is not None:
            try:
                check(gm, p.name)
            except Exception as exc:
                raise PassFailure(p.name, ran, exc) from exc
        log.info(
            "pass %-24s %7.1f ms  nodes %d -> %d",
            p.name,
            (time.perf_counter() - t0) * 1e3,
            before,
            len(gm.graph.nodes),
        )
        ran.append(p.name)
        if record is not None:
            record(p.name, gm)
    return gm
