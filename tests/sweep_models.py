"""Models we did not write (or wrote the way users do), for the robustness sweep.

Each entry of ``MODELS`` is a tiny config of a model family that our own test models do not
cover: Hugging Face BERT / T5 / ViT / Qwen2 / GPT-NeoX / Mistral (built from configs, no
download), torch's FSDP test models (``torch.testing._internal.common_fsdp``), a seq-first
``nn.TransformerEncoder``, and small nets with the patterns that broke compilers before:
channels_last convolutions, permuted inputs into BatchNorm, LayerNorm over a transposed view,
GroupNorm, depthwise convolutions, ``padding_idx``, weight tying, buffers written in forward,
dropout, and outputs that are dicts, tuples or dataclasses.

``build(name)`` returns a :class:`Case`: the model (same values every call), ``batch(g)`` (one
local batch from a generator, so ranks can draw different data) and ``loss(model, *batch)``
(a scalar; the train step of tests/dist/workers_sweep.py calls it on the compiled model and on
DDP's). Used by tests/dist/test_sweep.py.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import unittest
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

V, T, B = 64, 8, 4  # vocabulary, sequence length, local batch

try:
    import transformers  # noqa: F401

    HAS_TRANSFORMERS = True
except ImportError:  # the hf_* models are skipped
    HAS_TRANSFORMERS = False


@dataclasses.dataclass
class Case:
    model: nn.Module
    batch: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    # A scalar, or (scalar, anything the step should return besides it).
    loss: Callable[..., Any]
    uses_transformers: bool = False
    # DDP needs find_unused_parameters=True for a model with parameters its loss does not reach.
    unused_params: bool = False
    # Compare fully_shard with FSDP2 too (not for models whose buffers change: FSDP2 does not
    # broadcast buffers, DDP and spmd do).
    fsdp2: bool = True
    # DataParallel(module_styles=...) the model needs under fully_shard; without them the first
    # call must raise spmd.ConfigError (the sweep checks both).
    module_styles: dict[str, str] | None = None


def _ids(g: torch.Generator, *shape: int, lo: int = 1) -> torch.Tensor:
    return torch.randint(lo, V, shape, generator=g)


def _hf_loss(model: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    return model(*batch).loss


# --- Hugging Face ---------------------------------------------------------------------------


def _transformers() -> Any:
    import pytest

    return pytest.importorskip("transformers")


def _bert() -> Case:
    tf = _transformers()
    cfg = tf.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, type_vocab_size=2, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, attn_implementation="eager",
    )  # fmt: skip
    model = tf.BertForMaskedLM(cfg)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        ids = _ids(g, B, T)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1:, T - 2 :] = 0  # padded tails
        types_ = (torch.arange(T) >= T // 2).long().expand(B, T).contiguous()
        labels = torch.where(torch.rand(B, T, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]  # at least one masked position per row
        return ids, mask, types_, labels

    def loss(m: nn.Module, ids, mask, types_, labels) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, token_type_ids=types_, labels=labels).loss

    return Case(model, batch, loss, uses_transformers=True)


def _t5() -> Case:
    tf = _transformers()
    cfg = tf.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.1,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = tf.T5ForConditionalGeneration(cfg)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, T - 3 :] = 0
        return _ids(g, B, T), mask, _ids(g, B, T // 2)

    def loss(m: nn.Module, ids, mask, labels) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    return Case(model, batch, loss, uses_transformers=True)


def _vit() -> Case:
    tf = _transformers()
    cfg = tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=4, hidden_dropout_prob=0.1,
    )  # fmt: skip
    model = tf.ViTForImageClassification(cfg)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, 4, (B,), generator=g)

    def loss(m: nn.Module, x, y) -> torch.Tensor:
        return m(pixel_values=x, labels=y).loss

    return Case(model, batch, loss, uses_transformers=True)


def _causal(config_name: str, model_name: str, **kw: Any) -> Callable[[], Case]:
    def build() -> Case:
        tf = _transformers()
        cfg = getattr(tf, config_name)(vocab_size=V, max_position_embeddings=32, **kw)
        model = getattr(tf, model_name)(cfg)

        def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
            ids = _ids(g, B, T)
            return ids, ids.clone()

        def loss(m: nn.Module, ids, labels) -> torch.Tensor:
            return m(input_ids=ids, labels=labels).loss

        return Case(model, batch, loss, uses_transformers=True)

    return build


_LLAMA_LIKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    attn_implementation="eager",
)  # fmt: skip


# More Hugging Face architectures, each with HF's default attention (sdpa where the model has
# it) and its dropouts on: tied heads, GPT-2's Conv1D (transposed weights), Gemma's scaled
# embeddings and logit softcapping, Phi-3's fused qkv / gate_up, OPT's learned positions, BLOOM's
# and Falcon's alibi, MoE routing (Mixtral, Qwen2-MoE with the router's aux loss and jitter),
# RoBERTa / DistilBERT masked LMs and Whisper's conv front end.
_TINY = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip
_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the tiny vocabulary


def _masked_lm(config_name: str, model_name: str, **kw: Any) -> Callable[[], Case]:
    def build() -> Case:
        tf = _transformers()
        model = getattr(tf, model_name)(getattr(tf, config_name)(vocab_size=V, pad_token_id=0, **kw))

        def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
            ids = _ids(g, B, T)
            labels = torch.where(torch.rand(B, T, generator=g) < 0.3, ids, torch.full_like(ids, -100))
            labels[:, 0] = ids[:, 0]
            return ids, labels

        loss = lambda m, ids, labels: m(input_ids=ids, labels=labels).loss
        return Case(model, batch, loss, uses_transformers=True)

    return build


def _whisper() -> Case:
    """Encoder-decoder with a Conv1d front end over (B, mel bins, frames) and learned positions."""
    tf = _transformers()
    cfg = tf.WhisperConfig(
        vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=8, max_target_positions=16, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1, decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
        **_TOKENS,
    )  # fmt: skip
    model = tf.WhisperForConditionalGeneration(cfg)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(B, 8, 16, generator=g), _ids(g, B, T)  # 16 frames = 2 x max_source_positions

    loss = lambda m, x, labels: m(input_features=x, labels=labels).loss
    return Case(model, batch, loss, uses_transformers=True)


HF_MORE: dict[str, Callable[[], Case]] = {
    # dropout 0.1 (embeddings, attention, residual) by default
    "hf_gpt2": _causal(
        "GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32, n_head=4, bos_token_id=1, eos_token_id=2
    ),
    "hf_gemma": _causal(
        "GemmaConfig", "GemmaForCausalLM", head_dim=8, attention_dropout=0.1, **_TINY, **_TOKENS
    ),
    # softcapping of attention and final logits (HF's default attention for Gemma2 is eager)
    "hf_gemma2": _causal(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        head_dim=8,
        sliding_window=4,
        attention_dropout=0.1,
        **_TINY,
        **_TOKENS,
    ),  # fmt: skip
    "hf_phi3": _causal(
        "Phi3Config",
        "Phi3ForCausalLM",
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attention_dropout=0.1,
        **_TINY,
        **_TOKENS,
    ),  # fmt: skip
    "hf_opt": _causal(
        "OPTConfig",
        "OPTForCausalLM",
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        dropout=0.1,
        attention_dropout=0.1,
        **_TOKENS,
    ),  # fmt: skip
    "hf_bloom": _causal(
        "BloomConfig",
        "BloomForCausalLM",
        hidden_size=32,
        n_layer=2,
        n_head=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        **_TOKENS,
    ),  # fmt: skip
    "hf_falcon_alibi": _causal(
        "FalconConfig",
        "FalconForCausalLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        **_TOKENS,
    ),  # fmt: skip
    # HF's default experts implementation (grouped_mm: fixed shapes); the router's aux loss and jitter
    "hf_mixtral": _causal(
        "MixtralConfig",
        "MixtralForCausalLM",
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_dropout=0.1,
        output_router_logits=True,
        router_jitter_noise=0.1,
        **_TINY,
        **_TOKENS,
    ),  # fmt: skip
    "hf_qwen2_moe": _causal(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        output_router_logits=True,
        attention_dropout=0.1,
        **_TINY,
        **_TOKENS,
    ),  # fmt: skip
    # dropout 0.1 by default; RoBERTa's positions start after padding_idx
    "hf_roberta": _masked_lm(
        "RobertaConfig",
        "RobertaForMaskedLM",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=T + 2,
    ),  # fmt: skip
    "hf_distilbert": _masked_lm(
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        max_position_embeddings=32,
    ),  # fmt: skip
    "hf_whisper": _whisper,
}


# --- torch's FSDP test models ---------------------------------------------------------------


def _common_fsdp() -> Any:
    # common_fsdp imports common_utils, which imports the test-only package `expecttest` for
    # its TestCase; the models need none of it.
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stub
    import torch.testing._internal.common_fsdp as c

    return c


def _no_fsdp(cls: Any) -> nn.Module:
    c = _common_fsdp()
    world = torch.distributed.group.WORLD
    return cls.init(world, c.FSDPInitMode.NO_FSDP, c.DEVICEInitMode.DEVICE_NEVER, deterministic=True)


def _transformer_shared() -> Case:
    """nn.Transformer (seq-first, dropout) with the embedding tied to the output projection,
    a BatchNorm1d over the batch dimension of (T, B, D) and a long buffer added in forward."""
    model = _no_fsdp(_common_fsdp().TransformerWithSharedParams).train()

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randint(0, 23, (6, 2), generator=g), torch.randint(0, 23, (4, 2), generator=g)

    def loss(m: nn.Module, src, tgt) -> torch.Tensor:
        out = m(src, tgt)
        return F.cross_entropy(out.view(-1, out.size(-1)), tgt.view(-1), reduction="sum")

    return Case(model, batch, loss, fsdp2=False)


def _nested_wrapped() -> Case:
    model = _no_fsdp(_common_fsdp().NestedWrappedModule)
    return Case(model, lambda g: (torch.rand(4, 8, generator=g),), lambda m, x: m(x).sum())


def _mlp_stack() -> Case:
    torch.manual_seed(0)
    model = _common_fsdp().MLPStack(12)  # dim_multiplier 3: uneven shards
    return Case(model, lambda g: (torch.randn(B, 12, generator=g),), lambda m, x: m(x).square().mean())


def _double_linear() -> Case:
    """Returns a tuple of two outputs."""
    torch.manual_seed(0)
    model = _common_fsdp().DoubleLinear(8)

    def loss(m: nn.Module, x) -> torch.Tensor:
        a, b = m(x)
        return (a * b).mean() + a.sum() * 1e-2

    return Case(model, lambda g: (torch.randn(B, 8, generator=g),), loss)


def _double_linear_unused() -> Case:
    torch.manual_seed(0)
    model = _common_fsdp().DoubleLinear(8, use_second_linear=False)
    loss = lambda m, x: m(x).square().mean()
    return Case(model, lambda g: (torch.randn(B, 8, generator=g),), loss, unused_params=True)


# --- torch.nn and hand-written users' models ------------------------------------------------


class _SeqFirstEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16, padding_idx=0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=False)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:  # ids (T, B), pad (B, T)
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=pad).mean(0))


def _seq_first_encoder() -> Case:
    torch.manual_seed(0)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        ids = _ids(g, T, B, lo=0)
        pad = torch.zeros(B, T, dtype=torch.bool)
        pad[0, T - 2 :] = True
        return ids, pad, torch.randint(0, 4, (B,), generator=g)

    return Case(_SeqFirstEncoder(), batch, lambda m, ids, pad, y: F.cross_entropy(m(ids, pad), y))


class _ConvNet(nn.Module):
    """channels_last parameters and input; depthwise conv, GroupNorm, BatchNorm2d, a permuted
    view into BatchNorm1d, LayerNorm over a transposed view."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.gn = nn.GroupNorm(2, 8)
        self.pw = nn.Conv2d(8, 8, 1)
        self.bn1d = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.stem(x)))
        h = self.pw(F.gelu(self.gn(self.dw(h)))) + h
        s = h.flatten(2)  # (B, C, HW)
        s = self.bn1d(s.permute(0, 2, 1).reshape(-1, 8)).view(x.shape[0], -1, 8)  # (B, HW, C)
        s = self.ln(s.transpose(1, 2).transpose(1, 2))
        return self.head(s.mean(1))


def _convnet() -> Case:
    torch.manual_seed(0)
    model = _ConvNet().to(memory_format=torch.channels_last)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(B, 3, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
        return x, torch.randint(0, 4, (B,), generator=g)

    return Case(model, batch, lambda m, x, y: F.cross_entropy(m(x), y), fsdp2=False)


class _TiedLM(nn.Module):
    """Embedding with padding_idx tied to the output, a buffer written in forward (a running
    mean of the embeddings and a step counter), dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16, padding_idx=0)
        self.mix = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(16, V, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("running", torch.zeros(16))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(h.mean((0, 1)), alpha=0.1)
                self.calls += 1
        h = self.drop(torch.tanh(self.mix(h))) + h - self.running
        return self.out(h)


def _tied_lm() -> Case:
    torch.manual_seed(0)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        ids = _ids(g, B, T, lo=0)
        ids[:, -1] = 0  # padding positions
        return ids, _ids(g, B, T, lo=0)

    def loss(m: nn.Module, ids, y) -> torch.Tensor:
        return F.cross_entropy(m(ids).flatten(0, 1), y.flatten(), ignore_index=0)

    return Case(_TiedLM(), batch, loss, fsdp2=False)


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    aux: torch.Tensor


class _MultiOut(nn.Module):
    """Returns ``kind``: a dict, a (tensor, (tensor, int)) tuple or a dataclass."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = F.silu(self.a(x))
        logits, aux = self.b(h), h.square().mean()
        if self.kind == "dict":
            return {"logits": logits, "aux": aux, "n": 3}
        if self.kind == "tuple":
            return logits, (aux, 3)
        return _Out(logits, aux)


def _multi_out(kind: str) -> Callable[[], Case]:
    def build() -> Case:
        torch.manual_seed(0)

        def loss(m: nn.Module, x, y) -> tuple[torch.Tensor, Any]:
            # The step returns the loss and what the model returned (a dataclass that is not a
            # pytree node cannot leave a compiled step: its fields do).
            out = m(x)
            if kind == "dict":
                logits, aux = out["logits"], out["aux"] * out["n"]
            elif kind == "tuple":
                logits, (aux, n) = out
                aux = aux * n
            else:
                logits, aux = out.logits, out.aux
                out = {"logits": out.logits, "aux": out.aux}
            return F.cross_entropy(logits, y) + 0.1 * aux, out

        return Case(
            _MultiOut(kind),
            lambda g: (torch.randn(B, 8, generator=g), torch.randint(0, 4, (B,), generator=g)),
            loss,
        )

    return build


class _Recurrent(nn.Module):
    """GRU (batch_first) and LSTM (seq-first) over embeddings; MultiheadAttention with a key
    padding mask on top; the first embedding frozen (requires_grad=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Embedding(V, 8)
        self.frozen.weight.requires_grad_(False)
        self.gru = nn.GRU(8, 12, batch_first=True)
        self.lstm = nn.LSTM(12, 12, num_layers=2)
        self.attn = nn.MultiheadAttention(12, 2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(12, 4)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.frozen(ids))
        h, _ = self.lstm(h.transpose(0, 1))
        h = h.transpose(0, 1)
        a, _ = self.attn(h, h, h, key_padding_mask=pad)
        return self.head(a.mean(1))


def _recurrent() -> Case:
    torch.manual_seed(0)

    def batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
        pad = torch.zeros(B, T, dtype=torch.bool)
        pad[1, T - 3 :] = True
        return _ids(g, B, T), pad, torch.randint(0, 4, (B,), generator=g)

    return Case(_Recurrent(), batch, lambda m, ids, pad, y: F.cross_entropy(m(ids, pad), y))


class _Parametrized(nn.Module):
    """weight_norm and spectral_norm parametrizations (spectral_norm updates its power-iteration
    buffers ``_u``/``_v`` in every training forward) and activation checkpointing with dropout."""

    def __init__(self) -> None:
        super().__init__()
        P = nn.utils.parametrizations
        self.a = P.weight_norm(nn.Linear(8, 16))
        self.b = P.spectral_norm(nn.Linear(16, 16))
        self.c = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        h = torch.utils.checkpoint.checkpoint(self.c, h, use_reentrant=False) + h
        return self.head(h)


def _parametrized() -> Case:
    torch.manual_seed(0)
    return Case(
        _Parametrized(),
        lambda g: (torch.randn(B, 8, generator=g), torch.randint(0, 4, (B,), generator=g)),
        lambda m, x, y: F.cross_entropy(m(x), y),
        fsdp2=False,
    )


def _hf_checkpointed() -> Case:
    """A Qwen2 (sdpa attention, dropout in attention) with HF gradient checkpointing on."""
    kw = {**_LLAMA_LIKE, "attn_implementation": "sdpa", "attention_dropout": 0.1}
    case = _causal("Qwen2Config", "Qwen2ForCausalLM", **kw)()
    case.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    case.model.train()
    return case


class _OddParams(nn.Module):
    """A 0-dim parameter (a learned temperature), a 1-element one (fewer rows than ranks), a
    module called twice, a forward pre-hook, an in-place ReLU, an EmbeddingBag."""

    def __init__(self) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.zeros(1))
        self.emb = nn.Embedding(V, 8)
        self.bag = nn.EmbeddingBag(V, 8, mode="mean")
        self.shared = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 4)
        self.shared.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).mean(1) + self.bag(ids)
        h = self.act(self.shared(self.act(self.shared(h))))
        return self.head(h) / self.temp + self.shift


class _MaxNorm(nn.Module):
    """nn.Embedding(max_norm=...) renormalises the rows it looks up, in place, during forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 8, max_norm=1.0)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def _max_norm() -> Case:
    torch.manual_seed(0)
    return Case(
        _MaxNorm(),
        lambda g: (_ids(g, B, T), torch.randint(0, 4, (B,), generator=g)),
        lambda m, ids, y: F.cross_entropy(m(ids), y),
        fsdp2=False,  # FSDP2 loses the write too
        module_styles={"emb": "replicate"},
    )


def _odd_params() -> Case:
    torch.manual_seed(0)
    return Case(
        _OddParams(),
        lambda g: (_ids(g, B, T), torch.randint(0, 4, (B,), generator=g)),
        lambda m, ids, y: F.cross_entropy(m(ids), y),
        fsdp2=False,  # FSDP2 refuses 0-dim parameters ("Change temp to a 1D tensor")
    )


class _VisionOps(nn.Module):
    """MaxPool2d (its backward takes the indices), ConvTranspose2d, InstanceNorm2d with affine
    weights, bilinear interpolate, PixelShuffle, AdaptiveAvgPool2d, a strided conv."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.relu(self.c1(x)))  # (B, 8, 2, 2)
        h = F.gelu(self.inorm(self.up(h)))  # (B, 8, 4, 4)
        h = F.interpolate(h, scale_factor=1.5, mode="bilinear", align_corners=False)
        h = self.shuffle(self.c2(h))  # (B, 4, 12, 12)
        return self.head(self.gap(h).flatten(1))


def _vision_ops() -> Case:
    torch.manual_seed(0)
    return Case(
        _VisionOps(),
        lambda g: (torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, 4, (B,), generator=g)),
        lambda m, x, y: F.cross_entropy(m(x), y),
    )


MODELS: dict[str, Callable[[], Case]] = {
    "hf_bert": _bert,
    "hf_t5": _t5,
    "hf_vit": _vit,
    "hf_qwen2": _causal("Qwen2Config", "Qwen2ForCausalLM", **_LLAMA_LIKE),
    "hf_mistral": _causal("MistralConfig", "MistralForCausalLM", sliding_window=4, **_LLAMA_LIKE),
    "hf_gpt_neox": _causal(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.5,
        attn_implementation="eager",
    ),  # fmt: skip
    "fsdp_transformer_shared": _transformer_shared,
    "fsdp_nested_wrapped": _nested_wrapped,
    "fsdp_mlp_stack": _mlp_stack,
    "fsdp_double_linear": _double_linear,
    "fsdp_double_linear_unused": _double_linear_unused,
    "seq_first_encoder": _seq_first_encoder,
    "convnet_channels_last": _convnet,
    "tied_lm_buffers_dropout": _tied_lm,
    "out_dict": _multi_out("dict"),
    "out_tuple": _multi_out("tuple"),
    "out_dataclass": _multi_out("dataclass"),
    "recurrent_mha_frozen": _recurrent,
    "parametrized_checkpointed": _parametrized,
    "hf_qwen2_grad_checkpointing": _hf_checkpointed,
    "odd_params": _odd_params,
    "embedding_max_norm": _max_norm,
    "vision_ops": _vision_ops,
    **HF_MORE,
}


def build(name: str) -> Case:
    """The model of ``name`` with the same initial values on every call (and every rank)."""
    torch.manual_seed(0)
    return MODELS[name]()


# --- Hugging Face causal LMs with SDPA attention (HF's default), for the attention-path tests --

HF_SDPA = ("llama", "qwen2", "mistral")


def hf_sdpa_causal_lm(name: str) -> nn.Module:
    """A tiny HF causal LM (``HF_SDPA``) with ``attn_implementation="sdpa"``; the same values every call.

    Mistral keeps its default sliding window (4096 > T): eager skips the mask as for the others.
    """
    tf = _transformers()
    config = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}[name]
    kw = {**_LLAMA_LIKE, "attn_implementation": "sdpa"}
    torch.manual_seed(0)
    cfg = getattr(tf, config)(vocab_size=V, max_position_embeddings=32, **kw)
    return getattr(tf, config.replace("Config", "ForCausalLM"))(cfg)


def sdpa_calls(gm: Any) -> list[dict[str, Any]]:
    """The forward SDPA calls of a graph, each as its keyword arguments (``is_causal``, ``attn_mask``)."""
    from torch.fx.operator_schemas import normalize_function

    calls = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "")
        if n.op == "call_function" and "scaled_dot_product" in name and "backward" not in name:
            bound = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True)
            calls.append(dict(bound.kwargs) if bound is not None else {})
    return calls
