"""Coverage of the automatic tensor-parallel placements over Hugging Face causal-LM families.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/plan_validation/auto_tp_coverage.py
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/plan_validation/auto_tp_coverage.py --only qwen3,olmo2

For each family a small config is built in code (no download: the transformers config classes,
two layers, hidden 256-512, attention heads divisible by 8, key/value heads as the family's large
variants have them, vocabulary divisible by 8), and its whole step (forward, cross-entropy,
backward, fused AdamW) is lowered by ``spmd.simulate`` with ``DataParallel("fully_shard",
tp_size=8)`` and no plan on a fake world of 16 ranks (data 2 x tp 8). Each family runs in a
child process (a failure or a hang cannot take the others with it). The table gives whether the
step built, which candidate classes were sharded and which replicated (with spmd's reason), the
build seconds and the error if any. Results: benchmarks/results/auto-tp-coverage.md.

"Placed automatically" (issue 35's coverage target) means the step builds and the attention and
the MLP are sharded where DTensor permits; a family whose attention or MLP replicates is
counted as built and marked so in the table.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import multiprocessing as mp
import re
import sys
import time
import traceback
from typing import Any

TP, WORLD, BATCH, SEQ = 8, 16, 2, 16

# Shared shape: 2 layers, hidden 256, 8 heads of 32, key/value heads 8 (the 8 of the families'
# large GQA variants: Llama 3 70B, Qwen2 72B, Mixtral, Gemma 2 27B...), MLP 512, vocabulary 512.
_BASE = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
_GQA = {**_BASE, "hidden_size": 512, "num_attention_heads": 16, "head_dim": 32}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **_GQA},
    "qwen2": {"model_type": "qwen2", **_GQA},
    "qwen3": {"model_type": "qwen3", **_GQA},
    "mistral": {"model_type": "mistral", **_GQA, "sliding_window": 16},
    "mixtral": {"model_type": "mixtral", **_GQA, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma": {"model_type": "gemma", **_BASE, "head_dim": 32, "tie_word_embeddings": True},
    "gemma2": {"model_type": "gemma2", **_GQA, "sliding_window": 16, "tie_word_embeddings": True},
    "gemma3": {"model_type": "gemma3_text", **_GQA, "sliding_window": 16, "tie_word_embeddings": True},
    "gpt2": {
        "model_type": "gpt2", "vocab_size": 512, "n_embd": 256, "n_layer": 2, "n_head": 8,
        "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0,
    },
    "gpt_neox": {
        "model_type": "gpt_neox", **_BASE, "num_key_value_heads": None, "rotary_pct": 0.25,
    },
    "gptj": {
        "model_type": "gptj", "vocab_size": 512, "n_embd": 256, "n_layer": 2, "n_head": 8,
        "n_positions": 64, "rotary_dim": 16, "bos_token_id": 0, "eos_token_id": 0,
    },
    "phi": {"model_type": "phi", **_BASE, "partial_rotary_factor": 0.5},
    "phi3": {"model_type": "phi3", **_BASE, "pad_token_id": 0},
    "olmo": {"model_type": "olmo", **_BASE},
    "olmo2": {"model_type": "olmo2", **_BASE},
    "falcon": {  # Falcon-40B's layout: new decoder architecture, grouped key/value heads
        "model_type": "falcon", "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 16, "num_kv_heads": 8, "new_decoder_architecture": True,
        "max_position_embeddings": 64, "parallel_attn": True, "bias": False,
    },
    "stablelm": {"model_type": "stablelm", **_BASE, "partial_rotary_factor": 0.25},
    "starcoder2": {"model_type": "starcoder2", **_GQA, "use_bias": True, "sliding_window": 16},
    "cohere": {"model_type": "cohere", **_BASE, "tie_word_embeddings": True},
    "deepseek_v2": {
        "model_type": "deepseek_v2", **_BASE, "moe_intermediate_size": 128, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "q_lora_rank": 128, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    },
}  # fmt: skip


def _names(line: str) -> list[str]:
    """The parameter patterns a class line (Decision.describe) names."""
    head = re.sub(r" \(x\d+\)$", "", line.split(": ", 1)[0])
    return [n for part in head.split(" -> ") for n in part.split(", ")]


def _short(names: str) -> str:
    return re.sub(r"(^|(?<=[ ,>]))[\w.]*?\.\*\.", "", names).replace(".weight", "")


def uncovered(weights: list[str], choices: list[str]) -> list[str]:
    """Matrix parameters (2-D, and 3-D experts) in no candidate class: replicated without a line
    of their own (a matmul whose output meets a norm or another matmul first, experts, routers)."""
    pats = [p for c in choices for p in _names(c)]
    return [w for w in weights if not any(fnmatch.fnmatchcase(w, p) for p in pats)]


def build_one(name: str) -> dict[str, Any]:
    """Lower one family's step at tp 8 on the fake world; the row of the table."""
    import torch

    import spmd
    from spmd import models

    torch.manual_seed(0)
    row: dict[str, Any] = {"family": name}
    t = time.perf_counter()
    try:
        model, optim, idx, tgt = models.build_hf(dict(FAMILIES[name]), batch=BATCH, seq=SEQ)
        row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
        row["class"] = type(model).__name__
        row["weights"] = [n for n, p in model.named_parameters() if p.dim() >= 2]
        mode = spmd.DataParallel("fully_shard", tp_size=TP)
        step = spmd.compile(parallel_mode=mode)(models.causal_lm_step)
        report = spmd.simulate(step, model, optim, idx, tgt, world_size=WORLD)
        row["builds"] = True
        row["choices"] = list(report.tp_choices)
    except Exception as e:  # noqa: BLE001 - the table records it
        row["builds"] = False
        row["error"] = f"{type(e).__name__}: {e}".strip()
        row["trace"] = traceback.format_exc(limit=-8)
        row["choices"] = []
    row["seconds"] = time.perf_counter() - t
    return row


def _child(name: str, q: Any) -> None:
    q.put(build_one(name))


def run(name: str, timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(name, q))
    p.start()
    try:
        return q.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - the child died or hung
        return {"family": name, "builds": False, "error": f"no result in {timeout:.0f} s", "choices": []}
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| family | builds | sharded classes | replicated classes (why) | other matrices replicated "
        "(no candidate) | build s | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sh = [c for c in r["choices"] if ", sharded:" in c]
        rep = [c for c in r["choices"] if ", replicated:" in c]
        sharded = "<br>".join(_short(c.split(": ", 1)[0]) for c in sh) or "nothing"
        replicated = "<br>".join(
            f"{_short(c.split(': ', 1)[0])} ({c.split(', replicated: ', 1)[1]})" for c in rep
        )
        bare = uncovered(r.get("weights", []), r["choices"])
        other = sorted({_short(re.sub(r"\.\d+\.", ".*.", w)) for w in bare})
        err = r.get("error", "").replace("|", "/").replace("\n", " ")[:300]
        secs = f"{r['seconds']:.1f}" if "seconds" in r else "-"
        out.append(
            f"| {r['family']} | {'yes' if r['builds'] else 'no'} | {sharded} | {replicated or '-'} "
            f"| {', '.join(other) or '-'} | {secs} | {err or '-'} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per family")
    ap.add_argument("--json", default="", help="write the rows (with tracebacks) here too")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(FAMILIES)
    rows = []
    for n in names:
        r = run(n, a.timeout)
        rows.append(r)
        status = "builds" if r["builds"] else f"FAILS: {r.get('error', '')[:200]}"
        print(f"{n}: {status} ({r.get('seconds', 0):.1f} s)", file=sys.stderr, flush=True)
    print(table(rows))
    built = sum(r["builds"] for r in rows)
    print(f"\n{built} of {len(rows)} families build at tp {TP} on {WORLD} fake ranks.")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
