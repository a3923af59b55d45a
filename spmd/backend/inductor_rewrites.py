"""The rewrites the final graph gets before inductor compiles it (:func:`for_inductor`).

Each keeps the step's values and mutations and changes only how inductor sees an op:

* ATen's fused optimizer ops (``_fused_adam_`` ...) become opaque in-place custom ops, so
  inductor calls the ATen kernel on the real state instead of functionalizing it into copies;
  or, with ``inline_optimizer``, Adam/AdamW become their math for inductor to fuse.
* float32 CPU ``mm``/``addmm`` go to oneDNN's matmul where ``inductor_gemm`` says so: measured per
  shape on this machine (``"auto"``, :mod:`spmd.backend.gemm_policy`), or all large ones (``"onednn"``).
* legacy empty operands (Hugging Face's ``use_cache`` start) are dropped from ``cat``.

:mod:`spmd.backend.lowering` compiles the result and checks its collective order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.fx as fx

from passes import torch_compat
from passes.stages import rebuilt
from passes.torch_compat import OpOverload
from spmd.backend import gemm_policy

# Smallest matmul (m * k * n) inductor_gemm="onednn" sends to oneDNN: its per-call setup made the
# ResMLP's 32x64x256 matmuls slower than MKL's (benchmarks/profiles/profile_step.py --model overhead), while
# the GPT's (>= 1024x256x256) are 1.5-3x faster on an AVX-512 EPYC.
_ONEDNN_MIN_MACS = 1 << 22


# ----------------------------------------------------------------------------- in-place optimizers


def _is_fused_optimizer(target: Any) -> bool:
    return (
        isinstance(target, OpOverload)
        and target.namespace == "aten"
        and torch_compat.op_schema(target).name.startswith("aten::_fused_")
        and torch_compat.op_schema(target).is_mutable
    )


_LIB = torch.library.Library("spmd_lowering", "FRAGMENT")


@functools.cache
def _opaque(op: OpOverload) -> OpOverload:
    """A custom op with ``op``'s schema that calls ``op``: AOTAutograd cannot see through it.

    ATen fused optimizers have registered functional twins, which functionalization
    uses (new tensors plus copies back); an opaque op with mutable arguments is
    wrapped in ``auto_functionalized`` instead, which inductor reinplaces.
    """
    base = torch_compat.op_schema(op).name.split("::", 1)[1].strip("_")
    name = f"{base}_{torch_compat.overload_name(op)}" if torch_compat.overload_name(op) != "default" else base
    schema = str(torch_compat.op_schema(op)).split("(", 1)[1]
    _LIB.define(f"{name}({schema}")

    def impl(*args: Any, **kwargs: Any) -> None:
        op(*args, **kwargs)

    def fake(*args: Any, **kwargs: Any) -> None:
        return None

    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"spmd_lowering::{name}", fake, lib=_LIB)
    return getattr(torch.ops.spmd_lowering, name).default


def for_inductor(gm: fx.GraphModule, *, inline_optimizer: bool = False, gemm: str = "aten") -> fx.GraphModule:
    """``gm`` as inductor gets it: a copy with every ATen fused optimizer op swapped for its
    opaque twin (or, with ``inline_optimizer``, for its math where :func:`_inline_adam` covers
    it) and legacy empty operands dropped from ``cat`` (:func:`_drop_empty_cat_inputs`);
    the float32 CPU ``mm``/``addmm`` that ``inductor_gemm=gemm`` picks (:func:`onednn_nodes`)
    become oneDNN calls (:func:`_onednn_gemms`); ``gm`` itself when nothing applies."""
    from passes.stages import copy_graph

    dnn = onednn_nodes(gm.graph, gemm)  # first: with "auto" every rank runs its collectives
    if not dnn and not any(_is_fused_optimizer(n.target) or _has_empty_cat_input(n) for n in gm.graph.nodes):
        return gm
    graph = copy_graph(gm.graph)  # rewritten before it becomes a GraphModule: one recompile
    copied = {old: new for old, new in zip(gm.graph.nodes, graph.nodes)}
    for n in graph.nodes:
        if n.op == "call_function" and _is_fused_optimizer(n.target):
            inline = _inline_adam(n) if inline_optimizer else None
            n.target = inline or _opaque(n.target)
    _drop_empty_cat_inputs(graph)
    _onednn_gemms(graph, {copied[n] for n in dnn})
    return rebuilt(gm, graph)


# ----------------------------------------------------------------------------- oneDNN matmuls


@torch.library.custom_op("spmd_lowering::onednn_mm", mutates_args=())
def _onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` by oneDNN's matmul (:func:`spmd.backend.gemm_policy.onednn_matmul`)."""
    return gemm_policy.onednn_matmul(a, b, bias)


@_onednn_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


def _onednn_target(n: fx.Node) -> bool:
    """``n`` is a float32 CPU ``mm``/``addmm`` (:func:`spmd.backend.gemm_policy.gemm_of`) of at least
    ``_ONEDNN_MIN_MACS`` multiply-adds: what ``inductor_gemm="onednn"`` sends to oneDNN."""
    g = gemm_policy.gemm_of(n)
    return g is not None and g.m * g.k * g.n >= _ONEDNN_MIN_MACS


def onednn_nodes(graph: fx.Graph, gemm: str) -> set[fx.Node]:
    """The matmul nodes of ``graph`` that ``inductor_gemm=gemm`` sends to oneDNN.

    ``"aten"``: none. ``"onednn"``: every :func:`_onednn_target`. ``"auto"``: those whose shape
    :func:`spmd.backend.gemm_policy.decide` measured faster on oneDNN; it runs on every rank (two
    collectives on the default group when there is one), even with no matmul in the graph.
    """
    if gemm == "aten":
        return set()
    if gemm == "onednn":
        return {n for n in graph.nodes if _onednn_target(n)}
    shapes = {n: g for n in graph.nodes if (g := gemm_policy.gemm_of(n)) is not None}
    decisions = gemm_policy.decide(list(shapes.values()))
    return {n for n, g in shapes.items() if decisions[g].choice == gemm_policy.ONEDNN}


def _onednn_gemms(graph: fx.Graph, nodes: set[fx.Node]) -> None:
    """Swap each ``mm``/``addmm`` of ``nodes`` in ``graph`` for :func:`_onednn_mm` (in place).

    Why: inductor calls ATen's ``mm`` for these, which in torch's x86 builds is MKL's sgemm;
    which library is faster depends on the CPU and the shape (:mod:`spmd.backend.gemm_policy`).
    Legal: the same product in float32 with float32 accumulation; only the summation order
    differs (rounding, like inductor's own fusion). The output is a new contiguous tensor, as
    ``mm``'s is; the graph's later ``view``s only need that.
    """
    for n in [n for n in graph.nodes if n in nodes]:
        args = tuple(n.args) if n.target is torch.ops.aten.mm.default else (n.args[1], n.args[2], n.args[0])
        with graph.inserting_before(n):
            mm = graph.call_function(torch.ops.spmd_lowering.onednn_mm.default, args)
        mm.meta = dict(n.meta)
        n.replace_all_uses_with(mm)
        graph.erase_node(n)


# ----------------------------------------------------------------------------- inline optimizers


def _inline_adam(n: fx.Node) -> Callable[..., None] | None:
    """:func:`_adam_math` for a ``_fused_adam_``/``_fused_adamw_`` node it covers, else None.

    Covered: no amsgrad, no grad scaler. The node keeps its arguments; AOTAutograd traces
    through the Python function (inductor sees its ATen ops), and the in-place updates of
    parameters and state become input mutations that inductor stores straight into them.
    """
    name = torch_compat.op_schema(n.target).name  # type: ignore[union-attr]
    if name not in ("aten::_fused_adam_", "aten::_fused_adamw_"):
        return None
    kw = n.kwargs
    if kw.get("amsgrad") or kw.get("grad_scale") is not None or kw.get("found_inf") is not None:
        return None
    return _adamw_inline if name == "aten::_fused_adamw_" else _adam_inline


def _adam_inline(*args: Any, **kwargs: Any) -> None:
    _adam_math(*args, **kwargs, adamw=False)


def _adamw_inline(*args: Any, **kwargs: Any) -> None:
    _adam_math(*args, **kwargs, adamw=True)


def _adam_math(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    adamw: bool,
) -> None:
    """ATen's CPU fused Adam/AdamW step (``FusedAdamKernel.cpp``), written with ATen ops, in place.

    The same formula in the same order; the bias corrections are computed in float64 from the
    step counter as the fused kernel does. Results differ only by rounding inside inductor's
    fused kernel (vectorised, reassociated), within the inductor backend's tolerance.
    """
    del max_exp_avg_sqs, amsgrad, grad_scale, found_inf  # not covered (see _inline_adam)
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        if maximize:
            g = -g
        if weight_decay != 0:
            if adamw:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g + p * weight_decay
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        s = step.to(torch.float64)
        bias_correction1 = 1 - torch.pow(beta1, s)
        bias_correction2_sqrt = (1 - torch.pow(beta2, s)).sqrt()
        step_size = (lr / bias_correction1).to(p.dtype)
        denom = v.sqrt() / bias_correction2_sqrt.to(p.dtype) + eps
        p.sub_(step_size * m / denom)


# ----------------------------------------------------------------------------- cat of legacy empties


def _legacy_empty(a: Any) -> bool:
    """A 1-D tensor of size 0, which ``aten.cat`` skips whatever ``dim`` (legacy behaviour)."""
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == 0


def _has_empty_cat_input(n: fx.Node) -> bool:
    return (
        n.op == "call_function"
        and n.target is torch.ops.aten.cat.default
        and any(_legacy_empty(a) for a in cast(Sequence[Any], n.args[0]))
    )


def _drop_empty_cat_inputs(graph: fx.Graph) -> None:
    """Drop the legacy empty inputs of every ``cat`` in ``graph`` (in place); a ``cat`` left with
    one input becomes a ``clone`` in the layout eager's ``cat`` gave (``node.meta["val"]``).

    Why: Hugging Face's ``DynamicCache.update`` (``use_cache=True``) runs
    ``cat([torch.tensor([]), k], -2)``. Eager returns a contiguous tensor and the trace
    records ``view``s that rely on it; inductor's ``cat`` decomposition drops the empty
    input and returns ``k.clone()`` in ``k``'s (transposed) layout, and the ``view`` fails.
    Legal: eager's ``cat`` skips such inputs, so the values are the same.
    """
    for n in list(graph.nodes):
        if not _has_empty_cat_input(n):
            continue
        kept = [a for a in n.args[0] if not _legacy_empty(a)]
        if len(kept) != 1:
            if kept:
                n.args = (kept, *n.args[1:])
            continue
        val, x_val = n.meta["val"], kept[0].meta.get("val")
        if val.is_contiguous():
            fmt = torch.contiguous_format
        elif isinstance(x_val, torch.Tensor) and x_val.stride() == val.stride():
            fmt = torch.preserve_format
        else:
            continue  # a layout clone cannot give: leave it to inductor
        with graph.inserting_before(n):
            clone = graph.call_function(torch.ops.aten.clone.default, (kept[0],), {"memory_format": fmt})
        clone.meta = dict(n.meta)
        n.replace_all_uses_with(clone)
        graph.erase_node(n)
