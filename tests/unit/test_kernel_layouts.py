"""spmd's trace sees the memory layouts the CPU kernels return (spmd/frontend/kernel_layouts.py).

Every aten op of a module's forward and backward runs twice, on real tensors and on the trace's
fake tensors, from the same input layout (contiguous, transposed, permuted, channels_last,
channels_last_3d); the strides of every output must agree. With torch's own fake mode the
batch-norm cases fail (its fake kernels keep the input's or the gradient's layout where the CPU
kernels write the suggested memory format). The other modules are here so that a kernel whose
rule changes in a torch release shows up as a failure rather than as a silent fix-up.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from spmd.frontend.kernel_layouts import KernelLayoutFakeMode

C = 8


class _Strides(TorchDispatchMode):
    """Records each op's name with the strides of its tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]], list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = [tuple(a.stride()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [tuple(a.stride()) for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), ins, outs))
        return out


def _input(shape: tuple[int, ...], layout: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if layout == "contiguous":
        return torch.randn(shape, generator=g)
    if layout == "transposed":  # channels last in memory, any rank: dims 1 and -1 swapped
        swapped = (shape[0], shape[-1], *shape[2:-1], shape[1])
        return torch.randn(swapped, generator=g).transpose(1, -1)
    if layout == "permuted":  # 4-D, dims 1 and 2 swapped
        return torch.randn((shape[0], shape[2], shape[1], shape[3]), generator=g).transpose(1, 2)
    fmt = torch.channels_last if layout == "channels_last" else torch.channels_last_3d
    return torch.randn(shape, generator=g).contiguous(memory_format=fmt)


def _ops(module: nn.Module, x: torch.Tensor, fake: bool) -> list[tuple[str, list, list]]:
    rec = _Strides()
    if fake:
        mode = KernelLayoutFakeMode(allow_non_fake_inputs=True)
        with mode:
            x = mode.from_tensor(x)
    x = x.detach().requires_grad_()
    with mode if fake else torch.autograd.set_grad_enabled(True), rec:
        y = module(x)
        torch.autograd.grad(y.float().pow(2).sum(), [x])
    return rec.ops


_1D, _2D, _3D = (4, C, 6), (2, C, 4, 6), (2, C, 3, 4, 5)
MODULES: dict[str, tuple[Any, tuple[int, ...]]] = {
    "batchnorm1d": (lambda: nn.BatchNorm1d(C), _1D),
    "batchnorm1d_eval": (lambda: nn.BatchNorm1d(C).eval(), _1D),
    "batchnorm2d": (lambda: nn.BatchNorm2d(C), _2D),
    "batchnorm3d": (lambda: nn.BatchNorm3d(C), _3D),
    "groupnorm": (lambda: nn.GroupNorm(2, C), _2D),
    "layernorm": (lambda: nn.LayerNorm(6), _1D),
    "conv2d": (lambda: nn.Conv2d(C, C, 3, padding=1), _2D),
    "depthwise_conv2d": (lambda: nn.Conv2d(C, C, 3, padding=1, groups=C), _2D),
    "maxpool2d": (lambda: nn.MaxPool2d(2), _2D),
    "upsample_bilinear": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), _2D),
    "log_softmax": (lambda: nn.LogSoftmax(1), _1D),
    "linear": (lambda: nn.Linear(6, 6), _1D),
}
LAYOUTS = {3: ["contiguous", "transposed"], 4: ["contiguous", "transposed", "permuted", "channels_last"]}
LAYOUTS[5] = ["contiguous", "transposed", "channels_last_3d"]
CASES = [(name, layout) for name, (_, shape) in MODULES.items() for layout in LAYOUTS[len(shape)]]


@pytest.mark.parametrize("name,layout", CASES, ids=[f"{n}-{lay}" for n, lay in CASES])
def test_fake_strides_are_the_kernels(name: str, layout: str) -> None:
    make, shape = MODULES[name]
    real = _ops(make(), _input(shape, layout), fake=False)
    fake = _ops(make(), _input(shape, layout), fake=True)
    # The fake run also records what the fake mode itself dispatches: match ops in order.
    it = iter(fake)
    for op, ins, outs in real:
        got = next((f for f in it if f[0] == op), None)
        assert got is not None, f"{op} not in the fake run"
        real_io, fake_io = (ins, outs), (got[1], got[2])
        assert fake_io == real_io, f"{op}: real (inputs, outputs) strides {real_io}, fake {fake_io}"
