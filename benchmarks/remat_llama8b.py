"""Predicted peak and recompute FLOPs of a Llama 3.1 8B-shaped train step under each remat policy.

    PYTHONPATH=$PWD python benchmarks/remat_llama8b.py [--policies none selective 0.5 full] [--layers 32]

Hugging Face ``LlamaConfig`` (32 layers, d 4096, 32/8 heads, ffn 14336, vocab 128256), built under
FakeTensorMode (no memory); bf16 params with fp32 reduction (spmd.MixedPrecision), local batch 2,
seq 8192, 8 ranks, fully_shard: the setting of torchtitan's FSDP table (issue 21). Each policy is one
``spmd.simulate`` (one process, fake process group); prints one JSON line per policy.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd


def train_step(model, optim, ids, labels):
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policies", nargs="+", default=["none", "selective", "0.5", "full"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--world-size", type=int, default=8)
    args = p.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )  # fmt: skip
    for pol in args.policies:
        remat = None if pol == "none" else pol if pol in ("selective", "full") else float(pol)
        with FakeTensorMode():
            model = transformers.LlamaForCausalLM(cfg)
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
        mp = spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        dp = spmd.DataParallel("fully_shard", mixed_precision=mp)
        step = spmd.compile(parallel_mode=dp, remat=remat)(train_step)
        t0 = time.perf_counter()
        rep = spmd.simulate(step, model, optim, ids, ids.clone(), world_size=args.world_size)
        out = {
            "remat": pol,
            "peak_GiB": round(rep.peak_memory_bytes / 2**30, 2),
            "peak_node": rep.peak_node,
            "peak_by_phase_GiB": {k: round(v / 2**30, 2) for k, v in rep.peak_by_phase.items()},
            "saved_GiB": round(rep.activation_saved_bytes / 2**30, 2),
            "recomputed_GiB": round(rep.activation_recomputed_bytes / 2**30, 2),
            "extra_flops_pct": round(100 * rep.extra_flops_fraction, 2),
            "simulate_s": round(time.perf_counter() - t0, 1),
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
