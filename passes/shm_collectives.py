"""Run the collectives of groups whose ranks share a host through shared memory.

A gloo collective between two processes of one machine goes through the kernel's TCP loopback:
the sender's bytes are copied into socket buffers and out again on gloo's threads, and each
collective wakes two of them per rank; through memory the ranks share, a collective is a few
copies (measured one op at a time by ``benchmarks/profiles/shm_collectives.py``; the numbers are on
docs/performance.md, "Shared memory between the ranks of one host"). ``shared_memory_collectives``
rewrites each qualifying collective to its ``torch.ops.spmd_shm`` twin (:mod:`passes.shm_ops`),
which the group's transport (``spmd.backend.shm``) runs in the caller's thread through memory
the ranks map together::

    ag = _c10d_functional.all_gather_into_tensor(x, 2, g)  ->  ag = spmd_shm.all_gather_into_tensor(x, 2, g)
    y  = wait_tensor(ag)                                        y  = wait_tensor(ag)   (returns ag)

Only the target changes: the arguments, the node's name, its metadata and its wait stay, so the
collective vocabulary, the report and every later pass read the graph as before.

Why legal, bit for bit: all-gather, all-to-all (equal splits) and broadcast move bytes, at any
group size. The reductions (all-reduce, reduce-scatter; sum and avg, floating point) qualify only
at two ranks, where the reduction is one addition, commutative, so the transport's ``own + peer`` gives the
bits gloo gives (and avg divides the sum by 2 afterwards, as gloo does). At more ranks gloo's
ring adds in an order the transport would not: those stay on gloo. Coalesced collectives stay on
gloo too (the partitioner and bucketing emit single ones).

Order: every rank rewrites the same collectives (the choice depends only on the graph and on the
groups each rank may put in shared memory as far as it can tell alone); once the ranks agreed on
the final graph, the transports are made and a group that cannot have one (its ranks on several
hosts) goes back to gloo on all its ranks (:func:`restore_gloo`; ``spmd.backend.shm.settle``). A
rewritten collective runs where its node is, so each group's collectives still run in graph
order on every rank. The
collective is finished when its node returns: its wait can stay where it is (later waits cost
nothing), and its inputs may be freed after it (``passes.invariants.INPUT_HELD``).

Where: after every pass that places or merges collectives and before ``reduce_scatter_as_all_to_all``
(a two-rank reduce-scatter is cheaper through shared memory as itself). No-op (the same ``gm``)
when ``groups`` is empty or no collective qualifies.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import cast

import torch
import torch.fx as fx

from passes import collectives as C
from passes import shm_ops
from passes.torch_compat import OpOverload

_c10d = C._c10d
_TWIN = {
    _c10d.all_gather_into_tensor.default: shm_ops.ALL_GATHER,
    _c10d.all_to_all_single.default: shm_ops.ALL_TO_ALL,
    _c10d.broadcast.default: shm_ops.BROADCAST,
    _c10d.all_reduce.default: shm_ops.ALL_REDUCE,
    _c10d.all_reduce_.default: shm_ops.ALL_REDUCE_,
    _c10d.reduce_scatter_tensor.default: shm_ops.REDUCE_SCATTER,
}
# The group size at which every summation order gives the same bits (see the module docstring).
_EXACT_WORLD = 2
_REDUCE_OPS = ("sum", "avg")


def shared_memory_collectives(
    gm: fx.GraphModule, *, groups: Mapping[str, int] | None = None
) -> fx.GraphModule:
    """Rewrite the qualifying collectives on the process groups in ``groups`` (name -> size: those
    with a shared-memory transport on every rank) to their ``spmd_shm`` twins."""
    if not groups:
        return gm
    todo = [
        c for c in C.collectives(gm.graph) if C.group_of(c) in groups and _qualifies(c, groups[C.group_of(c)])
    ]
    if not todo:
        return gm
    for c in todo:
        c.target = _TWIN[cast(OpOverload, c.target)]
    gm.graph.lint()
    gm.recompile()
    return gm


def restore_gloo(gm: fx.GraphModule, groups: Collection[str]) -> fx.GraphModule:
    """Undo the rewrite for the groups in ``groups`` (whose transport could not be made): their
    collectives run on their process group again, where they are; in place, returns ``gm``.
    Legal where the rewrite was: the wait and every buffer stay as they were, and a collective in
    flight is never written (the collective-buffer invariant holds the twins to it too)."""
    back = {twin: op for op, twin in _TWIN.items()}
    todo = [c for c in C.collectives(gm.graph) if C.is_shared_memory(c) and C.group_of(c) in groups]
    for c in todo:
        c.target = back[cast(OpOverload, c.target)]
    if todo:
        gm.recompile()
    return gm


def _qualifies(c: fx.Node, size: int) -> bool:
    if c.target not in _TWIN:
        return False
    kind = C.kind_of(c)
    if kind is C.Kind.ALL_TO_ALL:
        out_splits, in_splits = c.args[1], c.args[2]
        return (
            isinstance(out_splits, list | tuple)
            and isinstance(in_splits, list | tuple)
            and all(type(s) is int for s in (*out_splits, *in_splits))
            and len(set(out_splits) | set(in_splits)) == 1
        )
    if kind in (C.Kind.ALL_REDUCE, C.Kind.REDUCE_SCATTER):
        # Floating point only: the transport's avg divides in place, which an integer tensor
        # cannot hold (what gloo makes of an integer average is left to gloo).
        v = C.inputs_of(c)[0].meta.get("val")
        floating = isinstance(v, torch.Tensor) and v.dtype.is_floating_point
        return floating and C.reduce_op_of(c) in _REDUCE_OPS and size == _EXACT_WORLD
    return True
