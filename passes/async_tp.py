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
from passes import torch_compat
from passes.flat_ops import COPY_OUT
from passes.graph_utils import PASS_THROUGH_OPS
from passes.meta import ASYNC_TP_CHUNK, ROLE, Role

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_VIEWS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default)
_SLICE = _aten.slice.Tensor
_SPLIT = _aten.split.Tensor
_CAT = _aten.cat.default
_MM = _aten.mm.default
_ALIASING = PASS_THROUGH_OPS - {_aten.clone.default, _aten._to_copy.default, COPY_OUT}
_HOISTABLE = {
    _aten.t.default,
    _aten.view.default,
    _aten.transpose.int,
    _aten.permute.default,
    _aten.detach.default,
}


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


def _refresh_views(node: fx.Node) -> None:
    """Recompute the values of the views reading ``node`` (transitively) after ``node`` took the
    place of another value: they alias ``node``'s storage now, which the cost model and the
    memory estimate read."""
    stack = [node]
    while stack:
        for u in stack.pop().users:
            if u.op == "call_function" and u.target in _ALIASING:
                target: Any = u.target
                u.meta["val"] = target(*fx.node.map_arg(u.args, lambda a: a.meta["val"]), **u.kwargs)
                stack.append(u)


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


def _hoist(node: Any, before: fx.Node, depth: int = 4) -> bool:
    """Make ``node`` come before ``before``: already there, or a view (``t``, ``view``, ...) whose
    inputs can be, moved up (a view aliases; computing it earlier reads nothing sooner)."""
    if not isinstance(node, fx.Node) or node < before:
        return True
    if depth == 0 or node.op != "call_function" or node.target not in _HOISTABLE:
        return False
    if not all(_hoist(i, before, depth - 1) for i in node.all_input_nodes):
        return False
    before.prepend(node)
    return True


def _movable(n: fx.Node) -> bool:
    """Whether ``n`` computes a value and nothing else: moving it changes no collective order,
    no random stream and no write."""
    if n.op != "call_function" or C.is_collective(n) or C.is_wait(n) or n.is_impure():
        return False
    if n.target is operator.getitem:
        return True
    if not isinstance(n.target, torch_compat.OpOverload):
        return False
    tags = getattr(n.target, "tags", ())
    return not torch_compat.op_schema(n.target).is_mutable and torch.Tag.nondeterministic_seeded not in tags


def _chunks_of(batch: int, chunks: int, nbytes: int, min_bytes: int) -> int:
    """The most chunks (at most ``chunks``) that divide ``batch`` evenly and each move at least
    ``min_bytes`` of the collective's ``nbytes``; 1 if none."""
    fit = [k for k in range(2, min(chunks, batch) + 1) if batch % k == 0 and nbytes // k >= min_bytes]
    return max(fit, default=1)


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
                and (mms := [m for m in u.users if m.target is _MM and m.args[0] is u and m.args[1] is not u])
            ):
                site.mm_views.append((node, u, sorted(mms)))
                # The view's other readers (a weight gradient's ``t(g)``) read the whole.
                site.others.extend((r, u) for r in u.users if r not in mms)
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
            shape = [b * int(world), *xv.shape[1:]]  # type: ignore[call-overload, arg-type]
            colls.append(_collective(graph, s.coll.target, (piece, world, group), shape, s.coll))
            colls[-1].meta[ASYNC_TP_CHUNK] = (c, k)
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
    anchor = mms[0] if first_other is None else min(mms[0], first_other)
    # Interleaved at the first reader: chunk c's wait just before its own matmul. When another
    # reader comes first (backward: the weight gradient before the input gradient), the first
    # matmul's right operand is brought up to it if it is a view of something already there.
    lead = mms[0] if anchor is mms[0] or _hoist(mms[0].args[1], anchor) else None
    with graph.inserting_before(anchor):
        for c in range(k):
            gathered.append(gather(c))
            if lead is not None:
                parts.setdefault(lead, []).append(chunk_mm(c, lead, view_of[lead]))
    for mm in mms:
        with graph.inserting_before(mm):
            if mm not in parts:
                parts[mm] = [chunk_mm(c, mm, view_of[mm]) for c in range(k)]
            full = _call(graph, _CAT, (parts[mm], 0), mm)
            mm.replace_all_uses_with(full)
            _refresh_views(full)
    if s.others:
        assert first_other is not None
        with graph.inserting_before(first_other):
            whole = _call(graph, _CAT, (gathered, 0), s.cat)
        views: dict[fx.Node, fx.Node] = {}
        for reader, read in s.others:
            if read in view_of.values():  # a 2-D view of the gathered activation
                if read not in views:
                    with graph.inserting_before(first_other):
                        views[read] = _call(graph, read.target, (whole, read.args[1]), read)
                reader.replace_input_with(read, views[read])
            else:
                reader.replace_input_with(read, whole)
    dead = [s.coll, s.wait, s.split, *s.items, s.cat, *s.aliases, *dict.fromkeys(view_of.values()), *mms]
    for n in reversed(dead):
        if not n.users:
            graph.erase_node(n)


# ----------------------------------------------------------------------------- matmul -> scatter


@dataclasses.dataclass
class _Term:
    """``view(mm(view(x, [rows, K]), w), [B, ...])``: one matmul's output, rows by batch."""

    x: fx.Node
    view: fx.Node
    mm: fx.Node
    out_view: fx.Node


@dataclasses.dataclass
class _Scatter:
    coll: fx.Node
    wait: fx.Node
    value: fx.Node  # the sum of the terms, [B, S, H]
    tree: Any  # the sum's shape: a _Term, or (add node, left tree, right tree)
    terms: list[_Term]
    split: fx.Node
    items: list[fx.Node]
    cat: fx.Node


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _term(v: fx.Node, batch: int) -> _Term | None:
    mm = v.args[0] if v.target in _VIEWS else None
    if not isinstance(mm, fx.Node) or mm.target is not _MM or _only_user(mm) is not v:
        return None
    view = mm.args[0]
    if not isinstance(view, fx.Node) or view.target not in _VIEWS or not isinstance(view.args[0], fx.Node):
        return None
    xv, ov = _val(view.args[0]), _val(v)
    if xv is None or ov is None or xv.shape[0] != batch or ov.shape[0] != batch:
        return None
    return _Term(view.args[0], view, mm, v)


def _sum_tree(v: fx.Node, batch: int, terms: list[_Term]) -> Any:
    """``v`` as a sum of matmul terms (autograd's sum of the input gradients of the matmuls that
    read one activation), or None."""
    if v.target is _aten.add.Tensor and len(v.args) == 2 and not v.kwargs:
        parts = []
        for a in v.args:
            if not isinstance(a, fx.Node) or _only_user(a) is not v:
                return None
            if (t := _sum_tree(a, batch, terms)) is None:
                return None
            parts.append(t)
        return (v, *parts)
    if (term := _term(v, batch)) is None:
        return None
    terms.append(term)
    return term


def _scatter_site(coll: fx.Node) -> _Scatter | None:
    if C.is_coalesced(coll) or C.kind_of(coll) is not C.Kind.REDUCE_SCATTER or len(coll.users) != 1:
        return None
    wait, cat, world = next(iter(coll.users)), coll.args[0], int(coll.args[2])  # type: ignore[arg-type]
    if not C.is_wait(wait) or not isinstance(cat, fx.Node) or cat.target is not _CAT or _cat_dim(cat) != 0:
        return None
    if len(cat.users) != 1 or not cat.args[0] or not isinstance(cat.args[0][0], fx.Node):  # type: ignore[index]
        return None
    split = cat.args[0][0].args[0]  # type: ignore[index, union-attr]
    if not isinstance(split, fx.Node) or split.target is not _SPLIT:
        return None
    items = _split_pieces(split, world)
    value = split.args[0]
    sdim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if items is None or not isinstance(value, fx.Node) or _only_user(value) is not split:
        return None
    vv = _val(value)
    if vv is None or vv.dim() < 2 or int(sdim) % vv.dim() == 0:  # type: ignore[call-overload, arg-type]
        return None
    terms: list[_Term] = []
    tree = _sum_tree(value, vv.shape[0], terms)
    if tree is None:
        return None
    return _Scatter(coll, wait, value, tree, terms, split, items, cat)


def _ancestors(nodes: list[fx.Node], since: fx.Node) -> set[fx.Node]:
    """``nodes`` and what they read, transitively, at or after ``since``."""
    seen: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen or n < since:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _rewrite_scatter(graph: fx.Graph, s: _Scatter, k: int) -> None:
    vv = _val(s.value)
    assert vv is not None
    b = vv.shape[0] // k
    reduce_op, world, group = s.coll.args[1], s.coll.args[2], s.coll.args[3]
    sdim = int(s.split.args[2] if len(s.split.args) > 2 else s.split.kwargs.get("dim", 0))  # type: ignore[call-overload, arg-type]
    first = min(t.mm for t in s.terms)
    last = max(t.mm for t in s.terms)
    # Work between the first and the last term that the chunks do not read (the weight
    # gradients' matmuls) moves after the chunks' scatters, to run while they are in flight.
    reads = _ancestors([n for t in s.terms for n in (t.x, t.mm.args[1]) if isinstance(n, fx.Node)], first)
    between = []
    n = first.next
    while n is not last:
        between.append(n)
        n = n.next
    if any(not _movable(n) for n in between if n not in reads):
        between = []  # something there writes or communicates: leave the order alone

    def chunk_term(t: _Term, c: int) -> fx.Node:
        piece = _call(graph, _SLICE, (t.x, 0, c * b, (c + 1) * b), t.x)
        rows = _val(t.mm).shape[0] // k  # type: ignore[union-attr]
        v = _call(graph, t.view.target, (piece, [rows, *list(t.view.args[1])[1:]]), t.view)  # type: ignore[arg-type]
        mm = _call(graph, _MM, (v, t.mm.args[1]), t.mm)
        return _call(graph, _aten.view.default, (mm, [b, *list(t.out_view.args[1])[1:]]), t.out_view)  # type: ignore[arg-type]

    def chunk_sum(tree: Any, c: int) -> fx.Node:
        if isinstance(tree, _Term):
            return chunk_term(tree, c)
        add, left, right = tree
        return _call(graph, _aten.add.Tensor, (chunk_sum(left, c), chunk_sum(right, c)), add)

    colls = []
    with graph.inserting_before(last):
        for c in range(k):
            value = chunk_sum(s.tree, c)
            split = _call(graph, _SPLIT, (value, s.split.args[1], sdim), s.split)
            items = [_call(graph, operator.getitem, (split, i), s.items[i]) for i in range(len(s.items))]
            cat = _call(graph, _CAT, (items, 0), s.cat)
            shape = [b, *vv.shape[1:]]
            shape[sdim % vv.dim()] = vv.shape[sdim % vv.dim()] // int(world)  # type: ignore[call-overload, arg-type]
            colls.append(_collective(graph, s.coll.target, (cat, reduce_op, world, group), shape, s.coll))
            colls[-1].meta[ASYNC_TP_CHUNK] = (c, k)
    for n in between:
        if n not in reads:
            last.prepend(n)
    with graph.inserting_before(s.wait):
        waits = [_collective(graph, C.WAIT, (c,), list(c.meta["val"].shape), s.wait) for c in colls]
        whole = _call(graph, _CAT, (waits, 0), s.wait, role=Role.COMM)
    s.wait.replace_all_uses_with(whole)
    _refresh_views(whole)
    dead = [s.wait, s.coll, s.cat, *reversed(s.items), s.split]
    stack = [s.tree]
    while stack:
        t = stack.pop()
        if isinstance(t, _Term):
            dead.extend([t.out_view, t.mm, t.view])
        else:
            dead.append(t[0])
            stack.extend(t[1:])
    for n in dead:
        if not n.users:
            graph.erase_node(n)


def pipeline_tp_collectives(
    gm: fx.GraphModule, *, chunks: int = 4, min_chunk_bytes: int = 0
) -> fx.GraphModule:
    """Cut every matching gather -> matmul and matmul -> scatter pair into batch chunks: the
    most, up to ``chunks``, that divide the local batch and each send at least
    ``min_chunk_bytes`` (a smaller collective pays its latency, ring steps x the link's,
    for little bandwidth). No-op with ``chunks < 2`` or no match."""
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
            if (k := _chunks_of(xv.shape[0], chunks, C.bytes_of(node), min_chunk_bytes)) > 1:
                _rewrite_gather(graph, g, k)
                changed = True
        elif (r := _scatter_site(node)) is not None:
            xv = _val(r.value)
            assert xv is not None
            if (k := _chunks_of(xv.shape[0], chunks, C.bytes_of(node), min_chunk_bytes)) > 1:
                _rewrite_scatter(graph, r, k)
                changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
