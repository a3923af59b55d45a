"""Bucket runs of adjacent collectives into one collective on a flat buffer.

One collective per parameter pays the per-call latency hundreds of times a step;
DDP and FSDP send buckets instead. This pass does the same on the graph: a run of
collectives that are adjacent in the collective order and agree on kind, group,
group size, reduce op, dtype, phase and micro-batch becomes one collective on their
concatenation, and each member's result is cut back out of it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.flat_ops import COPY_IN, COPY_OUT
from passes.graph_utils import PASS_THROUGH_OPS, storage_of, written_storages
from passes.meta import MICROBATCH, MODULE, PHASE, ROLE, Phase, Role, module_of
from passes.units import UNIT

_aten = torch.ops.aten

_BUCKETABLE = (C.Kind.ALL_REDUCE, C.Kind.ALL_GATHER, C.Kind.REDUCE_SCATTER)
MODES = ("size", "module")


def module_prefix(depth: int) -> Callable[[fx.Node], str]:
    """A ``unit_of`` for ``mode="module"``: the first ``depth`` components of the node's module path.

    ``module_prefix(2)`` maps ``layers.3.attn.qkv`` to ``layers.3`` (one transformer block,
    the usual FSDP unit) and ``tok_emb`` to ``tok_emb``.
    """
    if depth < 1:
        raise ValueError(f"module_prefix: depth must be >= 1, got {depth}")

    def unit_of(node: fx.Node) -> str:
        return ".".join(module_of(node).split(".")[:depth])

    return unit_of


def bucket_collectives(
    gm: fx.GraphModule,
    *,
    bucket_cap_mb: float = 25.0,
    mode: str = "size",
    unit_of: Callable[[fx.Node], str] | None = None,
) -> fx.GraphModule:
    """Merge runs of adjacent, compatible collectives into one collective each.

    Args:
        bucket_cap_mb: ``mode="size"``: a bucket closes before it would exceed this many MiB
            (counted as :func:`passes.collectives.bytes_of`: an all-gather's output, a
            reduce-scatter's input). A single collective larger than the cap is its own bucket.
        mode: ``"size"`` fills buckets up to the cap, like DDP. ``"module"`` makes one bucket per
            unit, like FSDP: collectives of different units never share a bucket, and the cap
            does not apply (a unit is communicated whole).
        unit_of: ``mode="module"``: the unit a collective belongs to (default
            ``module_prefix(2)``, applied to the collective's module path). A function rather
            than a depth so a partitioner that knows its units (a list of wrapped module paths)
            can pass them exactly.

    Which collectives: non-coalesced all-reduce, all-gather (input of at least one dim) and
    reduce-scatter (input dim 0 divisible by the group size) with values in meta. A run is
    cut where the next collective differs in kind, group, group size, reduce op, dtype, phase, micro-batch
    (or unit), is not bucketable, would pass the cap, or cannot legally join (below).

    The rewrite, with ``W`` the group size (this layout keeps every element's value exact):
      - all-reduce: flatten and concatenate the inputs (a dense non-contiguous input, such as a
        channels_last gradient, in memory order), all-reduce, wait, split, view back (with the
        input's own strides);
      - all-gather (rank ``r`` holds shard ``r`` of every tensor): concatenate the flattened
        local shards, all-gather, wait, view as ``(W, total)``, split along dim 1, and copy
        each piece to a contiguous tensor shaped as its original wait returned (``W`` shards
        stacked on dim 0);
      - reduce-scatter: view each input as ``(W, -1)``, concatenate along dim 1, flatten,
        reduce-scatter, wait, split, view each piece as its original output.
    Every piece is contiguous, as the wait it replaces was: downstream kernels can round
    differently on other strides.
    The bucket's collective goes where the run's last member was (every member's input
    exists there), so the collective order is unchanged. Its wait goes where the run's
    earliest member wait was, or right after the collective if that is earlier: the same
    wait policy the partitioner (or scheduler) chose. Each member's consumers read its piece.

    Why legal: collectives are never reordered across each other (only adjacent ones merge),
    so every rank issues the same sequence; each element is reduced or gathered with the
    same peers as before. A member joins only if (a) nothing writes its input's storage
    between it and the bucket's position (the bucket reads inputs later than the member
    did), and (b) nothing reads its result before the bucket's position, except a chain of
    view/reshape/copy ops of that result alone (:data:`PASS_THROUGH_OPS`), which moves after the
    bucket's wait; this also rules out members that depend on each other. Bit-for-bit
    caveat: the reduction backend may sum a long buffer in chunks; where it sums different
    chunks in a different rank order (ring algorithms at more than two ranks), an element's
    rounding can depend on its offset in the buffer. At one or two ranks the result is exact.

    Where: after :func:`passes.dedup.dedup_collectives` (a duplicate in a bucket is sent
    twice) and before any pass that moves collectives or waits (prefetch/scheduling), which
    should move buckets rather than members. No-op (the same ``gm``, untouched) when no two
    adjacent collectives can share a bucket.
    """
    if mode not in MODES:
        raise ValueError(f"bucket_collectives: mode must be one of {MODES}, got {mode!r}")
    if mode == "size" and unit_of is not None:
        raise ValueError('bucket_collectives: unit_of applies to mode="module" only')
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_collectives: bucket_cap_mb must be positive, got {bucket_cap_mb}")
    unit = (unit_of or module_prefix(2)) if mode == "module" else None
    cap = None if mode == "module" else int(bucket_cap_mb * 1024 * 1024)
    buckets = _plan(gm.graph, cap, unit)
    if not buckets:
        return gm
    for bucket in buckets:
        _rewrite(gm.graph, bucket)
    gm.graph.lint()
    gm.recompile()
    return gm


# ----------------------------------------------------------------------------- planning


@dataclasses.dataclass
class _Bucket:
    members: list[fx.Node]
    moved: list[fx.Node]  # reshape chains of member results that sit before the last member
    wait_before: fx.Node | None  # where the bucket's wait goes; None: right after the collective


def _val(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _key(coll: fx.Node, unit: Callable[[fx.Node], str] | None) -> tuple | None:
    """What members of one bucket share; None if ``coll`` cannot be bucketed."""
    if C.is_coalesced(coll) or C.kind_of(coll) not in _BUCKETABLE:
        return None
    if not (len(coll.users) == 1 and C.is_wait(next(iter(coll.users)))):
        return None
    x, out = _val(C.inputs_of(coll)[0]), _val(C.wait_of(coll))
    if x is None or out is None:
        return None
    w = C.group_size_of(coll)
    if C.kind_of(coll) is C.Kind.ALL_GATHER and x.dim() == 0:
        return None
    if C.kind_of(coll) is C.Kind.REDUCE_SCATTER and (x.dim() == 0 or w is None or x.shape[0] % w):
        return None
    return (
        C.kind_of(coll),
        C.group_of(coll),
        w,
        C.reduce_op_of(coll),
        x.dtype,
        coll.meta.get(PHASE),
        coll.meta.get(MICROBATCH, 0),
        unit(coll) if unit is not None else None,
    )


class _Run:
    """The run being grown, with what is needed to check the next member incrementally."""

    def __init__(self, order: dict[fx.Node, int], nodes: list[fx.Node], written: dict[fx.Node, set]):
        self.order, self.nodes, self.written = order, nodes, written
        self.members: list[fx.Node] = []
        self.key: tuple | None = None
        self.nbytes = 0
        self.inputs: set = set()  # storages of the members' inputs

    def start(self, coll: fx.Node, key: tuple | None) -> None:
        self.members, self.key, self.nbytes = [coll], key, C.bytes_of(coll)
        self.inputs = {s for s in map(storage_of, C.inputs_of(coll)) if s is not None}

    def try_add(self, coll: fx.Node) -> bool:
        """Add ``coll`` as the new last member if every member may move to its position."""
        last = self.order[self.members[-1]]
        here = self.order[coll]
        if any(self.written[n] & self.inputs for n in self.nodes[last + 1 : here]):
            return False
        if _moved_chains(self.members, coll, self.order) is None:
            return False
        self.members.append(coll)
        self.nbytes += C.bytes_of(coll)
        self.inputs |= {s for s in map(storage_of, C.inputs_of(coll)) if s is not None}
        return True

    def bucket(self) -> _Bucket | None:
        if len(self.members) < 2:
            return None
        last = self.members[-1]
        moved = _moved_chains(self.members[:-1], last, self.order)
        assert moved is not None
        waits = [C.wait_of(m) for m in self.members]
        first_wait = min(waits, key=self.order.__getitem__)
        after = first_wait if self.order[first_wait] > self.order[last] else None
        return _Bucket(members=list(self.members), moved=moved, wait_before=after)


def _moved_chains(members: list[fx.Node], last: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The nodes reading members' results before ``last``, if all may move after it; else None."""
    limit = order[last]
    moved: list[fx.Node] = []
    for m in members:
        chain = {C.wait_of(m)}
        stack = [C.wait_of(m)]
        while stack:
            for user in stack.pop().users:
                # ``last`` itself (or any member) reading the chain is a collective, not a
                # reshape: that returns None below, as it must (the members depend on each other).
                if order[user] > limit or user in chain:
                    continue
                inputs_ok = all(i in chain for i in user.all_input_nodes)
                if user.op != "call_function" or user.target not in PASS_THROUGH_OPS or not inputs_ok:
                    return None
                chain.add(user)
                stack.append(user)
                moved.append(user)
    return sorted(moved, key=order.__getitem__)


def _plan(graph: fx.Graph, cap: int | None, unit: Callable[[fx.Node], str] | None) -> list[_Bucket]:
    colls = C.collectives(graph)
    keys = [_key(c, unit) for c in colls]
    if not any(k is not None and k == k_next for k, k_next in zip(keys, keys[1:])):
        return []
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    written = {n: written_storages(n) for n in nodes}
    buckets: list[_Bucket] = []
    run = _Run(order, nodes, written)
    for coll, key in zip(colls, keys):
        fits = cap is None or run.nbytes + C.bytes_of(coll) <= cap
        if key is not None and key == run.key and fits and run.try_add(coll):
            continue
        if (b := run.bucket()) is not None:
            buckets.append(b)
        run.start(coll, key)
    if (b := run.bucket()) is not None:
        buckets.append(b)
    return buckets


# ----------------------------------------------------------------------------- rewriting


def _call(
    graph: fx.Graph, target: Any, args: tuple, meta: dict[str, Any], kwargs: dict[str, Any] | None = None
) -> fx.Node:
    """A node computing ``target(*args, **kwargs)``, its value evaluated on the inputs' meta values."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*fx.node.map_arg(args, lambda n: n.meta["val"]), **(kwargs or {}))
    node.meta.update(meta)
    return node


def _common_module(members: list[fx.Node]) -> str:
    paths = [module_of(m).split(".") for m in members]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def memory_order(t: torch.Tensor) -> list[int] | None:
    """The dim permutation that makes a dense, non-contiguous ``t`` contiguous (dims outermost
    first in memory: ``[0, 2, 3, 1]`` for a channels_last tensor); None for a contiguous tensor
    or one that is not a permutation of a dense layout (those are packed in logical order)."""
    if t.dim() < 2 or t.is_contiguous():
        return None
    strides = t.stride()
    perm = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    return perm if t.permute(perm).is_contiguous() else None


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return inv


def _tensor(node: fx.Node) -> torch.Tensor:
    val = _val(node)
    assert val is not None, f"{node.name} has no tensor value"  # planning only takes members with values
    return val


def _rewrite(graph: fx.Graph, bucket: _Bucket) -> None:
    members, last = bucket.members, bucket.members[-1]
    kind = C.kind_of(last)
    if kind is not C.Kind.ALL_REDUCE:
        _rewrite_flat(graph, bucket)
        return
    ins = [C.inputs_of(m)[0] for m in members]
    waits = [C.wait_of(m) for m in members]
    meta = _bucket_meta(members)
    with graph.inserting_before(last):
        wait = _pack_and_send(graph, last, ins, meta)
    if bucket.wait_before is not None:
        bucket.wait_before.prepend(wait)
    with graph.inserting_before(wait.next):
        pieces = _unpack(graph, last, wait, ins, waits, meta)
    anchor = pieces[-1].next
    for node in bucket.moved:
        anchor.prepend(node)
    for old, piece in zip(waits, pieces):
        old.replace_all_uses_with(piece)
        graph.erase_node(old)
    for m in members:
        graph.erase_node(m)


def _bucket_meta(members: list[fx.Node]) -> dict[str, Any]:
    last = members[-1]
    meta = {
        ROLE: Role.COMM,
        PHASE: last.meta.get(PHASE),
        MODULE: _common_module(members),
        MICROBATCH: last.meta.get(MICROBATCH, 0),
    }
    if UNIT in last.meta:
        meta[UNIT] = last.meta[UNIT]
    return meta


def _unit_name(meta: dict[str, Any]) -> str:
    label = str(meta.get(UNIT) or meta.get(MODULE) or "unit")
    return "".join(ch if ch.isalnum() else "_" for ch in label).strip("_") or "unit"


def _pack_and_send(graph: fx.Graph, like: fx.Node, ins: list[fx.Node], meta: dict[str, Any]) -> fx.Node:
    """The flat buffer of ``ins`` and the bucket's collective on it (a collective like ``like``); its wait."""
    kind, group, op, w = C.kind_of(like), C.group_of(like), C.reduce_op_of(like), C.group_size_of(like)
    if kind is C.Kind.REDUCE_SCATTER:
        # Rank r's chunk of the buffer must be the concatenation of rank r's chunk of every input.
        rows = [_call(graph, _aten.reshape.default, (x, [w, -1]), meta) for x in ins]
        grid = _call(graph, _aten.cat.default, (rows, 1), meta)
        flat = _call(graph, _aten.view.default, (grid, [-1]), meta)
    else:
        parts = []
        for x in ins:
            perm = memory_order(_tensor(x)) if kind is C.Kind.ALL_REDUCE else None
            if perm is not None:
                x = _call(graph, _aten.permute.default, (x, perm), meta)
            if _tensor(x).dim() != 1:
                x = _call(graph, _aten.reshape.default, (x, [-1]), meta)
            parts.append(x)
        flat = _call(graph, _aten.cat.default, (parts,), meta)
    if kind is C.Kind.ALL_REDUCE:
        return C.emit_all_reduce(graph, flat, reduce_op=str(op), group_name=group)[1]
    assert w is not None
    if kind is C.Kind.ALL_GATHER:
        return C.emit_all_gather(graph, flat, group_size=w, group_name=group)[1]
    return C.emit_reduce_scatter(graph, flat, reduce_op=str(op), group_size=w, group_name=group)[1]


def _unpack(
    graph: fx.Graph,
    like: fx.Node,
    wait: fx.Node,
    ins: list[fx.Node],
    old_waits: list[fx.Node],
    meta: dict[str, Any],
) -> list[fx.Node]:
    """One node per member, shaped like the member's old wait, cut from the bucket's result."""
    outs = [_tensor(x) for x in old_waits]
    if C.kind_of(like) is C.Kind.ALL_GATHER:
        # The result is W rank blocks, each the concatenation of that rank's shards.
        w, sizes = C.group_size_of(like), [_tensor(x).numel() for x in ins]
        grid = _call(graph, _aten.view.default, (wait, [w, sum(sizes)]), meta)
        parts = _call(graph, _aten.split_with_sizes.default, (grid, sizes, 1), meta)
        copy = True  # a column block of the grid is strided
    else:
        parts = _call(graph, _aten.split_with_sizes.default, (wait, [o.numel() for o in outs]), meta)
        copy = False
    reduce = C.kind_of(like) is C.Kind.ALL_REDUCE
    pieces = []
    for i, (old, out) in enumerate(zip(old_waits, outs)):
        part = _call(graph, operator.getitem, (parts, i), meta)
        if copy:
            # The member's wait returned a fresh contiguous tensor, and kernels downstream may
            # round differently on other strides (measured: nn.Transformer's loss changed when
            # reshape kept a one-row shard's (W, n) block as a strided view).
            part = _call(
                graph, _aten.clone.default, (part,), meta, {"memory_format": torch.contiguous_format}
            )
        perm = memory_order(_tensor(ins[i])) if reduce else None
        if perm is None:
            piece = _call(graph, _aten.view.default, (part, list(out.shape)), meta)
        else:
            # Packed in memory order: view in that order, permute back (a view with the
            # member's own strides; a fused optimizer reads gradient and parameter as flat
            # memory, so a channels_last gradient must stay channels_last).
            piece = _call(graph, _aten.view.default, (part, [out.shape[d] for d in perm]), meta)
            piece = _call(graph, _aten.permute.default, (piece, _inverse(perm)), meta)
        # The piece stands for the member's wait: it keeps that node's spmd metadata (a
        # partitioner may have marked the wait as the gradient).
        piece.meta.update({k: v for k, v in old.meta.items() if k.startswith("spmd_")})
        pieces.append(piece)
    return pieces


# ----------------------------------------------------------------------------- flat buffers


def _zero_row_pad(node: fx.Node) -> bool:
    """Whether ``node`` is ``constant_pad_nd(x, [0, 0, ..., 0, p])`` with value 0: rows appended on dim 0."""
    if node.op != "call_function" or node.target is not _aten.constant_pad_nd.default:
        return False
    pad = node.args[1]
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    if not (isinstance(pad, list | tuple) and len(pad) >= 2 and all(isinstance(x, int) for x in pad)):
        return False
    return bool(not any(pad[:-1]) and cast(int, pad[-1]) >= 0 and value == 0)


def _unpadded(x: fx.Node, until: fx.Node) -> fx.Node:
    """The input of ``x``'s dim-0 padding, where that padding may fold into the bucket's pack.

    It may where ``x`` is that pad, read by the collective alone, and nothing from the pad up to
    ``until`` (where the pack will read the unpadded tensor instead) writes the tensor's storage.
    """
    if len(x.users) != 1 or not _zero_row_pad(x):
        return x
    src = x.args[0]
    assert isinstance(src, fx.Node)
    s = storage_of(src)
    if s is None:
        return x
    n = x.next
    while n is not until:
        if s in written_storages(n):
            return x
        n = n.next
    return src


def _row_slice(wait: fx.Node) -> fx.Node | None:
    """The wait's only user, if it is ``slice(wait, 0, 0, k)``: the un-padding of a shard or parameter."""
    if len(wait.users) != 1:
        return None
    (u,) = wait.users
    if u.op != "call_function" or u.target is not _aten.slice.Tensor:
        return None
    args = list(u.args) + [None] * (5 - len(u.args))
    if args[1] not in (0, None) or args[2] not in (0, None) or args[4] not in (1, None):
        return None
    return u


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return strides[::-1]


def _rewrite_flat(graph: fx.Graph, bucket: _Bucket) -> None:
    """A bucket of all-gathers or reduce-scatters on the unit's flat buffer.

    all-gather: ``copy_in(shards) -> all_gather -> wait -> copy_out -> getitem`` per member;
    reduce-scatter: ``_chunk_cat(grads, 0, W) -> reduce_scatter -> wait -> as_strided`` per
    member. The partitioner's dim-0 padding of each member's input folds into the pack (both
    pack ops pad each piece to its chunk with zeros), and the un-padding slice of each result
    into its piece, so the node count does not grow with the number of ragged shards.
    """
    members, last = bucket.members, bucket.members[-1]
    kind, group, op, w = C.kind_of(last), C.group_of(last), C.reduce_op_of(last), C.group_size_of(last)
    assert w is not None
    meta = _bucket_meta(members)
    unit = _unit_name(meta)
    ins = [C.inputs_of(m)[0] for m in members]
    waits = [C.wait_of(m) for m in members]
    srcs = [_unpadded(x, last) for x in ins]
    dead_pads = [x for x, s in zip(ins, srcs) if s is not x]
    sizes = [_tensor(x).numel() // (w if kind is C.Kind.REDUCE_SCATTER else 1) for x in ins]
    with graph.inserting_before(last):
        if kind is C.Kind.ALL_GATHER:
            dtype = _tensor(ins[0]).dtype
            flat = _call(graph, COPY_IN, (srcs, sizes, dtype), meta)
            if meta[PHASE] is Phase.BACKWARD:  # the re-gather: name it apart from forward's
                unit = f"{unit}_bwd"
            torch_compat.rename_node(flat, f"{unit}_copy_in")
            wait = C.emit_all_gather(graph, flat, group_size=w, group_name=group)[1]
        else:
            flat = _call(graph, _aten._chunk_cat.default, (srcs, 0, w), meta)
            torch_compat.rename_node(flat, f"{unit}_chunk_cat")
            flat = _call(graph, _aten.view.default, (flat, [-1]), meta)
            wait = C.emit_reduce_scatter(graph, flat, reduce_op=str(op), group_size=w, group_name=group)[1]
    for n in (wait, wait.args[0]):
        assert isinstance(n, fx.Node)
        n.meta.update({k: v for k, v in meta.items() if k == UNIT})
    if bucket.wait_before is not None:
        bucket.wait_before.prepend(wait)
    slices = [_row_slice(old) for old in waits]
    shapes = [list(_tensor(sl if sl is not None else old).shape) for old, sl in zip(waits, slices)]
    pieces: list[fx.Node] = []
    with graph.inserting_before(wait.next):
        if kind is C.Kind.ALL_GATHER:
            outs = _call(
                graph,
                COPY_OUT,
                (wait, w, sizes, [d for s in shapes for d in s], [len(s) for s in shapes]),
                meta,
            )
            torch_compat.rename_node(outs, f"{unit}_copy_out")
            pieces = [_call(graph, operator.getitem, (outs, i), meta) for i in range(len(members))]
        else:
            off = 0
            for shape, size in zip(shapes, sizes):
                args = (wait, shape, _contiguous_strides(shape), off)
                pieces.append(_call(graph, _aten.as_strided.default, args, meta))
                off += size
    folded = {sl for sl in slices if sl is not None}
    anchor = pieces[-1].next
    for node in bucket.moved:
        if node not in folded:
            anchor.prepend(node)
    for old, sl, piece in zip(waits, slices, pieces):
        piece.meta.update({k: v for k, v in old.meta.items() if k.startswith("spmd_")})
        if sl is not None:
            piece.meta.update({k: v for k, v in sl.meta.items() if k.startswith("spmd_")})
            sl.replace_all_uses_with(piece)
            graph.erase_node(sl)
        old.replace_all_uses_with(piece)
        graph.erase_node(old)
    for m in members:
        graph.erase_node(m)
    for pad in dead_pads:
        graph.erase_node(pad)
