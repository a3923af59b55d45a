"""The last step of :func:`spmd.parallel.expand_graph.expand_graph`: the expanded graph's nodes
take the traced nodes' names (placeholders) and metadata (roles, phases, modules, placements),
and a gradient that arrives through a collective lets the collective's wait stand for its tag;
``drop_dead_compute`` removes the unread calls DTensor's propagation leaves. ``describe_placements``
is the placements' wording the dump prints.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Shard

from passes import collectives as C
from passes import torch_compat
from passes.meta import (
    CAST_OF,
    GRAD_OF,
    MICROBATCH,
    MODULE,
    NODE_PLACEMENTS,
    PHASE,
    PLACEMENT,
    ROLE,
    STATE_NAME,
    Role,
)
from passes.ops import TAG_GRAD

# On every node of the expanded graph: the placements of the traced node it computes
# (a tuple of Placements, a list of them for multi-output ops, or None for non-tensors).
EXPAND_PLACEMENTS = NODE_PLACEMENTS
_SRC = "spmd_expand_src"  # the traced node a new node was recorded for (in meta["custom"])
_CUSTOM = "custom"


def describe_placements(pl: Any) -> str:
    """``(Replicate(), Shard(0))``; ``[..., ...]`` for several outputs; ``-`` for a non-tensor."""
    if pl is None:
        return "-"
    if isinstance(pl, str):
        return pl
    if isinstance(pl, list):
        return "[" + ", ".join(describe_placements(p) for p in pl) + "]"
    return "(" + ", ".join(_word(p) for p in pl) + ")"


def _word(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    return f"{type(p).__name__}()"


_COPIED = (ROLE, PHASE, MODULE, MICROBATCH, GRAD_OF, CAST_OF)


def finish(
    gm: fx.GraphModule,
    old: dict[str, fx.Node],
    old_placeholders: list[fx.Node],
    placements: dict[str, Any],
    in_specs: list[Any],
    *,
    strip_tags: bool = True,
) -> None:
    """Give the expanded graph's nodes the traced nodes' names (placeholders) and metadata."""
    graph = gm.graph
    new_ph = [n for n in graph.nodes if n.op == "placeholder"]
    for n, o, pl in zip(new_ph, old_placeholders, in_specs):
        torch_compat.rename_node(n, o.name)
        n.target = n.name
        for k in (*_COPIED, STATE_NAME):
            if k in o.meta:
                n.meta[k] = o.meta[k]
        n.meta[EXPAND_PLACEMENTS] = pl
        if o.meta.get(ROLE) is Role.PARAM:
            n.meta[PLACEMENT] = describe_placements(pl)
    last: fx.Node | None = None
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            if n.op == "output" and last is not None:
                n.meta.update({k: last.meta[k] for k in _COPIED if k in last.meta})
                n.meta[ROLE] = Role.ACTIVATION
            continue
        src_name = (n.meta.get(_CUSTOM) or {}).pop(_SRC, None)
        src = old.get(src_name) if src_name else None
        if src is None:
            # No traced origin (none expected): the metadata of what it reads, else of the node before.
            src = next((i for i in n.all_input_nodes if ROLE in i.meta), last)
        if src is not None:
            for k in _COPIED:
                if k in src.meta:
                    n.meta[k] = src.meta[k]
                else:
                    n.meta.pop(k, None)
            n.meta[EXPAND_PLACEMENTS] = placements.get(src.name)
        if C.is_collective(n) or C.is_wait(n):
            n.meta[ROLE] = Role.COMM
            n.meta.pop(GRAD_OF, None)
        elif src is not None and src.meta.get(ROLE) is Role.GRAD and n.target is not TAG_GRAD:
            # The redistribution's own ops (reshapes of a gradient around a collective).
            n.meta[ROLE] = Role.COMM
            n.meta.pop(GRAD_OF, None)
        if not (n.meta.get(_CUSTOM) or {}):
            n.meta.pop(_CUSTOM, None)
        last = n
    if strip_tags:
        _strip_reduced_tags(graph)
    _drop_none_getitems(graph)
    graph.lint()
    gm.recompile()


def _drop_none_getitems(graph: fx.Graph) -> None:
    """Erase unused ``getitem``s of an output that is None (``convolution_backward``'s input
    gradient of a first layer): DTensor's unwrapping records them, and they carry no value."""
    import operator

    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not operator.getitem or n.users:
            continue
        src, i = n.args
        vals = src.meta.get("val") if isinstance(src, fx.Node) else None
        if isinstance(vals, list | tuple) and isinstance(i, int) and i < len(vals) and vals[i] is None:
            graph.erase_node(n)


def _strip_reduced_tags(graph: fx.Graph) -> None:
    """Drop the tag of every gradient that arrives through a collective: its wait becomes the gradient.

    As ``DataParallel`` does: the wait's result is a fresh tensor only the tag reads, so the tag
    (a copy) is not needed, and without a reader right after each wait the gradients' collectives
    are adjacent for :func:`passes.bucketing.bucket_collectives`. Tags of gradients that need no
    communication stay for ``strip_grad_tags``.
    """
    for n in [n for n in graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]:
        w = n.args[0]
        if not (isinstance(w, fx.Node) and C.is_wait(w) and len(w.users) == 1):
            continue
        for k in [k for k in n.meta if k.startswith("spmd_")]:
            w.meta[k] = n.meta[k]
        n.replace_all_uses_with(w)
        graph.erase_node(n)


def drop_dead_compute(graph: fx.Graph) -> None:
    """Remove pure aten ops whose results nothing reads (last to first). DTensor's sharding
    propagation on torch 2.11/2.12 runs some ops (embedding) once more on empty stand-ins while
    it is traced, leaving unused calls on uninitialised tensors (out-of-range indices at run
    time). Collectives, waits, random ops and ops that write an input stay, whether read or not."""
    for n in reversed(list(graph.nodes)):
        if n.op != "call_function" or n.users or C.is_collective(n) or C.is_wait(n):
            continue
        if n.target is not operator.getitem and (
            not isinstance(n.target, torch_compat.OpOverload)
            or torch_compat.op_schema(n.target).is_mutable
            or torch.Tag.nondeterministic_seeded in n.target.tags  # draws advance the generator
        ):
            continue
        graph.erase_node(n)
