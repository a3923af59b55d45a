"""The foreign-model sweep at world size 2: models we did not write (tests/sweep_models.py:
Hugging Face BERT/T5/ViT/Qwen2/Mistral/GPT-NeoX, torch's FSDP test models, a seq-first
nn.TransformerEncoder, and nets with channels_last convs, permuted norms, RNNs, parametrizations,
activation checkpointing, buffers written in forward, dropout, dict/tuple/dataclass outputs)
compiled in replicate and fully_shard against DDP (and FSDP2 where its semantics agree), bit for
bit on the step outputs, parameters and buffers, different data on each rank.

One spawned job per style (process start and imports are the expensive part). To fit the suite
budget, the cheap models run in both styles and the expensive ones (Hugging Face, the
nn.Transformer ones, the RNNs: 5-20 s each on a loaded 2-core machine) in one style each,
alternating; the optimizer alternates between SGD momentum and fused AdamW. ``SPMD_SWEEP_FULL=1``
runs every model in both styles with both optimizers (the sweep as first run: all passed after
the fixes below; about 10 minutes).
What the sweep found is pinned by tests of its own (tests/unit/test_tracing.py: checkpointed
dropout, LSTM/GRU; the Embedding(max_norm) refusal runs here).
"""

from __future__ import annotations

import os

import pytest

from tests import sweep_models as S
from tests.dist import workers_sweep as w
from tests.dist.launcher import run_ranks

OPTIMIZERS = ("sgd_momentum_foreach", "adamw_fused")


EXPENSIVE = ("hf_", "fsdp_transformer_shared", "seq_first_encoder", "recurrent_mha_frozen")
STYLES = ("replicate", "fully_shard")


def _selected() -> list[str]:
    """The models to sweep: ``SPMD_SWEEP_MODELS`` (comma-separated names) if set, else all of them."""
    names = [n for n in S.MODELS if S.HAS_TRANSFORMERS or not n.startswith("hf_")]
    wanted = os.environ.get("SPMD_SWEEP_MODELS")
    if not wanted:
        return names
    chosen = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in S.MODELS]
    assert not unknown, f"SPMD_SWEEP_MODELS names unknown models {unknown}; known: {list(S.MODELS)}"
    return [n for n in names if n in chosen]


def _cases(style: str) -> list[tuple[str, str, str]]:
    names = _selected()
    if os.environ.get("SPMD_SWEEP_FULL"):
        return [(n, style, o) for n in names for o in OPTIMIZERS]
    cheap = [n for n in names if not n.startswith(EXPENSIVE)]
    dear = [n for n in names if n.startswith(EXPENSIVE)]
    k = STYLES.index(style)
    return [(n, style, OPTIMIZERS[(i + k) % 2]) for i, n in enumerate(cheap)] + [
        (n, style, OPTIMIZERS[(i // 2) % 2]) for i, n in enumerate(dear) if i % 2 == k
    ]


@pytest.mark.parametrize("style", STYLES)
def test_foreign_models_match_ddp(style: str) -> None:
    results = run_ranks(w.sweep, 2, _cases(style), 3, timeout=600)
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
