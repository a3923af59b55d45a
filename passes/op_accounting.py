"""What one op of the step graph computes and moves, for :mod:`passes.cost_model`: its FLOPs
(``torch.utils.flop_counter``'s formulas; a causal attention's unmasked share), the bytes it reads
and writes (an ``out=`` buffer written, not read; an in-place argument once each way), its op class
(matmul, attention, optimizer, memory), whether it is free (a view), and the tensor counts of ops
that loop over lists (fused optimizers, foreach ops, the fully_shard copy-in/out). Pure functions
of a node and its ``meta["val"]`` values; no device profile here.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from passes import torch_compat
from passes.torch_compat import OpOverload, pytree

_DTYPE_KEY = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return torch_compat.storage_key(t)
    except (NotImplementedError, RuntimeError):
        return None


def _aliases_an_input(node: fx.Node) -> bool:
    """The result's (fake) storage is an input's: a view the schema does not declare
    (``_unsafe_view``), as ``passes.memory`` tells it."""
    outs = _tensors(node.meta.get("val"))
    if not outs:
        return False
    ins = {_storage_key(t) for a in node.all_input_nodes for t in _tensors(a.meta.get("val"))}
    ins.discard(None)
    return all(_storage_key(t) in ins for t in outs)


def _is_free(node: fx.Node) -> bool:
    """No kernel runs: structure, a multi-output pick, or a view (aliases without writing)."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return True
    target = node.target
    if isinstance(target, OpOverload):
        rets = [r.alias_info for r in torch_compat.op_schema(target).returns]
        if rets and all(a is not None and not a.is_write for a in rets):
            return True
        if not rets or any(a is not None for a in rets):
            return False
        return not _written_args(node) and _aliases_an_input(node)
    return False


def _written(node: fx.Node) -> list[tuple[Any, Any]]:
    """(schema argument, value) of each argument the op writes (in place, or an ``out=``)."""
    target = node.target
    if not isinstance(target, OpOverload):
        return []
    out = []
    for i, a in enumerate(torch_compat.op_schema(target).arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.kwargs.get(a.name) if a.kwarg_only or i >= len(node.args) else node.args[i]
            out.append((a, v))
    return out


def _written_args(node: fx.Node) -> list[Any]:
    return [v for _, v in _written(node)]


def _returned(node: fx.Node, arg: Any) -> bool:
    """Whether the op returns (an alias of) the written argument ``arg`` (its schema argument)."""
    sets = set(arg.alias_info.before_set)
    rets = torch_compat.op_schema(node.target).returns  # type: ignore[union-attr]
    return any(r.alias_info is not None and sets & set(r.alias_info.before_set) for r in rets)


def _cpu_attention_flops(node: fx.Node, args: Any) -> float | None:
    """CPU flash attention, which ``flop_registry`` lacks through torch 2.14 (2.15 registers the same
    formulas): torch's own SDPA formulas (``sdpa_flop_count``: QK^T and PV, non-causal, as for the CUDA
    kernels)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v = args[:3]
        return float(fc.sdpa_flop_count(q.shape, k.shape, v.shape))
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        g, q, k, v = args[:4]
        return float(fc.sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))
    return None


def node_flops(node: fx.Node) -> float:
    """FLOPs of one op by ``torch.utils.flop_counter``'s formula for it (0 where it has none)."""
    return _flops(node, fx.node.map_aggregate((node.args, node.kwargs), _val))


def _flops(node: fx.Node, values: Any) -> float:
    """:func:`node_flops` given the node's arguments as values (``(args, kwargs)``)."""
    from torch.utils.flop_counter import flop_registry

    target = node.target
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    args, kwargs = values
    try:
        if formula is None:
            return _cpu_attention_flops(node, args) or 0.0
        return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read these shapes: price by bytes
        return 0.0


def _arg(node: fx.Node, values: Any, name: str) -> Any:
    """The value of the schema argument ``name`` (its default where not given; None where the
    op has no such argument)."""
    target = node.target
    if not isinstance(target, OpOverload):
        return None
    args, kwargs = values
    for i, a in enumerate(torch_compat.op_schema(target).arguments):
        if a.name == name:
            if name in kwargs:
                return kwargs[name]
            if not a.kwarg_only and i < len(args):
                return args[i]
            return a.default_value if a.has_default_value() else None
    return None


def causal_share(node: fx.Node, values: Any | None = None) -> float:
    """The share of an attention op's FLOPs (torch's count: every query against every key) that a
    causal kernel runs: the unmasked entries of the top-left causal mask, ``s(s+1)/2`` of ``s^2``
    for equal lengths (about half); 1.0 where the op is not causal."""
    if values is None:
        values = fx.node.map_aggregate((node.args, node.kwargs), _val)
    if _arg(node, values, "is_causal") is not True:
        return 1.0
    q, k = _arg(node, values, "query"), _arg(node, values, "key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return 1.0
    sq, sk = q.shape[-2], k.shape[-2]
    # Query i sees keys 0..i (all sk of them once i >= sk).
    kept = sq * (sq + 1) / 2 if sq <= sk else sk * (sk + 1) / 2 + (sq - sk) * sk
    return float(kept / (sq * sk))


def node_bytes(node: fx.Node) -> int:
    """Bytes an op moves: the tensors it reads and the ones it writes. Its tensor inputs and
    outputs, except that an ``out=`` buffer (a written keyword-only argument) is not read, and a
    tensor written in place that the op does not return (a fused optimizer's lists) is written
    once more."""
    return _bytes(node, fx.node.map_aggregate((node.args, node.kwargs), _val))


def _bytes(node: fx.Node, values: Any) -> int:
    """:func:`node_bytes` given the node's arguments as values."""
    total = sum(_nbytes(t) for t in _tensors(values))
    total += sum(_nbytes(t) for t in _tensors(node.meta.get("val")))
    for arg, v in _written(node):
        written = sum(_nbytes(t) for t in _tensors(fx.node.map_aggregate(v, _val)))
        if not _returned(node, arg):
            total += written  # the write is not among the outputs
        elif arg.kwarg_only:
            total -= written  # an out= buffer: written (the output), not read
    return total


def _moved_bytes(node: fx.Node, values: Any) -> int:
    """The bytes a kernel moves through device memory: the arguments it reads (not an ``out=``
    buffer, which it only writes), the arguments it writes (in place or ``out=``) and the
    outputs it allocates. :func:`node_bytes` counts a written argument up to three times (as an
    argument, as the returned alias and as written): the key of the measured curves, kept."""
    args, kwargs = values
    total = sum(_nbytes(t) for t in _tensors(values))
    target = node.target
    if isinstance(target, OpOverload):
        for i, a in enumerate(torch_compat.op_schema(target).arguments):
            if a.is_out:
                v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
                total -= sum(_nbytes(t) for t in _tensors(v))
    written = fx.node.map_aggregate(tuple(_written_args(node)), _val)
    total += sum(_nbytes(t) for t in _tensors(written))
    return total + sum(_fresh_bytes(node))


def _dtype_key(node: fx.Node, values: Any) -> str:
    for t in _tensors(values) + _tensors(node.meta.get("val")):
        if t.is_floating_point():
            return _DTYPE_KEY.get(t.dtype, "fp32")
    return "fp32"


_ATTENTION = (
    "_scaled_dot_product",
    "_flash_attention",
    "_efficient_attention",
    "_cudnn_attention",
)
_OPTIMIZER = ("_fused_adam", "_fused_adamw", "_fused_sgd", "_foreach_", "aligned_fused_optimizer_")


def op_class(node: fx.Node) -> str:
    """The class of a compute op, the key of a profile's per-class numbers: ``"matmul"`` (a
    FLOP formula that is not attention: mm, addmm, bmm, convolution), ``"attention"`` (the SDPA
    kernels), ``"optimizer"`` (fused and foreach optimizer ops) or ``"memory"`` (the rest:
    elementwise, reductions, norms, softmax, copies: priced by bytes). ``spmd::aligned_fused_optimizer_``
    (a fused optimizer on aligned copies of shards) is an optimizer op."""
    name = getattr(node.target, "__name__", str(node.target))
    if any(a in name for a in _ATTENTION):
        return "attention"
    if name.startswith(_OPTIMIZER):
        return "optimizer"
    packet = getattr(node.target, "overloadpacket", None)
    from torch.utils.flop_counter import flop_registry

    if packet is not None and packet in flop_registry:
        return "matmul"
    return "memory"


def interpolate(points: Sequence[Sequence[float]], x: float) -> float:
    """Seconds at size ``x`` from measured ``[[size, seconds], ...]`` (ascending sizes): log-log
    linear between points, the first point's time below it (a call's fixed cost), the last
    point's throughput above it."""
    if x <= points[0][0]:
        return float(points[0][1])
    for (x0, t0), (x1, t1) in zip(points, points[1:]):
        if x <= x1:
            if x1 <= x0 or t0 <= 0 or t1 <= 0:
                return float(t1)
            f = math.log(x / x0) / math.log(x1 / x0)
            return float(math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0))))
    xl, tl = points[-1]
    return float(tl * x / xl)


def call_tensors(values: Any, out: Any) -> int:
    """Tensors an op loops over: those inside its list arguments (``values``: ``(args, kwargs)``)
    and in a list result (``out``)."""
    args, kwargs = values
    n = sum(len(_tensors(a)) for a in (*args, *kwargs.values()) if isinstance(a, list | tuple))
    if isinstance(out, list | tuple):
        n += len(_tensors(out))
    return n


def ragged_pieces(target: Any, args: Sequence[Any]) -> int:
    """The padded pieces of a flat-buffer or aligned-optimizer op (its slower path; 0 for any
    other op), given its positional arguments as values: shards shorter than their chunk
    (all-gather copy-in), parameters that do not fill their ``W`` chunks (copy-out), shards with
    padding before or after (the aligned fused optimizer)."""
    from passes import flat_ops, fused_align

    if target is fused_align.ALIGNED_FUSED:
        return sum(1 for a, b in zip(args[6], args[7]) if a or b)
    if target is flat_ops.COPY_IN:
        return sum(1 for x, c in zip(args[0], args[1]) if x.numel() < c)
    if target is flat_ops.COPY_OUT:
        _, world, chunks, shapes, ranks = args[:5]
        pieces = flat_ops._shapes(shapes, ranks)
        return sum(1 for c, shape in zip(chunks, pieces) if math.prod(shape) != world * c)
    return 0


def ragged_copy_bytes(target: Any, args: Sequence[Any]) -> int:
    """Bytes the padded path of the aligned fused optimizer copies beyond its kernel's (0 for
    any other op), given its positional arguments as values: each padded shard of every list is
    copied into a zero buffer (read and written) and, but for the gradients (the kernel's
    scratch), back (read and written again)."""
    from passes import fused_align

    if target is not fused_align.ALIGNED_FUSED:
        return 0
    lists = args[:5]
    total = 0
    for k, (a, b) in enumerate(zip(args[6], args[7])):
        if a or b:
            for j, lst in enumerate(lists):
                if lst:
                    total += (2 if j == 1 else 4) * _nbytes(lst[k])
    return total


def _fresh_bytes(node: fx.Node) -> list[int]:
    """The bytes of each output an op allocates (none for an in-place or aliasing op)."""
    target = node.target
    if isinstance(target, OpOverload) and any(
        r.alias_info is not None for r in torch_compat.op_schema(target).returns
    ):
        return []
    if _written_args(node):  # out= variants and in-place ops write an existing buffer
        return []
    return [_nbytes(t) for t in _tensors(node.meta.get("val"))]
