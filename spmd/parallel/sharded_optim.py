"""The optimizer region on shards: global norms, fused-kernel alignment, offloaded factories.

Under fully_shard the optimizer, whose ops are elementwise, runs on the local shards of
parameters, gradients and state. Three things make that exact:

* norms over sharded gradients (``clip_grad_norm_``) become global with an all-reduce of the
  partial sums (over the shard group only under hybrid_shard: the replicas agree); any other
  non-elementwise op on a shard is an error;
* fused optimizer kernels get shards aligned as the full tensor's elements are, so the
  kernel's SIMD/scalar split rounds each element as DDP's does;
* under CPU offload, factory ops of the optimizer region are pointed at the CPU.

Run after the gradient reductions (:mod:`spmd.parallel.reductions`): they mark the reduced
gradients this walks from.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.fused_align import ALIGNED_FUSED, wrap_args
from passes.meta import GRAD_OF, PHASE, ROLE, STATE_NAME, Phase, Role
from passes.torch_compat import OpOverload
from spmd.errors import TraceError
from spmd.parallel.offload import CPU
from spmd.parallel.partition_state import PartitionState

# Fused optimizer kernels whose SIMD/scalar split depends on where an element sits (see
# align_fused_optimizer).
_FUSED_OPTIMIZERS = {
    torch.ops.aten._fused_adam_.default,
    torch.ops.aten._fused_adam_.tensor_lr,
    torch.ops.aten._fused_adamw_.default,
    torch.ops.aten._fused_adamw_.tensor_lr,
    torch.ops.aten._fused_sgd_.default,
    torch.ops.aten._fused_sgd_.tensor_lr,
}
# The kernels cut a tensor into 64-byte units (torch's ``cache_line_aligned_task_unit``) for
# their threads and run each piece's SIMD loop from its start, so the SIMD/scalar split of an
# element depends only on where it sits relative to 64-byte boundaries and the tensor's end: a
# vector is at most 64 bytes on every CPU torch builds for (AVX-512: 16 floats, 32 bf16). Was 64
# elements for every dtype (256 bytes of float32): at 2 ranks every 64-element LayerNorm shard
# was padded, copied and copied back each step.
_ALIGN_BYTES = 64
aten = torch.ops.aten


def align_elements(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` a shard must start at a multiple of (and end at one, or at the
    tensor's end) for a CPU fused optimizer kernel to round each element as on the full tensor."""
    return max(1, _ALIGN_BYTES // dtype.itemsize)


def globalize_norms(ps: PartitionState) -> None:
    """Make norms over sharded gradients global: ``norm = allreduce(local_norm ** p) ** (1/p)``.

    Walks the graph from the sharded tensors (gradients, parameter and state shards)
    through elementwise ops; a norm of a shard becomes global, and any other op on a
    shard is an error (it would silently compute on part of the tensor).
    """
    sharded: set[fx.Node] = set()
    for name in ps.layouts:
        sharded.add(ps.by_name[name])
    for n in ps.graph.nodes:
        if n.meta.get(ROLE) is Role.GRAD and n.meta.get(GRAD_OF) in ps.layouts:
            sharded.add(n)
    for n in list(ps.graph.nodes):
        # Gradients reach the optimizer through autograd's detach (any phase); the
        # partitioner's own pads and collectives read shards legitimately.
        if n.op != "call_function" or n.meta.get(ROLE) is Role.COMM:
            continue
        ins = _inputs(n)
        if not any(i in sharded for i in ins):
            continue
        if n.target is aten.linalg_vector_norm.default:
            _globalize(ps, n, n.args[1] if len(n.args) > 1 else n.kwargs.get("ord", 2))
        elif n.target is aten._foreach_norm.Scalar:
            ord_ = n.args[1] if len(n.args) > 1 else 2
            for u in list(n.users):
                idx = u.args[1]
                if n.args[0][idx] in sharded:
                    _globalize(ps, u, ord_)
        elif _elementwise(n):
            sharded.add(n)
        else:
            raise TraceError(
                f"spmd fully_shard: the optimizer region applies {n.target} to sharded tensors "
                f"(node {n.name}); only elementwise ops, foreach/fused optimizer kernels and norms are "
                "supported on shards. Use DataParallel('replicate') for this step, or move the op "
                "before loss.backward()."
            )


def align_fused_optimizer(ps: PartitionState) -> None:
    """Feed fused optimizer kernels shards that sit where the full tensor's elements sit.

    CPU fused kernels (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``) run a SIMD
    loop with a scalar tail, and the two round differently (fused multiply-add). On the
    full tensor an element takes the SIMD path iff its index is below ``n - n % V``; on a
    shard it depends on the shard's own size. Where a shard does not start at a multiple
    of 64 bytes (:func:`align_elements`: 16 float32 elements), or ends early, its elements
    would round differently from DDP's. Those shards are copied into a zero-padded buffer
    that covers the same global index range rounded out to that alignment (up to ``n`` when
    the shard holds the tensor's tail), the kernel runs on the buffers, and the results are
    copied back. Shards that are aligned already (the common case: rows of a multiple of 16
    float32 elements) cost nothing.

    A call with any shard to align becomes one ``spmd::aligned_fused_optimizer_`` node
    (:mod:`passes.fused_align`), which pads, runs the kernel and copies back inside, so the
    graph does not grow with the number of ragged shards (almost all at large world sizes).
    """
    for node in list(ps.graph.nodes):
        if node.op != "call_function" or node.target not in _FUSED_OPTIMIZERS:
            continue
        n_params = len(node.args[0])
        pre, post, channels_last = [0] * n_params, [0] * n_params, [0] * n_params
        for k, p in enumerate(node.args[0]):
            name = p.meta.get(STATE_NAME) if isinstance(p, fx.Node) else None
            lay = ps.layouts.get(name) if name is not None else None
            if name is None or lay is None:
                continue
            shape = p.meta["val"].shape  # the parameter as the graph sees it (its tensor-parallel piece)
            row = math.prod(shape[1:])
            total, off, n_loc = lay.rows * row, lay.offset * row, lay.local_rows * row
            align = align_elements(p.meta["val"].dtype)
            if off % align == 0 and (n_loc % align == 0 or off + n_loc == total):
                continue
            pre[k] = off % align
            end = -(-(off + n_loc) // align) * align if off + n_loc <= total - total % align else total
            post[k] = end - (off - pre[k]) - pre[k] - n_loc
            # Flatten in memory order (the kernel DDP runs walks the full tensor's memory).
            channels_last[k] = len(shape) if name in ps.perms else 0
        if not any(pre) and not any(post):
            continue
        schema = torch_compat.op_schema(node.target)
        values = {a.name: node.args[i] for i, a in enumerate(schema.arguments) if i < len(node.args)}
        values.update(node.kwargs)
        args, kwargs = wrap_args(node.target, values, pre, post, channels_last)
        with ps.graph.inserting_before(node):
            wrapped = ps.graph.call_function(ALIGNED_FUSED, args, kwargs)
        wrapped.meta.update(node.meta)
        wrapped.meta["val"] = None
        node.replace_all_uses_with(wrapped)
        ps.graph.erase_node(node)


def _globalize(ps: PartitionState, norm: fx.Node, ord_: Any) -> None:
    users = list(norm.users)
    # Offloaded gradients have CPU norms; the collective runs on the device (NCCL has no CPU).
    device = next(iter(ps.offloaded.values()), None)
    with ps.graph.inserting_before(norm.next):

        def reduce(x: fx.Node, op: str) -> fx.Node:
            if device is not None:
                x = ps.to_device(x, device, norm)
            wait = ps.call(
                C.WAIT, (ps.call(C._c10d.all_reduce.default, (x, op, ps.shard_group), norm),), norm
            )
            return wait if device is None else ps.to_device(wait, CPU, norm, role=Role.UPDATE)

        if ord_ in (float("inf"), "inf"):
            out = reduce(norm, "max")
        else:
            p = float(ord_)
            powed = ps.call(aten.pow.Tensor_Scalar, (norm, p), norm, role=Role.UPDATE)
            out = ps.call(aten.pow.Tensor_Scalar, (reduce(powed, "sum"), 1.0 / p), norm, role=Role.UPDATE)
    for u in users:
        u.replace_input_with(norm, out)


def optimizer_on_cpu(ps: PartitionState) -> None:
    """Point factory ops of the optimizer region at the CPU, where offloaded state lives.

    The trace saw the optimizer on the device; after offload it reads CPU shards, CPU
    gradients and CPU state, so a tensor it creates with ``device=<the device>`` (none
    in SGD/Adam/AdamW/clip_grad_norm_ on torch 2.13, but a custom step may) goes to the CPU.
    """
    devices = {d.type for d in ps.offloaded.values()}
    for n in ps.graph.nodes:
        if n.meta.get(PHASE) is not Phase.OPTIMIZER or n.meta.get(ROLE) is Role.COMM:
            continue
        dev = n.kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type in devices:
            n.kwargs = {**n.kwargs, "device": CPU}


def _inputs(n: fx.Node) -> list[fx.Node]:
    return list(n.all_input_nodes)


def _elementwise(n: fx.Node) -> bool:
    t = n.target
    if not isinstance(t, OpOverload):
        return t.__name__ == "getitem" if callable(t) else False
    name = torch_compat.op_schema(t).name
    if torch.Tag.pointwise in t.tags or "_foreach_" in name or "_fused_" in name:
        return True
    return t in (
        aten.clone.default,
        *torch_compat.DETACH_OPS,
        aten.copy_.default,
        aten.zero_.default,
        aten.fill_.Scalar,
    )
