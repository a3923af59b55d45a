"""Collectives written the way gloo runs them fastest, with the same bits.

gloo implements ``reduce_scatter_tensor`` as an all-reduce of the whole input followed by a
copy of the rank's chunk: every rank receives all W chunks reduced, and keeps one. An
``all_to_all_single`` of the same input with equal splits sends each rank only its own
chunk from every peer ((W-1)/W of the input, the reduce-scatter's minimum), and a local
sum over the W received chunks finishes the reduction. Measured on this machine (2 ranks,
3.25 MiB): 10.8 ms wall / 2.1 ms CPU for the reduce-scatter, 2.8 ms / 1.05 ms for the
all-to-all and the sum.

``reduce_scatter_as_all_to_all`` rewrites::

    rs = reduce_scatter_tensor(x, op, W, g)        a2a = all_to_all_single(x, [n/W]*W, [n/W]*W, g)
    y  = wait_tensor(rs)                     ->    w   = wait_tensor(a2a)
                                                   v   = view(w, [W, n/W, ...])
                                                   y   = sum(v, 0)          (op "sum")
                                                   y   = div(sum(v, 0), W)  (op "avg")

Why legal, bit for bit: only at W == 2 and op in {"sum", "avg"}. With two ranks the
reduction is one addition, which is commutative, so the order gloo adds the two chunks in
and the order ``sum`` adds them in give the same bits. gloo's "avg" sums and then divides
by W (checked against ``reduce_scatter_tensor`` on gloo for fp32/fp64/bf16/fp16), which is
what the division after the sum does. At W > 2 the summation order differs (gloo's ring vs
a left-to-right sum) and the bits may differ: untouched. The input must be contiguous (the
process group sends dense memory; a reduce-scatter's input always is in practice).

The collective order is unchanged (each all-to-all sits where its reduce-scatter was, its
wait where the wait was), so every rank still issues the same sequence; the bytes each
rank sends are the reduce-scatter's (W-1)/W of the input. The new view/sum/div nodes take
the wait's metadata (``Role.COMM``: they finish the communication) and sit right after it.

Where: late, after every pass that reads reduce-scatters as such (units, bucketing,
wait placement) and before ``overlap_optimizer`` (it records each update's gradient node by
name, and a gradient can be the replaced wait itself) and ``reuse_dead_buffers`` (which
should see the new buffers). Enabled by the caller for gloo process groups only: on
NCCL a reduce-scatter is already a true reduce-scatter. No-op (the same ``gm``) when no
reduce-scatter qualifies.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import collectives as C
from passes.meta import copy_meta

aten = torch.ops.aten

# The world size at which every summation order of the chunks gives the same bits.
_EXACT_WORLD = 2
_OPS = ("sum", "avg")


def reduce_scatter_as_all_to_all(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite each 2-rank sum/avg ``reduce_scatter_tensor`` into an all-to-all and a local sum."""
    todo = [c for c in C.collectives(gm.graph) if _qualifies(c)]
    if not todo:
        return gm
    for rs in todo:
        _rewrite(gm.graph, rs)
    gm.graph.lint()
    gm.recompile()
    return gm


def _qualifies(coll: fx.Node) -> bool:
    if coll.target is not C._c10d.reduce_scatter_tensor.default:
        return False
    if C.group_size_of(coll) != _EXACT_WORLD or C.reduce_op_of(coll) not in _OPS:
        return False
    if len(C.waits_of(coll)) != 1 or len(coll.users) != 1:
        return False
    x = coll.args[0]
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (
        isinstance(v, torch.Tensor)
        and v.dim() >= 1
        and v.shape[0] % _EXACT_WORLD == 0
        and v.is_contiguous()
        and v.dtype.is_floating_point
    )


def _rewrite(graph: fx.Graph, rs: fx.Node) -> None:
    x, op, w, group = rs.args[0], rs.args[1], rs.args[2], C.group_of(rs)
    assert isinstance(x, fx.Node) and isinstance(w, int)
    old_wait = C.wait_of(rs)
    with graph.inserting_before(rs):
        a2a, _ = C.emit_all_to_all(graph, x, group_size=w, group_name=group)
    # emit_all_to_all put its wait before the reduce-scatter; the wait belongs where the old one is.
    new_wait = next(iter(a2a.users))
    new_wait.meta.update({k: v for k, v in old_wait.meta.items() if k != "val"})
    a2a.meta.update({k: v for k, v in rs.meta.items() if k != "val"})  # unit, role, phase
    old_wait.append(new_wait)  # moves new_wait to right after old_wait
    xv = x.meta["val"]
    shape = [w, xv.shape[0] // w, *xv.shape[1:]]
    with graph.inserting_after(new_wait):
        view = graph.call_function(aten.view.default, (new_wait, shape))
        view.meta["val"] = new_wait.meta["val"].view(shape)
        copy_meta(view, old_wait)
    with graph.inserting_after(view):
        out = graph.call_function(aten.sum.dim_IntList, (view, [0]))
        out.meta["val"] = view.meta["val"].sum(0)
        copy_meta(out, old_wait)
    if op == "avg":
        with graph.inserting_after(out):
            div = graph.call_function(aten.div.Tensor, (out, w))
            div.meta["val"] = out.meta["val"].div(w)
            copy_meta(div, old_wait)
        out = div
    old_wait.replace_all_uses_with(out)
    graph.erase_node(old_wait)
    graph.erase_node(rs)
