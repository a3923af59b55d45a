"""The benchmark models, their per-rank batches, and the blocks FSDP2 wraps.

* ``overhead``: many tiny residual MLP blocks. Each step is a few hundred small ops and,
  sharded per block, dozens of small collectives: per-op and per-collective overhead
  (Python hooks, launches) dominates. This is where a whole-step graph should win most.
* ``gpt``: the GPT of ``examples/gpt.py`` (token + position embeddings, pre-norm blocks,
  untied head). Matmuls dominate; communication should hide behind them.
* ``encoder``: a model we did not write: torch's own ``nn.TransformerEncoder`` (pre-norm layers,
  ``batch_first``) between a token embedding and a linear head (issue 25).

Every variant builds its model with the same seed (same initial weights) and feeds rank
``r`` the same batches (seeded by ``r``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "examples"))
from gpt import GPT  # noqa: E402


class ResBlock(nn.Module):
    """``x + fc2(gelu(fc1(ln(x))))``."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ResMLP(nn.Module):
    """A stack of residual MLP blocks and a linear classifier."""

    def __init__(self, n_blocks: int, d: int, hidden: int, n_classes: int):
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(d, hidden) for _ in range(n_blocks)])
        self.head = nn.Linear(d, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class Encoder(nn.Module):
    """Token embedding -> ``nn.TransformerEncoder`` (norm_first, batch_first, dropout 0) -> linear head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
        # enable_nested_tensor only matters for the eval fast path, which norm_first disables anyway.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.encoder.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


@dataclasses.dataclass(frozen=True)
class Spec:
    """One benchmark model: how to build it, its batches, and its loss."""

    name: str
    description: str  # for the table header
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The submodules FSDP2 shards one by one (then the root), as one would per transformer block."""
        return list(model.blocks)  # type: ignore[arg-type]

    def train_step(self) -> Callable[..., torch.Tensor]:
        """The plain single-device step on this model's loss: forward, backward, update."""
        loss_fn = self.loss

        def train_step(model, optim, x, y):  # noqa: ANN001, ANN202
            loss = loss_fn(model(x), y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss

        return train_step


def _xent(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def get(name: str, quick: bool = False) -> Spec:
    """The spec of model ``name``; ``quick`` shrinks it (same structure) for smoke runs."""
    if name == "overhead":
        n, d, batch, classes = (24, 64, 32, 64) if not quick else (24, 32, 16, 16)
        return Spec(
            name="overhead",
            description=f"ResMLP {n} blocks x d_model {d} (hidden {4 * d}), batch {batch} per rank",
            build=lambda: ResMLP(n, d, 4 * d, classes),
            batch=lambda g: (
                torch.randn(batch, d, generator=g),
                torch.randint(classes, (batch,), generator=g),
            ),
            loss=_xent,
        )
    if name == "gpt":
        layers, d, heads, vocab, seq, batch = (
            (4, 256, 8, 8192, 128, 8) if not quick else (2, 64, 4, 512, 32, 4)
        )

        def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            t = torch.randint(vocab, (batch, seq + 1), generator=g)
            return t[:, :-1].contiguous(), t[:, 1:].contiguous()

        return Spec(
            name="gpt",
            description=(
                f"GPT {layers} layers x d_model {d}, {heads} heads, vocab {vocab}, seq {seq}, "
                f"batch {batch} per rank"
            ),
            build=lambda: GPT(vocab, d, layers, heads, seq),
            batch=tokens,
            loss=_xent,
        )
    if name == "encoder":
        layers, d, heads, ffn, vocab, seq, batch = (
            (4, 256, 4, 1024, 4096, 128, 8) if not quick else (2, 64, 4, 128, 512, 32, 4)
        )
        return Spec(
            name="encoder",
            description=(
                f"nn.TransformerEncoder {layers} layers x d_model {d}, {heads} heads, ffn {ffn}, "
                f"norm_first; embedding {vocab} -> linear head; seq {seq}, batch {batch} per rank"
            ),
            build=lambda: Encoder(vocab, d, layers, heads, ffn),
            batch=lambda g: (
                torch.randint(vocab, (batch, seq), generator=g),
                torch.randint(vocab, (batch, seq), generator=g),
            ),
            loss=_xent,
        )
    raise KeyError(f"unknown model {name!r}; the models are {MODELS}")


MODELS = ("overhead", "gpt", "encoder")
