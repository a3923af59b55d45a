"""FSDP x TP (``DataParallel(style, tp_size=2, tp_plan=...)``) on 2 x 2 gloo ranks.

Against one device training on the global batch (5 steps, fused AdamW, ``clip_grad_norm_``,
fp32), against FSDP2 ``fully_shard`` composed with ``parallelize_module`` by hand, and a DCP
checkpoint saved on 2 x 2 resumed on 4 x 1 and 1 x 4.

Tolerance: tensor parallelism sums a row-parallel matmul's partial products over the tp ranks,
and the vocabulary-parallel loss its log-sum-exp, in another order than one device does, so
values equal one device's up to float rounding (measured: losses within 4.8e-7, parameters
within 2.3e-6 after 5 steps on these models); 1e-5 bounds that with room. The built-in GPT's key
third of the fused ``qkv.bias`` is left out of the comparison (its exact gradient is 0, so Adam
turns rounding noise into lr-sized steps; see ``workers_expand._masked_diff``), and the GPT runs
AdamW with ``eps=1e-6``: some of its MLP weights get gradients of ~1e-8, where Adam's first step
``lr * g / (|g| + eps)`` magnifies a rounding difference of g by ``lr / eps``. Measured on
``blocks.1.fc.weight``: 3.1e-5 at eps 1e-8, 4.7e-6 at 1e-7, 5.3e-7 at 1e-6 (the difference
follows 1/eps: rounding, not a wrong gradient; SGD gives 1.2e-7).
"""

from __future__ import annotations

import os

import pytest

from tests.dist import workers_tp
from tests.dist.launcher import run_ranks

TOL = 1e-5
COL = ("_S(0, 2)", "S(0)")  # column-parallel: tp splits the rows, then each piece's rows over dp
ROW = ("S(0)", "S(1)")  # row-parallel: tp splits the columns, dp the rows


def _check(results: list[dict], name: str) -> None:
    for rank, r in enumerate(results):
        assert r["moved"] > 1e-3, "the reference did not train"
        assert r["loss_diff"] < TOL, f"rank {rank}: loss differs by {r['loss_diff']}"
        assert r["param_diff"] < TOL, f"rank {rank}: {r['worst']} differs by {r['param_diff']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt", "hf_llama", "hf_llama_sp", "hf_qwen2", "hf_mixtral", "hf_gpt2"])
def test_fsdp_x_tp_matches_one_device(name: str) -> None:
    """HF Llama and Qwen2 with grouped-query attention (4 query, 2 key/value heads: one of each per
    tp rank), Mixtral with its experts replicated over tp (HF's grouped_mm op has no sharding rule:
    it runs on replicated inputs), GPT-2 with its transposed Conv1D projections and fused qkv, the
    built-in GPT with its fused qkv and tied head; ``hf_llama_sp`` is Llama with torchtitan's
    sequence-parallel plan (norms and residuals split on the sequence), run with ``async_tp=2``:
    each sequence-parallel gather and scatter next to a matmul in two batch chunks."""
    optim = "adamw:1e-6" if name == "gpt" else "adamw"
    kw = {"optim": optim, "async_tp": 2 if name == "hf_llama_sp" else False}
    results = run_ranks(_with_options, 4, name, kw, timeout=280)
    _check(results, name)
    # 2 chunks each: per layer, forward and backward, attention and MLP, a gather and a scatter
    # (16); the vocabulary-parallel head's gather in forward and scatter in backward (2)
    assert results[0]["chunked"] == (36 if name == "hf_llama_sp" else 0)
    pl, shapes = results[0]["placements"], results[0]["local_shapes"]
    if name == "gpt":
        assert pl["blocks.0.qkv.weight"] == COL and shapes["blocks.0.qkv.weight"] == (24, 32)
        assert pl["blocks.0.out.weight"] == ROW and shapes["blocks.0.out.weight"] == (16, 64)
        assert pl["tok.weight"] == COL  # vocabulary-parallel embedding, tied to the head
        assert pl["ln_f.weight"] == ("S(0)", "R")
    elif name == "hf_gpt2":  # Conv1D stores (in, out): column-parallel splits dim 1
        assert pl["transformer.h.0.attn.c_attn.weight"] == ("S(0)", "S(1)")
        assert shapes["transformer.h.0.attn.c_attn.weight"] == (16, 48)
        assert pl["transformer.h.0.attn.c_proj.weight"] == COL
    else:
        attn = "model.layers.0.self_attn"
        assert pl[f"{attn}.k_proj.weight"] == COL and shapes[f"{attn}.k_proj.weight"] == (4, 32)
        assert pl[f"{attn}.o_proj.weight"] == ROW and shapes[f"{attn}.o_proj.weight"] == (16, 16)
        assert pl["lm_head.weight"] == COL and pl["model.embed_tokens.weight"] == COL


# Hugging Face causal LMs with Llama's module names, under tp_plans.llama() unchanged: each matched
# one device (fused AdamW eps 1e-6: Gemma2's softcapped attention gives some weights ~1e-8
# gradients, where Adam magnifies rounding by lr / eps; with SGD it is within 3.2e-8). Run with
# SPMD_SWEEP_FULL=1 (15-30 s each on 2 cores); the suite runs Llama, Qwen2 and Mixtral above.
MORE_HF = ["Qwen3", "Mistral", "Gemma", "Gemma2", "Olmo", "Olmo2", "Cohere", "Granite", "StableLm"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("SPMD_SWEEP_FULL"), reason="the long sweep: SPMD_SWEEP_FULL=1")
@pytest.mark.parametrize("arch", MORE_HF)
def test_more_hf_architectures(arch: str) -> None:
    results = run_ranks(
        workers_tp.vs_single_device, 4, f"hf:{arch}", "fully_shard", 2, 5, "adamw:1e-6", timeout=280
    )
    _check(results, arch)


@pytest.mark.timeout(400)
def test_replicate_x_tp_remat_and_chunked_head() -> None:
    """DDP-like data dimension with TP (built-in GPT), and fully_shard x TP with full remat, the
    chunked loss head and gradient accumulation over two micro-batches (HF Llama)."""
    results = run_ranks(workers_tp.vs_single_device, 4, "gpt", "replicate", 2, 5, "adamw:1e-6", timeout=280)
    _check(results, "gpt")
    assert results[0]["placements"]["blocks.0.qkv.weight"] == ("R", "S(0)")
    for kw in ({"remat": "full"}, {"chunked_loss": True}, {"accumulate": 2}):
        results = run_ranks(_with_options, 4, "hf_llama", kw, timeout=280)
        _check(results, f"hf_llama {kw}")


@pytest.mark.timeout(400)
def test_hybrid_shard_x_tp_on_eight_ranks() -> None:
    """3-D: replicate 2 x shard 2 x tp 2 (HSDP x TP) from an explicit DeviceMesh, HF Llama."""
    results = run_ranks(
        _with_options, 8, "hf_llama", {"style": "hybrid_shard", "mesh_shape": (2, 2, 2)}, timeout=380
    )
    _check(results, "hf_llama hybrid")
    assert results[0]["placements"]["model.layers.0.self_attn.q_proj.weight"] == ("R", "_S(0, 2)", "S(0)")


def _with_options(rank: int, world: int, name: str, kw: dict) -> dict:
    return workers_tp.vs_single_device(rank, world, name, **kw)


@pytest.mark.timeout(300)
def test_matches_fsdp2_with_parallelize_module(tmp_path) -> None:
    """The same plan by hand (``parallelize_module`` on the tp sub-mesh, FSDP2 per decoder layer on
    the data one), same data per data rank. Losses equal; parameters within TOL (eager DTensor and
    the whole-step expansion sum partial products in other orders); every tensor-parallel
    parameter has FSDP2's placements (FSDP2 keeps the others 1-D on the data mesh, which DCP
    treats as the same sharding); FSDP2's DCP checkpoint loads into spmd's state bit for bit."""
    results = run_ranks(workers_tp.vs_fsdp2, 4, "hf_llama", 2, 4, str(tmp_path), timeout=280)
    for rank, r in enumerate(results):
        assert r["loss_diff"] < TOL, f"rank {rank}: loss differs by {r['loss_diff']}"
        assert r["param_diff"] < TOL, f"rank {rank}: {r['worst']} differs by {r['param_diff']}"
        tp_diffs = [d for d in r["placement_diffs"] if "layernorm" not in d and "model.norm" not in d]
        assert not tp_diffs, tp_diffs
        assert not r["loaded_diffs"], f"rank {rank}: FSDP2's checkpoint loaded wrong: {r['loaded_diffs']}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("load", [(4, 1), (1, 4)], ids=["4x1", "1x4"])
def test_checkpoint_resumes_on_another_mesh(load: tuple[int, int], tmp_path) -> None:
    """Saved on 2 x 2 (fully_shard x TP), loaded bit for bit on 4 x 1 (plain fully_shard) and on
    1 x 4 (TP over all four ranks), and the next step trains on."""
    results = run_ranks(workers_tp.resume_other_mesh, 4, "gpt", (2, 2), load, str(tmp_path), timeout=380)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
