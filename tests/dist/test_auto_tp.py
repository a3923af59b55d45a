"""Automatic tensor-parallel placements (``DataParallel(style, tp_size=2)``, no ``tp_plan``) on gloo
ranks against one device: tensor parallelism alone on 2 ranks, FSDP x automatic TP on 2 x 2.

Same harness and bar as tests/dist/test_tensor_parallel.py (5 steps, fused AdamW with
``clip_grad_norm_``, fp32, within 1e-5; its docstring gives the measured rounding). Every model
runs AdamW with ``eps=1e-6``: some weights of the built-in GPT and of BERT get gradients of ~1e-8,
where Adam's first step magnifies a rounding difference by ``lr / eps`` (see that docstring).
Several models run in one spawn, and the suite splits the models between the two meshes to keep
its time small (8-30 s per model on 2 ranks on 2 shared cores: GPT-2 8 s, experts 10, Phi-3 11,
Qwen2 13, Llama 17, GPT 24, BERT 29, Mixtral 30); ``SPMD_SWEEP_FULL=1`` runs every model on both
meshes (measured before the experts, Phi-3, OLMo 2 and DeepSeek-V2 were added: the six others pass
on both, 99 s on 2 ranks and 134 s on 2 x 2 on quiet cores, 190 s and 254 s under load; OLMo 2 and
DeepSeek-V2, run once on both meshes alone, pass).
"""

from __future__ import annotations

import os

import pytest

from tests.dist import workers_tp
from tests.dist.launcher import run_ranks

TOL = 1e-5
MODELS = ["hf_llama", "hf_qwen2", "hf_gpt2", "hf_phi3", "hf_mixtral", "hf_bert", "gpt", "experts"]
MODELS += ["hf_olmo2", "hf_deepseek_v2"]
FULL = bool(os.environ.get("SPMD_SWEEP_FULL"))
ON_TWO = MODELS if FULL else ["hf_gpt2", "hf_phi3", "hf_mixtral", "hf_bert", "experts"]
ON_TWO_BY_TWO = MODELS if FULL else ["hf_llama", "gpt"]
SLACK = 3 if FULL else 1  # the full sweep runs three times the models
# A parameter every model must have split over tp (a column -> row region of its MLP).
SPLIT = {
    "hf_llama": "model.layers.0.mlp.down_proj.weight",
    "hf_qwen2": "model.layers.0.mlp.down_proj.weight",
    "hf_gpt2": "transformer.h.0.mlp.c_proj.weight",
    "hf_phi3": "model.layers.0.mlp.down_proj.weight",
    "hf_olmo2": "model.layers.0.self_attn.q_proj.weight",  # q/k norms over the whole projection
    "hf_deepseek_v2": "model.layers.0.self_attn.kv_b_proj.weight",  # MLA
    "hf_mixtral": "model.layers.0.mlp.experts.down_proj",  # routed experts, split on ffn
    "hf_bert": "bert.encoder.layer.0.output.dense.weight",
    "gpt": "blocks.0.out.weight",
    "experts": "experts.down",  # routed experts (grouped_mm) split on their ffn dimension
}


def _check(results: list[dict], tp_dim: int) -> None:
    for rank, per_model in enumerate(results):
        for name, r in per_model.items():
            assert r["moved"] > 1e-3, f"{name}: the reference did not train"
            assert r["loss_diff"] < TOL, f"rank {rank} {name}: loss differs by {r['loss_diff']}"
            assert r["param_diff"] < TOL, f"rank {rank} {name}: {r['worst']} differs by {r['param_diff']}"
            assert r["placements"][SPLIT[name]][tp_dim].startswith("S("), (name, r["tp_choices"])
            assert r["tp_plan"] and r["tp_choices"], name


@pytest.mark.timeout(300 * SLACK)
def test_automatic_tp_on_two_ranks() -> None:
    results = run_ranks(workers_tp.auto_many, 2, ON_TWO, "fully_shard", 2, timeout=280 * SLACK)
    _check(results, 1)
    # BERT (post-norm, token types, a tied head behind a dense + LayerNorm) splits the values between
    # its regions on the sequence; GPT-2's fused c_attn, split strided (no style), reads them whole.
    assert any("sequence-parallel, sharded" in c for c in results[0]["hf_bert"]["tp_choices"])
    assert any("sequence-parallel, replicated" in c for c in results[0]["hf_gpt2"]["tp_choices"])
    # Experts: ungated ones split on their ffn dimension (up Shard(1), down Shard(2)).
    experts = results[0]["experts"]["placements"]
    assert experts["experts.up"][1] == "S(1)" and experts["experts.down"][1] == "S(2)", experts
    # Fused projections split strided over tp: each rank its share of q, k and v (of gate and up).
    gpt2, phi3 = results[0]["hf_gpt2"]["placements"], results[0]["hf_phi3"]["placements"]
    assert gpt2["transformer.h.0.attn.c_attn.weight"][1] == "_S(1, 3)"
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"][1] == "_S(0, 3)"
    assert phi3["model.layers.1.mlp.gate_up_proj.weight"][1] == "_S(0, 2)"
    # Mixtral's fused gate_up splits strided too (each rank its share of gate and of up) and its
    # experts' matmuls run on it (expand_rules.strided_as_shard): the experts split on ffn.
    mixtral = results[0]["hf_mixtral"]["placements"]
    assert mixtral["model.layers.0.mlp.experts.gate_up_proj"][1] == "_S(1, 2)", mixtral
    assert mixtral["model.layers.0.mlp.experts.down_proj"][1] == "S(2)", mixtral


@pytest.mark.timeout(400 * SLACK)
def test_fsdp_x_automatic_tp_on_two_by_two() -> None:
    results = run_ranks(workers_tp.auto_many, 4, ON_TWO_BY_TWO, "fully_shard", 2, timeout=380 * SLACK)
    _check(results, 1)
    llama = results[0]["hf_llama"]
    # Sequence parallelism between the regions, chosen by spmd: torchtitan's SP plan's entries.
    assert "model.layers.*.input_layernorm" in llama["tp_plan"] and "model.norm" in llama["tp_plan"]
    assert any("sequence-parallel, sharded" in c for c in llama["tp_choices"]), llama["tp_choices"]
    assert llama["placements"]["model.layers.0.self_attn.k_proj.weight"] == ("_S(0, 2)", "S(0)")
    assert llama["placements"]["model.layers.0.self_attn.o_proj.weight"] == ("S(0)", "S(1)")
    # The built-in GPT's fused qkv splits strided over tp and, on dim 0, replicates over dp.
    assert results[0]["gpt"]["placements"]["blocks.0.qkv.weight"] == ("R", "_S(0, 3)")
