"""The foreign-model sweep at world size 2: models we did not write (tests/sweep_models.py:
Hugging Face BERT/T5/ViT/Qwen2/Mistral/GPT-NeoX/Mixtral (and, in the full sweep, GPT-2, Gemma,
Gemma2, Phi-3, OPT, BLOOM, Falcon, Qwen2-MoE, RoBERTa, DistilBERT, Whisper), torch's FSDP test
models, a seq-first nn.TransformerEncoder, and nets with channels_last convs, permuted norms, RNNs,
parametrizations, activation checkpointing, buffers written in forward, dropout,
dict/tuple/dataclass outputs)
compiled in replicate and fully_shard against DDP (and FSDP2 where its semantics agree), bit for
bit on the step outputs, parameters and buffers, different data on each rank.

One spawned job per style (process start and imports are the expensive part; with
``SPMD_SWEEP_FULL`` one per ``CASES_PER_JOB`` cases, to stay under pytest's timeout). To fit the suite
budget, the cheap models run in both styles and the expensive ones (Hugging Face, the
nn.Transformer ones, the RNNs: 5-20 s each on a loaded 2-core machine) in one style each,
alternating; the optimizer alternates between SGD momentum and fused AdamW. ``SPMD_SWEEP_FULL=1``
runs every model in both styles with both optimizers (the sweep as first run: all passed after
the fixes below; about 10 minutes, plus about 16 for the models of ``FULL_ONLY``, measured under
load);
``SPMD_SWEEP_MODELS=hf_gpt2,hf_opt`` sweeps only the models named.
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


# Swept only with SPMD_SWEEP_FULL=1 or when named in SPMD_SWEEP_MODELS (suite budget): each passed the
# full sweep when added (both styles, both optimizers, bit for bit with DDP and FSDP2) and exercises
# nothing the suite's models do not (10-25 s each on the loaded machine). hf_mixtral stays in the
# suite: expert weights as 3-D parameters sharded on the expert dim, grouped_mm, the router's aux loss.
FULL_ONLY = {
    "hf_gpt2": "Conv1D (transposed weights), tied head: like hf_qwen2 and tied_lm_buffers_dropout",
    "hf_gemma": "scaled embeddings, tied head: Llama-like",
    "hf_gemma2": "softcapping, sliding window, eager attention: elementwise ops, like hf_mistral",
    "hf_phi3": "fused qkv / gate_up: plain Linears",
    "hf_opt": "learned positions, dropout: like hf_bert",
    "hf_bloom": "alibi in eager attention: elementwise ops and baddbmm",
    "hf_falcon_alibi": "alibi with sdpa: an explicit float mask, like hf_bert's padding mask",
    "hf_qwen2_moe": "MoE like hf_mixtral, plus a shared expert",
    "hf_roberta": "BERT-like",
    "hf_distilbert": "BERT-like",
    "hf_whisper": "encoder-decoder like hf_t5, Conv1d front end like vision_ops",
}


# Expensive models run in the style (and with the optimizer) where they test the most, not alternated:
# Mixtral's expert weights sharded, against FSDP2 as well as DDP (SGD).
PINNED = {"hf_mixtral": ("fully_shard", "sgd_momentum_foreach")}


def _selected() -> list[str]:
    """The models to sweep: ``SPMD_SWEEP_MODELS`` (comma-separated names) if set; else every model
    with ``SPMD_SWEEP_FULL``, and all but :data:`FULL_ONLY` without it."""
    names = [n for n in S.MODELS if S.HAS_TRANSFORMERS or not n.startswith("hf_")]
    wanted = os.environ.get("SPMD_SWEEP_MODELS")
    if not wanted:
        return names if os.environ.get("SPMD_SWEEP_FULL") else [n for n in names if n not in FULL_ONLY]
    chosen = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in S.MODELS]
    assert not unknown, f"SPMD_SWEEP_MODELS names unknown models {unknown}; known: {list(S.MODELS)}"
    return [n for n in names if n in chosen]


def _cases(style: str) -> list[tuple[str, str, str]]:
    names = _selected()
    if os.environ.get("SPMD_SWEEP_FULL"):
        return [(n, style, o) for n in names for o in OPTIMIZERS]
    cheap = [n for n in names if not n.startswith(EXPENSIVE)]
    dear = [n for n in names if n.startswith(EXPENSIVE) and n not in PINNED]
    k = STYLES.index(style)
    return (
        [(n, style, OPTIMIZERS[(i + k) % 2]) for i, n in enumerate(cheap)]
        + [(n, style, OPTIMIZERS[(i // 2) % 2]) for i, n in enumerate(dear) if i % 2 == k]
        + [(n, style, opt) for n, (s, opt) in PINNED.items() if s == style and n in names]
    )


# With SPMD_SWEEP_FULL, one spawned job per this many cases: about 250 s on the loaded machine,
# under pytest's 300 s timeout (pyproject.toml). The suite's sweep is one job per style.
CASES_PER_JOB = 10


def _jobs(style: str) -> list[list[tuple[str, str, str]]]:
    cases = _cases(style)
    if not os.environ.get("SPMD_SWEEP_FULL"):
        return [cases]
    return [cases[i : i + CASES_PER_JOB] for i in range(0, len(cases), CASES_PER_JOB)] or [[]]


@pytest.mark.parametrize(
    ("style", "job"),
    [(s, j) for s in STYLES for j in range(len(_jobs(s)))],
    ids=lambda v: v if isinstance(v, str) else f"job{v}",
)
def test_foreign_models_match_ddp(style: str, job: int) -> None:
    results = run_ranks(w.sweep, 2, _jobs(style)[job], 3, timeout=600)
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
