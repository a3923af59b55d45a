"""Models whose tensors change memory layout mid-step, for the layout tests.

Each one sends a transposed, permuted, channels_last, unfolded or expanded tensor
into an op whose real kernel may return (or need) a layout other than the one its
meta function promised at trace time (tests/unit/test_layouts.py at world size 1,
tests/dist/test_layouts.py at world size 2). Every model maps its batch to
``(batch, N_CLASSES)`` logits; ``batch(name, g)`` makes one ``(x, y)`` for it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

N_CLASSES = 4
_B, _T, _C = 4, 6, 8  # batch, sequence length, channels
_H = _W = 6
_P = 0.5  # dropout probability of the *_dropout models


class TransposedNorm(nn.Module):
    """``(B, T, C)`` -> Linear -> transpose(1, 2) -> ``norm`` over channels (-> dropout) ->
    transpose back -> Linear."""

    def __init__(self, norm: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(_C, _C)
        self.norm = norm
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.out = nn.Linear(_C, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.drop(self.norm(h.transpose(1, 2))).transpose(1, 2)
        return self.out(F.relu(h + x)).mean(1)


class PermutedNorm2d(nn.Module):
    """``(B, H, W, C)`` -> Linear -> permute to NCHW -> ``norm`` (-> dropout) -> permute back -> Linear."""

    def __init__(self, norm: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.inp = nn.Linear(_C, _C)
        self.norm = norm
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.out = nn.Linear(_C, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.inp(x).permute(0, 3, 1, 2))).permute(0, 2, 3, 1)
        return self.out(F.gelu(h)).mean((1, 2))


class TransposedLayerNorm(nn.Module):
    """``(B, C, T)`` -> transpose -> LayerNorm(C) -> transpose back -> Conv1d -> pool -> Linear."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(_C)
        self.conv = nn.Conv1d(_C, _C, 3, padding=1)
        self.out = nn.Linear(_C, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x.transpose(1, 2)).transpose(1, 2)
        return self.out(self.conv(h).mean(2))


class ChannelsLastConvBN(nn.Module):
    """A conv net in channels_last memory format, BatchNorm2d between the convolutions
    (dropout after each convolution when ``dropout``)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.c1 = nn.Conv2d(3, _C, 3, padding=1)
        self.bn = nn.BatchNorm2d(_C)
        self.c2 = nn.Conv2d(_C, _C, 3, padding=1)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.out = nn.Linear(_C * _H * _W, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.drop(self.c1(x.contiguous(memory_format=torch.channels_last)))))
        return self.out(self.drop(self.c2(h)).flatten(1))


class Unfold(nn.Module):
    """Image -> F.unfold patches -> transpose -> Linear per patch -> BatchNorm1d over patches."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3 * 4, _C)
        self.bn = nn.BatchNorm1d(_C)
        self.out = nn.Linear(_C, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = F.unfold(x, kernel_size=2, stride=2).transpose(1, 2)  # (B, patches, 12)
        h = self.bn(self.proj(p).transpose(1, 2)).transpose(1, 2)
        return self.out(h).mean(1)


class ExpandView(nn.Module):
    """An expanded (stride-0) tensor, made contiguous by a norm, then viewed and fed to Linear."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(_C, _C)
        self.bn = nn.BatchNorm1d(_C)
        self.out = nn.Linear(_C * 3, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).unsqueeze(2).expand(-1, -1, 3)  # (B, C, 3), stride 0 in the last dim
        h = self.bn(h) * 1.5
        return self.out(h.transpose(1, 2).reshape(x.shape[0], -1))


class AsStrided(nn.Module):
    """Overlapping windows taken with as_strided from a normalised transposed tensor.

    ``contiguous()`` first, so the windows are defined whatever layout BatchNorm returns; the
    trace drops that ``contiguous()`` (the fake output looked contiguous) and the real one
    is not, so without a fix-up ``as_strided`` reads the wrong elements.
    """

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(_C, _C)
        self.bn = nn.BatchNorm1d(_C)
        self.out = nn.Linear(_C * 2, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.inp(x).transpose(1, 2)).transpose(1, 2).contiguous()  # (B, T, C)
        b, t, c = h.shape
        w = h.as_strided((b, t - 1, 2 * c), (t * c, c, 1))  # windows of two steps
        return self.out(w).mean(1)


def _seq(g: torch.Generator) -> torch.Tensor:
    return torch.randn(_B, _T, _C, generator=g)


def _chw(g: torch.Generator) -> torch.Tensor:
    return torch.randn(_B, _C, _T, generator=g)


def _hwc(g: torch.Generator) -> torch.Tensor:
    return torch.randn(_B, _H, _W, _C, generator=g)


def _image(g: torch.Generator) -> torch.Tensor:
    return torch.randn(_B, 3, _H, _W, generator=g)


# name -> (builder, input maker)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], torch.Tensor]]] = {
    "transpose_batchnorm1d": (lambda: TransposedNorm(nn.BatchNorm1d(_C)), _seq),
    "permute_batchnorm2d": (lambda: PermutedNorm2d(nn.BatchNorm2d(_C)), _hwc),
    "transpose_conv1d": (lambda: TransposedNorm(nn.Conv1d(_C, _C, 3, padding=1)), _seq),
    "permute_conv2d": (lambda: PermutedNorm2d(nn.Conv2d(_C, _C, 3, padding=1)), _hwc),
    "transpose_layernorm": (TransposedLayerNorm, _chw),
    "transpose_groupnorm": (lambda: TransposedNorm(nn.GroupNorm(2, _C)), _seq),
    "permute_groupnorm": (lambda: PermutedNorm2d(nn.GroupNorm(4, _C)), _hwc),
    "transpose_instancenorm": (lambda: TransposedNorm(nn.InstanceNorm1d(_C, affine=True)), _seq),
    "permute_instancenorm2d": (lambda: PermutedNorm2d(nn.InstanceNorm2d(_C, affine=True)), _hwc),
    "channels_last_conv_bn": (ChannelsLastConvBN, _image),
    # the model itself in channels_last: conv weights with channels-last strides
    "channels_last_model": (lambda: ChannelsLastConvBN().to(memory_format=torch.channels_last), _image),
    "unfold": (Unfold, _image),
    "expand_view": (ExpandView, lambda g: torch.randn(_B, _C, generator=g)),
    "as_strided": (AsStrided, _seq),
    # dropout right after a kernel that may return another layout than traced: the mask must
    # be eager's, element for element (the step is run under the same seed as eager's)
    "transpose_batchnorm1d_dropout": (lambda: TransposedNorm(nn.BatchNorm1d(_C), _P), _seq),
    "transpose_conv1d_dropout": (lambda: TransposedNorm(nn.Conv1d(_C, _C, 3, padding=1), _P), _seq),
    "permute_batchnorm2d_dropout": (lambda: PermutedNorm2d(nn.BatchNorm2d(_C), _P), _hwc),
    "permute_groupnorm_dropout": (lambda: PermutedNorm2d(nn.GroupNorm(4, _C), _P), _hwc),
    "channels_last_conv_bn_dropout": (lambda: ChannelsLastConvBN(_P), _image),
}
# Models with dropout: their steps draw random numbers (seed before each step to compare).
DROPOUT = {name for name in MODELS if name.endswith("_dropout")}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def batch(name: str, g: torch.Generator, n: int = _B) -> tuple[torch.Tensor, torch.Tensor]:
    x = MODELS[name][1](g)
    if n != x.shape[0]:
        x = torch.cat([x, MODELS[name][1](g)])[:n]
    return x, torch.randint(0, N_CLASSES, (x.shape[0],), generator=g)


class RandomLayoutModel(nn.Module):
    """A random chain of layout-changing blocks on a ``(B, T, C)`` tensor (property tests).

    ``ops`` names the blocks in order: ``"t"`` (transpose, an op on ``(B, C, T)``, transpose
    back), ``"p"`` (a 4-D permute round trip), ``"c"`` (contiguous copy), ``"lin"``.
    """

    BLOCKS = ("bn", "conv", "gn", "in", "ln", "p_bn", "lin", "relu")

    def __init__(self, ops: list[str], seed: int = 0):
        super().__init__()
        rng = random.Random(seed)
        self.ops = list(ops)
        layers: list[nn.Module] = []
        for op in self.ops:
            if op == "bn":
                layers.append(nn.BatchNorm1d(_C))
            elif op == "conv":
                layers.append(nn.Conv1d(_C, _C, rng.choice([1, 3]), padding="same"))
            elif op == "gn":
                layers.append(nn.GroupNorm(rng.choice([1, 2, 4]), _C))
            elif op == "in":
                layers.append(nn.InstanceNorm1d(_C, affine=True))
            elif op == "ln":
                layers.append(nn.LayerNorm(_T))  # over the (transposed) time dim
            elif op == "p_bn":
                layers.append(nn.BatchNorm2d(_C))
            elif op == "lin":
                layers.append(nn.Linear(_C, _C))
            else:
                layers.append(nn.ReLU())
        self.layers = nn.ModuleList(layers)
        self.out = nn.Linear(_C, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        for op, layer in zip(self.ops, self.layers):
            if op in ("bn", "conv", "gn", "in", "ln"):
                x = layer(x.transpose(1, 2)).transpose(1, 2)
            elif op == "p_bn":
                x4 = x.reshape(b, t // 2, 2, c).permute(0, 3, 1, 2)
                x = layer(x4).permute(0, 2, 3, 1).reshape(b, t, c)
            else:
                x = layer(x)
        return self.out(x).mean(1)
