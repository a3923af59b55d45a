"""Overlap tensor-parallel collectives with their matmuls: gather and scatter in batch chunks.

A sequence-parallel region begins with an all-gather of the activations on the
tensor-parallel group and ends with a reduce-scatter. The matmul after the gather needs all
of it, and the reduce-scatter needs all of the matmul before it, so each collective sits on
the critical path with nothing to hide behind (at 70B on 8 GPUs, four of them per layer and
pass, ~2.6 ms each). torchtitan's asynchronous TP hides them by decomposing the pair; this
pass does the same on the graph, with ordinary functional collectives, by cutting the local
batch (dim 0 of the activation, the sequences a rank holds) into ``chunks`` pieces:

    gather -> matmul:   x                      x[0:b]        x[b:2b] ...
                        ag = all_gather(x)     ag_0 = ag(.)  ag_1 = ag(.)  ...   (all issued)
                        g = cat(split(ag), 1)  g_0 = ...     wait, mm_0 runs while ag_1.. fly
                        y = mm(view(g), W)     y = cat([mm(view(g_0), W), mm(view(g_1), W), ...])

    matmul -> scatter:  p = mm(view(x), W)     for each chunk: mm, its reduce-scatter issued;
                        rs = reduce_scatter(   chunk i+1's matmul runs while chunk i's scatter
                          cat(split(p, s, 1)))   flies;   y = cat([wait(rs_0), wait(rs_1), ...])

Batch chunks keep every row where it was: the gathered activation ``[B, S, H]`` is the
concatenation along dim 0 of the chunks' gathered ``[b, S, H]``, and a matmul's rows are
independent, so the result is the same product cut into row blocks (the same values; the
matmul kernel may pick another blocking for fewer rows, so the last bit can differ, as between
any two batch sizes). A reader of the whole gathered activation other than a matmul's left
operand (a weight gradient's ``t(g) @ dy``, a saved activation) gets the chunks concatenated.

Invariant (checked after the pass by ``passes.invariants``): each chunk's collective is
waited before its first reader, and the collectives every rank issues are a deterministic
function of the graph, in graph order, so every rank issues the same sequence.

What it matches (the lowering of a sequence-sharded activation into a column-parallel
matmul, and of a row-parallel matmul's output back to the sequence): an all-gather on dim 0
whose only reader splits it into its ranks' pieces and concatenates them on a later dim, read
by 2-D views that are the left operand of ``mm``; and a reduce-scatter of such a
concatenation of a matmul's output. Anything else is left alone. Needs the local batch
divisible into at least two chunks (one sequence per rank: untouched).

Where: after bucketing (which would merge the chunks' adjacent collectives back into one),
before ``sink_waits`` (which then places every wait at its first reader).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from passes import collectives as C
from passes.meta import ROLE, Role

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_VIEWS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default)
_SLICE = _aten.slice.Tensor
_SPLIT = _aten.split.Tensor
_CAT = _aten.cat.default
_MM = _aten.mm.default


def _val(n: Any) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _call(graph: fx.Graph, target: Any, args: tuple, like: fx.Node, role: Role | None = None) -> fx.Node:
    """``target(*args)`` at the insert point, valued on the arguments' meta values, with the
    metadata (phase, module, remat tag, ...) of ``like``."""
    node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta", "stack_trace")})
    node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
    if role is not None:
        node.meta[ROLE] = role
    return node


def _collective(graph: fx.Graph, target: Any, args: tuple, shape: list[int], like: fx.Node) -> fx.Node:
    """A functional collective (its value: an empty tensor of ``shape``, as the emitters make)."""
    node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta", "stack_trace")})
    node.meta["val"] = args[0].meta["val"].new_empty(shape)
    node.meta[ROLE] = Role.COMM
    return node


def _split_pieces(split: fx.Node, pieces: int) -> list[fx.Node] | None:
    """The getitems of ``split`` in index order, if they are exactly ``pieces`` and all read by
    one ``cat`` in that order; else None."""
    items: dict[int, fx.Node] = {}
    for u in split.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[1] in items:
            return None
        items[int(u.args[1])] = u  # type: ignore[arg-type]
    if sorted(items) != list(range(pieces)):
        return None
    ordered = [items[i] for i in range(pieces)]
    cats = {u for g in ordered for u in g.users}
    if len(cats) != 1 or any(len(g.users) != 1 for g in ordered):
        return None
    cat = next(iter(cats))
    if cat.target is not _CAT or list(cat.args[0]) != ordered:  # type: ignore[arg-type]
        return None
    return ordered


def _cat_dim(cat: fx.Node) -> int:
    d = int(cat.args[1]) if len(cat.args) > 1 else int(cat.kwargs.get("dim", 0))  # type: ignore[arg-type]
    v = _val(cat)
    return d % v.dim() if v is not None and v.dim() else d


def _is_full_slice(n: fx.Node) -> bool:
    if n.target is not _SLICE or len(n.args) < 2:
        return False
    v, src = _val(n), _val(n.args[0])
    return v is not None and src is not None and v.shape == src.shape


def _chunks_of(batch: int, chunks: int) -> int:
    """The most chunks (at most ``chunks``) that divide ``batch`` evenly; 1 if none."""
    return max((k for k in range(2, min(chunks, batch) + 1) if batch % k == 0), default=1)


# ----------------------------------------------------------------------------- gather -> matmul


@dataclasses.dataclass
class _Gather:
    coll: fx.Node
    wait: fx.Node
    split: fx.Node
    items: list[fx.Node]
    cat: fx.Node
    aliases: list[fx.Node]  # full slices of the cat (the same value)
    mm_views: list[tuple[fx.Node, fx.Node, list[fx.Node]]]  # (alias read, 2-D view, its mm readers)
    others: list[tuple[fx.Node, fx.Node]]  # (reader, the alias it reads)


def _gather_site(coll: fx.Node) -> _Gather | None:
    if C.is_coalesced(coll) or C.kind_of(coll) is not C.Kind.ALL_GATHER:
        return None
    x, world = coll.args[0], int(coll.args[1])  # type: ignore[arg-type]
    xv = _val(x)
    if xv is None or xv.dim() < 2 or len(coll.users) != 1:
        return None
    wait = next(iter(coll.users))
    if not C.is_wait(wait) or len(wait.users) != 1:
        return None
    split = next(iter(wait.users))
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if split.target is not _SPLIT or split.args[0] is not wait or split.args[1] != xv.shape[0] or dim != 0:
        return None
    items = _split_pieces(split, world)
    if items is None:
        return None
    cat = next(iter(items[0].users))
    if _cat_dim(cat) == 0:
        return None
    site = _Gather(coll, wait, split, items, cat, [], [], [])
    gv = _val(cat)
    assert gv is not None
    rows = math.prod(gv.shape[:-1])
    stack = [cat]
    while stack:
        node = stack.pop()
        for u in node.users:
            if _is_full_slice(u):
                site.aliases.append(u)
                stack.append(u)
            elif (
                u.target in _VIEWS
                and list(u.args[1]) == [rows, gv.shape[-1]]  # type: ignore[arg-type]
                and u.users
                and all(m.target is _MM and m.args[0] is u and m.args[1] is not u for m in u.users)
            ):
                site.mm_views.append((node, u, sorted(u.users)))
            else:
                site.others.append((u, node))
    return site if site.mm_views else None


def _rewrite_gather(graph: fx.Graph, s: _Gather, k: int) -> None:
    x, world, group = s.coll.args[0], s.coll.args[1], s.coll.args[2]
    xv, gv = _val(x), _val(s.cat)
    assert isinstance(x, fx.Node) and xv is not None and gv is not None
    b = xv.shape[0] // k
    rows, cols = b * math.prod(gv.shape[1:-1]), gv.shape[-1]
    cat_dim = _cat_dim(s.cat)
    colls = []
    with graph.inserting_before(s.coll):
        for c in range(k):
            piece = _call(graph, _SLICE, (x, 0, c * b, (c + 1) * b), x)
            shape = [b * int(world), *xv.shape[1:]]  # type: ignore[call-overload]
            colls.append(_collective(graph, s.coll.target, (piece, world, group), shape, s.coll))
    gathered: list[fx.Node] = []

    def gather(c: int) -> fx.Node:
        """Chunk ``c``'s gathered activation ``[b, S, H]`` (its wait and rearrangement)."""
        wait = _collective(graph, C.WAIT, (colls[c],), list(colls[c].meta["val"].shape), s.wait)
        split = _call(graph, _SPLIT, (wait, b), s.split)
        items = [_call(graph, operator.getitem, (split, i), s.items[i]) for i in range(len(s.items))]
        return _call(graph, _CAT, (items, cat_dim), s.cat)

    def chunk_mm(c: int, mm: fx.Node, view: fx.Node) -> fx.Node:
        v = _call(graph, view.target, (gathered[c], [rows, cols]), view)
        return _call(graph, _MM, (v, mm.args[1]), mm)

    mms = sorted(m for _, _, ms in s.mm_views for m in ms)
    view_of = {m: view for _, view, ms in s.mm_views for m in ms}
    first_other = min((u for u, _ in s.others), default=None)
    parts: dict[fx.Node, list[fx.Node]] = {}
    if first_other is None or mms[0] < first_other:
        # Interleaved at the first matmul: chunk c's wait just before its own matmul.
        with graph.inserting_before(mms[0]):
            for c in range(k):
                gathered.append(gather(c))
                parts.setdefault(mms[0], []).append(chunk_mm(c, mms[0], view_of[mms[0]]))
    else:
        with graph.inserting_before(first_other):
            gathered.extend(gather(c) for c in range(k))
    for mm in mms:
        with graph.inserting_before(mm):
            if mm not in parts:
                parts[mm] = [chunk_mm(c, mm, view_of[mm]) for c in range(k)]
            mm.replace_all_uses_with(_call(graph, _CAT, (parts[mm], 0), mm))
    if s.others:
        assert first_other is not None
        with graph.inserting_before(first_other):
            whole = _call(graph, _CAT, (gathered, 0), s.cat)
        for reader, alias in s.others:
            reader.replace_input_with(alias, whole)
    dead = [s.coll, s.wait, s.split, *s.items, s.cat, *s.aliases, *dict.fromkeys(view_of.values()), *mms]
    for n in reversed(dead):
        if not n.users:
            graph.erase_node(n)


# ----------------------------------------------------------------------------- matmul -> scatter


@dataclasses.dataclass
class _Scatter:
    coll: fx.Node
    wait: fx.Node
    x: fx.Node  # the matmul's left operand before its 2-D view, [B, ..., K]
    view: fx.Node
    mm: fx.Node
    out_view: fx.Node  # the matmul's output viewed [B, S, H]
    split: fx.Node
    items: list[fx.Node]
    cat: fx.Node


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _scatter_site(coll: fx.Node) -> _Scatter | None:
    if C.is_coalesced(coll) or C.kind_of(coll) is not C.Kind.REDUCE_SCATTER or len(coll.users) != 1:
        return None
    wait, cat, world = next(iter(coll.users)), coll.args[0], int(coll.args[2])  # type: ignore[arg-type]
    if not C.is_wait(wait) or not isinstance(cat, fx.Node) or cat.target is not _CAT or _cat_dim(cat) != 0:
        return None
    if len(cat.users) != 1 or not cat.args[0]:
        return None
    split = cat.args[0][0].args[0]  # type: ignore[index, union-attr]
    if not isinstance(split, fx.Node) or split.target is not _SPLIT or _split_pieces(split, world) is None:
        return None
    sdim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    out_view = split.args[0]
    if not isinstance(out_view, fx.Node) or out_view.target not in _VIEWS or _only_user(out_view) is not split:
        return None
    mm = out_view.args[0]
    if not isinstance(mm, fx.Node) or mm.target is not _MM or _only_user(mm) is not out_view:
        return None
    view = mm.args[0]
    if not isinstance(view, fx.Node) or view.target not in _VIEWS or not isinstance(view.args[0], fx.Node):
        return None
    x, xv, ov = view.args[0], _val(view.args[0]), _val(out_view)
    if xv is None or ov is None or ov.dim() < 2 or xv.shape[0] != ov.shape[0] or sdim in (0, -ov.dim()):
        return None
    items = _split_pieces(split, world)
    assert items is not None
    return _Scatter(coll, wait, x, view, mm, out_view, split, items, cat)


def _rewrite_scatter(graph: fx.Graph, s: _Scatter, k: int) -> None:
    xv, ov, mv = _val(s.x), _val(s.out_view), _val(s.mm)
    assert xv is not None and ov is not None and mv is not None
    b = xv.shape[0] // k
    rows = mv.shape[0] // k
    reduce_op, world, group = s.coll.args[1], s.coll.args[2], s.coll.args[3]
    sdim = s.split.args[2] if len(s.split.args) > 2 else s.split.kwargs.get("dim", 0)
    waits = []
    colls = []
    with graph.inserting_before(s.coll):
        for c in range(k):
            piece = _call(graph, _SLICE, (s.x, 0, c * b, (c + 1) * b), s.x)
            v = _call(graph, s.view.target, (piece, [rows, *list(s.view.args[1])[1:]]), s.view)  # type: ignore[arg-type]
            mm = _call(graph, _MM, (v, s.mm.args[1]), s.mm)
            out = _call(graph, s.out_view.target, (mm, [b, *list(s.out_view.args[1])[1:]]), s.out_view)  # type: ignore[arg-type]
            split = _call(graph, _SPLIT, (out, s.split.args[1], sdim), s.split)
            items = [_call(graph, operator.getitem, (split, i), s.items[i]) for i in range(len(s.items))]
            cat = _call(graph, _CAT, (items, 0), s.cat)
            shape = [b, *ov.shape[1:]]
            shape[int(sdim) % ov.dim()] = ov.shape[int(sdim) % ov.dim()] // int(world)  # type: ignore[call-overload]
            colls.append(_collective(graph, s.coll.target, (cat, reduce_op, world, group), shape, s.coll))
    with graph.inserting_before(s.wait):
        for coll in colls:
            waits.append(_collective(graph, C.WAIT, (coll,), list(coll.meta["val"].shape), s.wait))
        whole = _call(graph, _CAT, (waits, 0), s.wait, role=Role.COMM)
    s.wait.replace_all_uses_with(whole)
    for n in (s.wait, s.coll, s.cat, *reversed(s.items), s.split, s.out_view, s.mm, s.view):
        if not n.users:
            graph.erase_node(n)


def pipeline_tp_collectives(gm: fx.GraphModule, *, chunks: int = 4) -> fx.GraphModule:
    """Cut every matching gather -> matmul and matmul -> scatter pair into batch chunks (at
    most ``chunks``; the most that divide the local batch). No-op with ``chunks < 2`` or no
    match."""
    if chunks < 2:
        return gm
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.graph is not graph or not C.is_collective(node):
            continue
        if (g := _gather_site(node)) is not None:
            xv = _val(g.coll.args[0])
            assert xv is not None
            if (k := _chunks_of(xv.shape[0], chunks)) > 1:
                _rewrite_gather(graph, g, k)
                changed = True
        elif (r := _scatter_site(node)) is not None:
            xv = _val(r.x)
            assert xv is not None
            if (k := _chunks_of(xv.shape[0], chunks)) > 1:
                _rewrite_scatter(graph, r, k)
                changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
