"""Tiny models, optimizers and data shared by the tests.

Every model is small enough that ten compiled-vs-eager steps take well under a
second once traced. ``twin`` gives two identical copies (compiled and eager side),
``make_optimizer`` builds the optimizers of the parity matrix by name, and
``batch`` makes a fresh random batch per step from a seeded generator, so the two
sides see the same data and no global RNG state is touched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# ----------------------------------------------------------------------------- models


class MLP(nn.Module):
    """Linear layers inside a Sequential (module paths "net.0", "net.2")."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, n_classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DropoutMLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, n_classes: int = 4, p: float = 0.5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(d_hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token + position embedding, pre-LN blocks, causal SDPA, head tied to the token embedding.

    ``checkpoint=True``: each block runs under ``torch.utils.checkpoint`` (non-reentrant, or
    ``reentrant=True``), as a user trades compute for memory: its forward runs again in backward.
    """

    def __init__(
        self,
        vocab: int = 64,
        d_model: int = 32,
        n_layers: int = 2,
        n_heads: int = 4,
        seq: int = 16,
        checkpoint: bool = False,
        reentrant: bool = False,
    ):
        super().__init__()
        self.checkpoint, self.reentrant = checkpoint, reentrant
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=self.reentrant)
            else:
                x = blk(x)
        return self.head(self.ln_f(x))


class MaskedBlock(Block):
    """Block with an explicit attention mask instead of ``is_causal``, as Hugging Face's
    ``attn_implementation="sdpa"`` passes one: causal and not-padding, ``[B, heads, T, T]``
    (``heads`` 1: broadcast over the heads). Separate q, k, v projections (as Llama's), so
    column-parallel weights shard the attention's heads."""

    def __init__(self, d_model: int, n_heads: int, mask_heads: int):
        super().__init__(d_model, n_heads)
        del self.qkv
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.mask_heads = mask_heads

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            lin(h).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for lin in (self.q, self.k, self.v)
        )
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None])[None, None] & keep[:, None, None, :]
        mask = mask.expand(b, self.mask_heads, t, t)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MaskedGPT(TinyGPT):
    """TinyGPT whose blocks take a boolean ``[B, mask_heads, T, T]`` mask built from the input
    batch (token 0 is padding a query does not attend to, unless it is the first one)."""

    def __init__(self, mask_heads: int = 1, **kw: int):
        super().__init__(**kw)
        d, h = self.tok.embedding_dim, self.blocks[0].n_heads
        self.blocks = nn.ModuleList(MaskedBlock(d, h, mask_heads) for _ in self.blocks)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        keep = (idx != 0) | (pos == 0)  # the first key is always kept: no query's row is empty
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x, keep)
        return self.head(self.ln_f(x))


class ConvBN(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> pool -> Linear (BN running stats are buffers)."""

    def __init__(self, channels: int = 3, width: int = 8, n_classes: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(channels, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(h.mean(dim=(2, 3)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (b, h, t, hd) by angles of shape (t, hd / 2), in the
    dtype of ``cos``/``sin`` when that is wider (type promotion), returned in ``x``'s dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class LlamaLayer(nn.Module):
    """Pre-RMSNorm decoder layer: causal attention with rotary q/k, then a SwiGLU MLP."""

    def __init__(self, d_model: int, n_heads: int, d_hidden: int):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = RMSNorm(d_model)
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.mlp_norm = RMSNorm(d_model)
        self.w1 = nn.Linear(d_model, d_hidden, bias=False)
        self.w3 = nn.Linear(d_model, d_hidden, bias=False)
        self.w2 = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """A small Llama: the rotary ``cos``/``sin`` are computed once at the root in fp32 and
    passed to every layer as forward arguments (so per-layer input casts matter under mixed
    precision, as in torchtitan's Llama)."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_layers: int = 2, n_heads: int = 4):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.tok = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(LlamaLayer(d_model, n_heads, 2 * d_model) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        hd, t = self.head_dim, idx.shape[1]
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32, device=idx.device) / hd))
        angles = torch.outer(torch.arange(t, dtype=torch.float32, device=idx.device), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


class FrozenUnused(nn.Module):
    """One frozen parameter (``scale``, requires_grad=False) and one unused in forward (``unused``)."""

    def __init__(self, d_in: int = 8, n_classes: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, 16)
        self.fc2 = nn.Linear(16, n_classes)
        self.scale = nn.Parameter(torch.full((16,), 0.5), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)) * self.scale)


# ----------------------------------------------------------------------------- data

# model name -> (constructor, batch maker(generator, batch size) -> (input, target))
_BATCH = 4


def _classify_batch(g: torch.Generator, n: int = _BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _image_batch(g: torch.Generator, n: int = _BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def _token_batch(g: torch.Generator, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, 64, (n, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., tuple[torch.Tensor, torch.Tensor]]]] = {
    "mlp": (MLP, _classify_batch),
    "tinygpt": (TinyGPT, _token_batch),
    "llama": (Llama, _token_batch),
    "convbn": (ConvBN, _image_batch),
    "frozen_unused": (FrozenUnused, _classify_batch),
    "dropout": (DropoutMLP, _classify_batch),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def twin(model: nn.Module) -> nn.Module:
    """An identical, independent copy (for the eager side of a parity test)."""
    return copy.deepcopy(model)


def batches(name: str, steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` different random batches for model ``name``."""
    g = torch.Generator().manual_seed(seed)
    return [MODELS[name][1](g) for _ in range(steps)]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------- optimizers


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizers of the parity matrix, by name."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "sgd_momentum_foreach":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
    if name == "sgd_momentum_fused":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
    if name == "sgd_nesterov_wd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, foreach=True)
    if name == "sgd_default":
        return torch.optim.SGD(params, lr=0.05, foreach=False)
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=1e-2, fused=True)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if name == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    if name == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-2, foreach=True)
    if name == "adamw_forloop":  # the single-tensor (for-loop) implementation
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    if name == "adam_two_groups":
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.Adam(
            [
                {"params": decay, "lr": 1e-2, "weight_decay": 1e-2},
                {"params": no_decay, "lr": 3e-3, "weight_decay": 0.0},
            ],
            foreach=True,
        )
    raise KeyError(name)


# Optimizers whose traced math is identical to eager's (bit-for-bit); the rest take the
# `capturable` path while tracing (see spmd/frontend/optim.py) and are compared with a tolerance.
EXACT_OPTIMIZERS = frozenset(
    {
        "sgd_momentum_foreach",
        "sgd_momentum_fused",
        "sgd_nesterov_wd",
        "sgd_default",
        "adam_fused",
        "adamw_fused",
    }
)
OPTIMIZERS = (*sorted(EXACT_OPTIMIZERS), "adamw_foreach", "adam_two_groups")


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The plain single-device step every parity test compiles."""
    loss = loss_fn(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def loss_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """A step on a model whose forward returns the loss itself."""
    loss = model(x)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss
