"""Built-in example models for ``python -m spmd.simulate``: GPT-2 shapes and a tiny one.

A small GPT (token + position embeddings, pre-LayerNorm blocks with causal SDPA and
a GELU MLP, final LayerNorm, head tied to the token embedding, as GPT-2 does) and
the plain train step every example compiles. ``build`` can make the model under a
``FakeTensorMode``, so simulating GPT-2 small at any world size needs no memory for
its weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int  # vocabulary size (rows of the token embedding and of the tied head)
    seq: int  # context length (rows of the position embedding), the default tokens per sequence
    d_model: int  # width
    n_layers: int  # transformer blocks
    n_heads: int  # attention heads per block


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab=64, seq=16, d_model=32, n_layers=2, n_heads=4),
    "gpt2-small": GPTConfig(vocab=50257, seq=1024, d_model=768, n_layers=12, n_heads=12),
    "gpt2-medium": GPTConfig(vocab=50257, seq=1024, d_model=1024, n_layers=24, n_heads=16),
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def train_step(
    model: nn.Module, optim: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor
) -> Any:
    """Next-token cross entropy, backward, optimizer step: the step the examples compile."""
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def build(
    name: str, *, batch: int = 1, seq: int | None = None, fake: bool = True
) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """(model, fused AdamW, idx, targets) for a built-in config; ``fake``: weights take no memory."""
    if name not in CONFIGS:
        raise KeyError(f"unknown model {name!r}; the built-in models are {sorted(CONFIGS)}")
    cfg = CONFIGS[name]
    seq = cfg.seq if seq is None else seq
    if seq > cfg.seq:
        raise ValueError(f"seq {seq} exceeds {name}'s context length {cfg.seq}")
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, optim, idx, idx.clone()
