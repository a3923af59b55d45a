"""Built-in example models for ``python -m spmd.simulate`` / ``spmd.plan``: GPT-2 shapes and a tiny one,
and Hugging Face causal LMs from a config file or a preset (Llama 3.1 8B / 70B shapes).

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

from spmd.errors import ConfigError


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
        from passes.torch_compat import FakeTensorMode

        with FakeTensorMode():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, optim, idx, idx.clone()


# ----------------------------------------------------------------------------- Hugging Face models

# Published shapes (Meta's config.json of meta-llama/Llama-3.1-8B and -70B on the Hugging Face hub).
_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA31 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA31_ROPE,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3.1-8b": {
        **_LLAMA31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama3.1-70b": {
        **_LLAMA31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}


def _transformers() -> Any:
    """The ``transformers`` package, or a :class:`ConfigError` that says how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "spmd: a Hugging Face model (--hf-config, a preset, spmd.models.build_hf) needs the "
            "`transformers` package, which is not installed here. Install spmd's `hf` extra: "
            "pip install -e '.[hf]' (or pip install 'transformers>=4.50')."
        ) from exc
    return transformers


def hf_config(source: str | dict[str, Any]) -> Any:
    """A ``transformers`` config from a preset name, a config json path, or its dict (no download)."""
    import json
    import os

    AutoConfig = _transformers().AutoConfig

    if isinstance(source, str) and source in PRESETS:
        d = dict(PRESETS[source])
    elif isinstance(source, dict):
        d = dict(source)
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            d = json.load(f)
    if "model_type" not in d:
        raise ValueError(f"{source!r}: a Hugging Face config needs a 'model_type' (e.g. 'llama')")
    model_type = d.pop("model_type")
    for k in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        d.pop(k, None)  # weights' dtype: the plan's mixed precision decides compute dtypes
    d.setdefault("use_cache", False)
    attention = d.pop("attn_implementation", None) or _attention(model_type)
    return AutoConfig.for_model(model_type, attn_implementation=attention, **d)


def _attention(model_type: str) -> str:
    """``"sdpa"`` (one fused attention op in the graph), or ``"eager"`` for a causal LM whose
    class has no sdpa path (Gemma 2: its attention logits are soft-capped; transformers refuses
    to build it with sdpa)."""
    from transformers.models.auto import modeling_auto

    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(_transformers(), name, None) if isinstance(name, str) else None
    return "eager" if cls is not None and getattr(cls, "_supports_sdpa", True) is False else "sdpa"


def causal_lm_step(
    model: nn.Module, optim: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor
) -> Any:
    """``train_step`` for a Hugging Face causal LM (its output's ``.logits``)."""
    logits = model(input_ids=idx, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def build_hf(
    source: str | dict[str, Any], *, batch: int = 1, seq: int = 2048, fake: bool = True
) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """(model, fused AdamW, idx, targets) for a Hugging Face causal LM built from its config
    (``AutoModelForCausalLM.from_config``: random weights, no download); ``fake``: the weights
    take no memory (``FakeTensorMode``)."""
    cfg = hf_config(source)
    AutoModelForCausalLM = _transformers().AutoModelForCausalLM
    if fake:
        from passes.torch_compat import FakeTensorMode

        with FakeTensorMode():
            model = AutoModelForCausalLM.from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, optim, idx, idx.clone()


# ----------------------------------------------------------------------------- command lines


def add_model_arguments(p: Any) -> None:
    """The model options ``python -m spmd.simulate`` and ``python -m spmd.plan`` share."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, choices=sorted(CONFIGS), help="built-in GPT (default: tiny)")
    src.add_argument(
        "--hf-config", default=None, help="a Hugging Face config.json (any causal LM; no download)"
    )
    src.add_argument("--preset", default=None, choices=sorted(PRESETS), help="published Hugging Face shapes")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="tokens per sequence (default: the built-in model's context; 2048 for Hugging Face models)",
    )
    p.add_argument(
        "--mixed-precision",
        default=None,
        choices=["bf16", "fp16"],
        help="compute in this dtype over fp32 weights, reduce gradients in fp32 (torchtitan's default)",
    )


def build_from_args(args: Any) -> tuple[Any, tuple[Any, ...], Any]:
    """(train step function, (model, optim, idx, targets), MixedPrecision or None) from the shared options."""
    hf = args.hf_config or args.preset
    if hf is not None:
        fn: Any = causal_lm_step
        built = build_hf(hf, batch=args.batch, seq=args.seq or 2048, fake=True)
    else:
        fn = train_step
        built = build(args.model or "tiny", batch=args.batch, seq=args.seq, fake=True)
    mp = None
    if args.mixed_precision is not None:
        from spmd.parallel import MixedPrecision

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.mixed_precision]
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
    return fn, built, mp
