"""Fake tensors on the CPU take the memory layout the CPU kernels really return.

The trace runs every op on fake tensors, whose strides come from each op's meta function.
Where the real kernel returns another layout, the difference does not stay in the strides:
composite ops branch on them while the trace decomposes them, so the graph records another
computation than eager runs. Measured on this CPU build (torch 2.13): ``aten.linear`` on a 3-D
input takes ``addmm`` on a flattened view when the input is contiguous and ``matmul`` + ``add``
otherwise; after a ``BatchNorm1d`` on a transposed input the fake said contiguous, the kernel
said not, and the bias gradient was summed over another shape (last bit different from eager,
``tests/unit/test_layouts.py``). :func:`passes.layouts.fix_layouts` keeps the replayed graph's
values right, but it cannot undo a branch the trace took.

So the trace's fake mode, :class:`KernelLayoutFakeMode`, gives the ops whose CPU kernels choose
their own layout that layout. Found by comparing fake and real strides of the norm,
convolution, pooling, upsampling, softmax and linear modules' forward and backward ops on
contiguous, transposed, permuted, channels_last and channels_last_3d inputs
(``tests/unit/test_kernel_layouts.py`` keeps that comparison): only batch norm differs. Its CPU
kernels allocate their output in the input's suggested memory format (``channels_last`` for an
NHWC-strided 4-D input, ``channels_last_3d`` for 5-D, contiguous otherwise), forward and backward
alike, where torch's fake kernels follow the input's strides (forward) or the output gradient's
(backward). Fake tensors on other devices keep torch's rule (their kernels have their own, and
``fix_layouts`` checks the first real run wherever the graph runs). Only spmd's traces use this
mode; torch's own fake tensors elsewhere in the process are untouched.

Rules about other things than layouts: ``aten._grouped_mm`` in float32/float16, which torch's
meta kernel refuses and the CPU kernel computes (:meth:`KernelLayoutFakeMode._grouped_mm`), and
the CTC loss's forward and backward, which have no fake kernel (:mod:`spmd.frontend.ctc`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from passes import torch_compat
from passes.torch_compat import (
    FakeTensor,
    FakeTensorMode,
    HigherOrderOperator,
    OpOverload,
    suggest_memory_format,
)
from spmd.frontend import ctc

aten = torch.ops.aten

# Batch-norm ops whose CPU kernel writes its first output in the suggested memory format of
# this argument (the input; the backward's second argument).
# (and, from torch 2.14 on, group norm: passes.torch_compat.CPU_SUGGESTED_FORMAT_NORM_OPS).
BATCH_NORM_OPS: dict[OpOverload, int] = torch_compat.CPU_SUGGESTED_FORMAT_NORM_OPS

# Ops with a rule of this mode that is not about layouts (dtype, shapes: the docstring's end).
_OTHER_RULES = frozenset({aten._grouped_mm.default, aten._ctc_loss.Tensor, aten._ctc_loss_backward.Tensor})


class KernelLayoutFakeMode(FakeTensorMode):
    """A fake mode whose CPU batch-norm outputs have the real kernels' layout (module docstring)."""

    # Off only under :func:`torch_fake_layouts`.
    rules_on = True
    # Higher-order operators (auto_functionalized, checkpoint's wrappers, ...) find their fake
    # rule by the mode's exact type: this mode hands them FakeTensorMode's (__torch_dispatch__).
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, HigherOrderOperator):
            rule = func.python_key_table.get(FakeTensorMode)
            if rule is None:
                raise NotImplementedError(f"no fake-tensor rule for the higher-order operator {func.name()}")
            return rule(self, *args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _cached_dispatch_impl(
        self, func: Any, types: Sequence[type], args: Sequence[object], kwargs: Mapping[str, object]
    ) -> Any:
        # torch's dispatch cache is shared by every fake mode in the process and knows nothing
        # of this one's rule: these ops bypass it both ways.
        if (func in BATCH_NORM_OPS and KernelLayoutFakeMode.rules_on) or func in _OTHER_RULES:
            return self._dispatch_impl(func, types, args, kwargs)
        return super()._cached_dispatch_impl(func, types, args, kwargs)

    def _dispatch_impl(
        self, func: Any, types: Sequence[type], args: Sequence[object], kwargs: Mapping[str, object]
    ) -> Any:
        if func is aten._grouped_mm.default:
            return self._grouped_mm(func, types, args, kwargs)
        if func is aten._ctc_loss.Tensor:
            with self:
                return ctc.fake_ctc_loss(args[0], args[1])  # type: ignore[arg-type]
        if func is aten._ctc_loss_backward.Tensor:
            with self:
                return ctc.fake_ctc_loss_backward(args[1])  # type: ignore[arg-type]
        out: Any = super()._dispatch_impl(func, types, args, kwargs)
        which = BATCH_NORM_OPS.get(func)
        if which is None or not KernelLayoutFakeMode.rules_on:
            return out
        x = args[which] if which < len(args) else None
        if not isinstance(x, FakeTensor) or x.fake_device.type != "cpu":
            return out
        fmt = suggest_memory_format(x)
        first = out[0]
        if first.is_contiguous(memory_format=fmt):
            return out
        with self:
            first = torch.empty(first.shape, dtype=first.dtype, device=first.device, memory_format=fmt)
        return (first, *out[1:])

    def _grouped_mm(
        self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> Any:
        """``aten._grouped_mm`` in float32/float16: torch's meta kernel accepts only bfloat16
        (the check of the CUDA kernel of an earlier release), while the CPU kernel computes in any
        floating dtype, and Hugging Face's ``grouped_mm`` experts call it in float32 on the CPU
        when not compiling (eager's path, which the trace now takes). The shape and layout are
        the bfloat16 ones; the dtype is the inputs'. A kernel that refuses the dtype refuses it
        in eager as well (and at the first run here: ``KernelError``)."""
        a, b = args[0], args[1]
        out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
        if not (
            isinstance(a, FakeTensor)
            and isinstance(b, FakeTensor)
            and a.dtype == b.dtype
            and a.dtype in (torch.float32, torch.float16)
            and out_dtype in (None, a.dtype)
        ):
            return super()._dispatch_impl(func, types, args, kwargs)
        with self:
            a16 = torch.empty_strided(a.shape, a.stride(), dtype=torch.bfloat16, device=a.device)
            b16 = torch.empty_strided(b.shape, b.stride(), dtype=torch.bfloat16, device=b.device)
        rest = {k: v for k, v in kwargs.items() if k != "out_dtype"}
        out: Any = super()._dispatch_impl(func, types, (a16, b16, *args[2:4]), rest)
        with self:
            return torch.empty_strided(out.shape, out.stride(), dtype=a.dtype, device=out.device)


@contextlib.contextmanager
def torch_fake_layouts() -> Iterator[None]:
    """Trace with torch's own fake layouts (the rules above off): for tests, it makes the
    batch-norm models stand for a kernel whose layout no rule here knows (a GPU's, a custom
    op's), which the first run's ``fix_layouts`` must then handle."""
    KernelLayoutFakeMode.rules_on = False
    try:
        yield
    finally:
        KernelLayoutFakeMode.rules_on = True
