"""Predicted peak and recompute FLOPs of a Llama 3.1 8B-shaped train step under each remat policy.

    PYTHONPATH=$PWD python benchmarks/plan_validation/remat_llama8b.py \
        [--policies none selective op 0.7 0.5 0.3 0.1 full] [--layers 32] [--live 20]

Hugging Face ``LlamaConfig`` (32 layers, d 4096, 32/8 heads, ffn 14336, vocab 128256), built under
FakeTensorMode (no memory); bf16 params with fp32 reduction (spmd.MixedPrecision), local batch 2,
seq 8192, 8 ranks, fully_shard: the setting of torchtitan's FSDP table (issue 21). Each policy is one
``spmd.simulate`` (one process, fake process group); prints one JSON line per policy. ``--live N``
also prints the N largest groups of buffers live at the predicted peak (phase, module with layer
numbers folded, op), read off the final graph with ``passes.memory.buffer_liveness``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd
from passes.memory import buffer_liveness, estimate_peak_memory
from passes.meta import MODULE, PHASE, ROLE
from spmd.simulate import fake_copy, fake_world, fresh_copy


def train_step(model, optim, ids, labels):
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def live_at_peak(gm: torch.fx.GraphModule, top: int) -> list[tuple[str, int, float]]:
    """The ``top`` largest groups of buffers live at the predicted peak: (group, count, GiB)."""
    lv, est = buffer_liveness(gm), estimate_peak_memory(gm)
    at = next(i for i, n in enumerate(lv.nodes) if n.name == est.peak_node)
    size: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for n in lv.nodes[: at + 1]:
        for b in lv.fresh_of[n]:
            if b in lv.pinned or lv.last_use.get(b, -1) >= at:
                if n.op == "placeholder":
                    key = f"state: {n.meta.get(ROLE)}"
                else:
                    phase = getattr(n.meta.get(PHASE), "value", "-")
                    module = re.sub(r"\.\d+", ".N", n.meta.get(MODULE, ""))
                    key = f"{phase}: {module}: {getattr(n.target, '__name__', n.target)}"
                size[key] += lv.size[b]
                count[key] += 1
    return [(k, count[k], round(v / 2**30, 3)) for k, v in size.most_common(top)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policies", nargs="+", default=["none", "selective", "0.7", "0.5", "0.3", "0.1", "full"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--live", type=int, default=0, help="print the N largest groups live at the peak")
    args = p.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )  # fmt: skip
    for pol in args.policies:
        remat = None if pol == "none" else pol if pol in ("selective", "op", "full") else float(pol)
        with FakeTensorMode():
            model = transformers.LlamaForCausalLM(cfg)
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
        mp = spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        dp = spmd.DataParallel("fully_shard", mixed_precision=mp)
        step = spmd.compile(parallel_mode=dp, remat=remat)(train_step)
        t0 = time.perf_counter()
        # spmd.simulate's steps, keeping the simulated step to read its final graph.
        sim = fresh_copy(step)
        fargs, fkwargs = fake_copy((model, optim, ids, ids.clone()), {})
        with fake_world(args.world_size):
            sim.lower(*fargs, **fkwargs)
            rep = sim.report()
            live = live_at_peak(sim.graphs["final"], args.live) if args.live else []
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
        for key, k, gib in live:
            print(f"  {gib:8.3f} GiB  x{k:<4d} {key}", flush=True)


if __name__ == "__main__":
    main()
