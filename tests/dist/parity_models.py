"""Models of the data-parallel parity tests (beyond the shared ones in tests/models.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models as shared


class NestedWidths(nn.Module):
    """Nested Sequentials of Linear layers of different widths."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Sequential(nn.Linear(8, 24), nn.Tanh()),
            nn.Sequential(nn.Linear(24, 12), nn.ReLU(), nn.Sequential(nn.Linear(12, 20), nn.ReLU())),
            nn.Linear(20, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Uneven(nn.Module):
    """Parameter shapes that do not divide by the world size (7, 3 and 5 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 7)
        self.b = nn.Linear(7, 3)
        self.c = nn.Linear(3, 5)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.c(F.relu(self.b(F.relu(self.a(x)))))))


class TransformerWithSharedParams(nn.Module):
    """The classic FSDP parity model: nn.Transformer, embedding tied to the output
    projection, a BatchNorm1d (buffers mutated in forward) and a long-dtype buffer."""

    def __init__(self, vocab: int = 23, d_model: int = 16, bs: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=2,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=8,
            dropout=0.1,
        )
        self.output_proj = nn.Linear(d_model, vocab)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", self.embed_tokens.weight.new_ones((d_model,)))
        self.register_buffer("long_buffer", torch.zeros_like(self.vocab_bias, dtype=torch.long))
        self.bn = nn.BatchNorm1d(bs)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        src = self.embed_tokens(src_ids) + self.vocab_bias + self.long_buffer.type_as(self.vocab_bias)
        tgt = self.bn(self.embed_tokens(tgt_ids))
        return self.output_proj(self.transformer(src, tgt))


def _seq2seq_batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    src = torch.randint(0, 23, (5, 2), generator=g)
    tgt = torch.randint(0, 23, (4, 2), generator=g)
    y = torch.randint(0, 23, (4, 2), generator=g)
    return src, tgt, y


def _classify(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    idx = torch.randint(0, 64, (2, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


MODELS = {
    "mlp": (shared.MLP, _classify),
    "tinygpt": (shared.TinyGPT, _tokens),
    "llama": (shared.Llama, _tokens),
    "nested": (NestedWidths, _classify),
    "transformer": (TransformerWithSharedParams, _seq2seq_batch),
    "uneven": (Uneven, _classify),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)  # the same initial values on every rank
    return MODELS[name][0]()


def batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """A different batch on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    return MODELS[name][1](g)
