"""The character-level GPT and the text it learns, shared by train_gpt.py and sample.py."""

import os
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F


def init_device(kind: str) -> tuple[torch.device, dict]:
    """(this rank's device, the ``init_process_group`` arguments for it).

    ``"cuda"``: one GPU per rank, torchrun's ``LOCAL_RANK`` picks it (set before anything else
    touches CUDA) and the group is NCCL, bound to that device; ``"cpu"``: gloo."""
    if kind == "cpu":
        return torch.device("cpu"), {"backend": "gloo"}
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device (a CPU build, or no GPU visible)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device, {"backend": "nccl", "device_id": device}


def load_text(limit: int = 2_000_000) -> str:
    """The top-level standard-library .py files in sorted order, up to ``limit`` characters, as ASCII.

    Every Python install has them, so the demo needs no download; non-ASCII characters become "?".
    """
    root = sysconfig.get_paths()["stdlib"]
    parts, n = [], 0
    for name in sorted(f for f in os.listdir(root) if f.endswith(".py")):
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
        n += len(parts[-1])
        if n >= limit:
            break
    return "".join(c if ord(c) < 128 else "?" for c in "".join(parts)[:limit])


def encode_text(limit: int = 2_000_000) -> tuple[str, torch.Tensor]:
    """(the characters of ``load_text(limit)`` in sorted order, the text as their indices)."""
    text = load_text(limit)
    chars = "".join(sorted(set(text)))
    lut = {c: i for i, c in enumerate(chars)}
    return chars, torch.tensor([lut[c] for c in text], dtype=torch.long)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # each (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm transformer blocks, an untied output head. No dropout."""

    def __init__(self, vocab: int, d_model: int, n_layer: int, n_head: int, block: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(block, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_head) for _ in range(n_layer)])
        self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))
