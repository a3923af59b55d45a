"""Gradient reductions: each gradient tag becomes the collective its parameter's plan says.

* replicated: ``g * (1 / W)`` then ``all_reduce(sum)``, DDP's order (in memory order for a
  channels_last parameter);
* sharded (fully_shard): ``reduce_scatter(avg)`` over the shard group of the gradient padded
  to equal shards, then the padding sliced off (in memory order, as the parameter was gathered);
* hybrid_shard: that reduce-scatter, then ``all_reduce(avg)`` over the replicate group;
* ignored (rank-local): the tag stays, for ``passes.cleanup.strip_grad_tags``.

Each wait sits just before the gradient's first use, so reductions overlap the rest of
backward. With mixed precision a gradient is cast to the reduce dtype before its reduction
(skipped where it is autograd's upcast of a ``reduce_dtype`` gradient: the round trip is
exact) and the reduced gradient cast back to the parameter's dtype. An offloaded gradient is
copied device-to-host after its wait, for the optimizer on the CPU.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.graph_utils import PASS_THROUGH_OPS
from passes.meta import GRAD_OF, ROLE, Role
from passes.ops import TAG_GRAD
from spmd.parallel import layout
from spmd.parallel.offload import CPU
from spmd.parallel.partition_state import PartitionState

aten = torch.ops.aten


def reduce_grads(ps: PartitionState) -> None:
    """Reduce every gradient as its parameter's plan says; ignored ones keep their tag.

    Sharded: reduce-scatter (avg) over the shard group at the tag, as FSDP2 (fp32/bf16 reduce
    dtype: ``ReduceOp.AVG``, which sums then divides). Then, for a replicate dimension, an
    all-reduce over the replicate group: for a replicated parameter at the tag, scaled by
    ``1 / W`` then summed, as DDP; after a reduce-scatter (hybrid_shard), right after its
    wait, which goes to the first node that computes with the gradient (past the detaches and
    views that only pass it on), so that the reduce-scatters stay adjacent in the collective order, and so do
    the all-reduces: bucketing merges each run. A rank-local gradient's tag stays, an
    identity that ``strip_grad_tags`` removes.
    """
    tags = [n for n in ps.graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]
    for tag in tags:
        name = tag.args[1]
        g = tag.args[0]
        users = list(tag.users)
        comm = ps.comms[name]
        if comm.local_only:
            continue
        sharded = comm.shard is not None
        perm = None if sharded else layout.memory_order(ps.by_name[name].meta["val"])
        grad_dtype = g.meta["val"].dtype
        # Issued as soon as the gradient exists: after autograd's upcast, moved to its input.
        with ps.graph.inserting_before(_hoist_upcast(g) or tag):
            send = _to_reduce_dtype(ps, g, tag)
            if sharded:
                coll = _emit_reduce_scatter(ps, send, name, tag)
            else:
                assert comm.reduce is not None
                # In memory order: the reduced gradient keeps the parameter's strides (a
                # fused optimizer reads a channels_last parameter and its gradient as flat
                # memory; the functional all-reduce returns a contiguous tensor).
                if perm is not None:
                    send = ps.call(aten.permute.default, (send, perm), tag)
                coll = _emit_ddp_all_reduce(ps, send, comm.reduce.name, comm.reduce.size, tag)
        # The wait (and the un-padding slice) sits just before the gradient's first use.
        anchor = ps.first(users) if users else tag.next
        if sharded and comm.reduce is not None and users:
            anchor = _sink_pass_through_users(ps, tag)
        with ps.graph.inserting_before(anchor):
            res = ps.call(C.WAIT, (coll,), tag)
            if sharded and comm.reduce is not None:
                # On the padded shard: the same shape on every rank (uneven shards differ).
                ar = ps.call(C._c10d.all_reduce.default, (res, "avg", comm.reduce.name), tag)
                res = ps.call(C.WAIT, (ar,), tag)
            if sharded and ps.layouts[name].padded:
                res = ps.call(aten.slice.Tensor, (res, 0, 0, ps.layouts[name].local_rows), tag)
            if sharded and name in ps.perms:  # reduced in memory order: back to logical
                res = ps.call(aten.permute.default, (res, layout.inverse(ps.perms[name])), tag)
            if not sharded and perm is not None:
                res = ps.call(aten.permute.default, (res, layout.inverse(perm)), tag)
            if name in ps.offloaded:  # the optimizer runs on the CPU: device-to-host
                res = ps.to_device(res, CPU, tag)
            if send is not g:  # reduced in another dtype: back to the optimizer's
                res = ps.to_dtype(res, grad_dtype, tag)
        res.meta[ROLE] = Role.GRAD
        res.meta[GRAD_OF] = name
        tag.replace_all_uses_with(res)
        ps.graph.erase_node(tag)
        # A bypassed upcast (and autograd's detach of it) is now dead.
        dead = g
        while (
            dead is not send
            and not dead.users
            and (dead.target in torch_compat.DETACH_OPS or dead.target is aten._to_copy.default)
        ):
            up = dead.args[0]
            ps.graph.erase_node(dead)
            if not isinstance(up, fx.Node):
                break
            dead = up


def _hoist_upcast(g: fx.Node) -> fx.Node | None:
    """Move autograd's upcast of a gradient (``_to_copy``, then ``detach``s) to just after the
    gradient it casts; return the node after the moved chain (None: ``g`` is no such upcast).

    With mixed precision the parameters' casts run at the start of forward, so autograd runs
    their backward, the upcast of each bf16 gradient to the parameter's fp32, at the very end
    of backward: every full-size bf16 gradient would live until then, and every reduction,
    issued after it, would wait for the end of backward instead of overlapping it. Legal: each
    moved op reads only the one before it in the chain (the first reads the gradient), so it
    can run as soon as that exists; its value and everything downstream are unchanged.
    """
    chain, n = [], g
    while (
        n.op == "call_function"
        and (n.target in torch_compat.DETACH_OPS or n.target is aten._to_copy.default)
        and len(n.all_input_nodes) == 1
        and n.all_input_nodes[0] is n.args[0]
    ):
        chain.append(n)
        n = n.args[0]
    if not any(c.target is aten._to_copy.default for c in chain):
        return None
    at = n
    for c in reversed(chain):
        at.append(c)
        at = c
    return at.next


def _to_reduce_dtype(ps: PartitionState, g: fx.Node, like: fx.Node) -> fx.Node:
    """The gradient as the reduction sends it: ``g``, or ``g`` cast to the reduce dtype.

    Where ``g`` is itself an upcast of a gradient in the reduce dtype (autograd's cast
    back through a bf16 compute copy), that gradient is sent directly: casting it up
    and down again is the identity.
    """
    rd = ps.reduce_dtype
    if rd is None or g.meta["val"].dtype == rd:
        return g
    up = g
    while up.target in torch_compat.DETACH_OPS and isinstance(up.args[0], fx.Node):
        up = up.args[0]  # autograd hands over p.grad detached
    if up.target is aten._to_copy.default:
        src = up.args[0]
        if isinstance(src, fx.Node) and src.meta["val"].dtype == rd and _widens(rd, g.meta["val"].dtype):
            return src
    return ps.to_dtype(g, rd, like)


def _sink_pass_through_users(ps: PartitionState, tag: fx.Node) -> fx.Node:
    """Move the ops that only pass ``tag`` on (detach, views) to just before the first node
    that computes with it; return the first node now reading the gradient.

    Legal: those ops read nothing but the gradient (or each other), so they can run as
    late as their first real consumer.
    """
    chain, members, stack = [], {tag}, [tag]
    while stack:
        for u in stack.pop().users:
            if u in members or u.op != "call_function" or u.target not in PASS_THROUGH_OPS:
                continue
            if all(i in members for i in u.all_input_nodes):
                members.add(u)
                chain.append(u)
                stack.append(u)
    real = [u for n in members for u in n.users if u not in members]
    if not real:
        return ps.first(list(tag.users))
    first = ps.first(real)
    moved = sorted(n for n in chain if n < first)
    for n in moved:
        first.prepend(n)
    return ps.first(list(tag.users))


def _emit_ddp_all_reduce(ps: PartitionState, g: fx.Node, group: str, size: int, like: fx.Node) -> fx.Node:
    """``g * (1 / size)`` then ``all_reduce(sum)``: DDP's order, not ``all_reduce(avg)``.

    DDP's reducer (no comm hook) copies each gradient into its bucket as ``grad * (1 / W)``
    (a float32 multiply) and all-reduces the bucket with SUM; gloo's AVG sums first and divides
    after. At a power-of-two world size the scaling is exact and the two agree; at W=3 they
    differ in the last bit of about half the elements, so this follows DDP.
    """
    scaled = ps.call(aten.mul.Tensor, (g, 1.0 / size), like)
    return ps.call(C._c10d.all_reduce.default, (scaled, "sum", group), like)


def _emit_reduce_scatter(ps: PartitionState, g: fx.Node, name: str, like: fx.Node) -> fx.Node:
    """full gradient -> (pad to W * chunk rows) -> reduce_scatter(avg) over the shard group."""
    lay, group = ps.layouts[name], ps.comms[name].shard
    assert group is not None
    x = g
    if name in ps.perms:  # reduce in memory order, as the parameter was gathered
        x = ps.call(aten.permute.default, (x, ps.perms[name]), like)
    if lay.padded:
        pad = [0, 0] * (len(ps.params[name].shape) - 1) + [0, lay.chunk * group.size - lay.rows]
        x = ps.call(aten.constant_pad_nd.default, (x, pad), like)
    return ps.call(C._c10d.reduce_scatter_tensor.default, (x, "avg", group.size, group.name), like)


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is exactly a ``dst`` value (bf16/fp16 -> fp32, fp32 -> fp64)."""
    return dst in (torch.float32, torch.float64) and dst.itemsize > src.itemsize
