"""spmd.simulate and spmd.plan with tensor parallelism (FSDP x TP) on the fake process group.

simulate builds a 2-D step at 256 ranks; a TP plan adds tp sizes to the plan's search, each row
names its mesh and splits its bytes by mesh dimension, the best line is runnable code, and a
model of identical blocks is searched folded with TP as without (the extrapolation equals the
exact lowering). The built-in GPT (tiny, or 4 blocks) on the H100 profile.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd
from spmd import models
from spmd.models import GPT, GPTConfig
from spmd.parallel import tp_plans
from spmd.plan import NamedPlan, _scaled_batch, plan
from spmd.plan.__main__ import default_tp_plan

W = 8


def test_simulate_builds_a_2d_step_at_256_ranks_and_splits_its_collectives() -> None:
    """The built-in GPT, fully_shard x tp 4 on 256 fake ranks (a (dp_shard 64, tp 4) mesh): the
    report lists the activations' collectives on tp apart from the parameters' on dp_shard."""
    model, optim, idx, targets = models.build("tiny", batch=2, fake=True)
    mode = spmd.DataParallel("fully_shard", tp_size=4, tp_plan=tp_plans.gpt())
    rep = spmd.simulate(
        spmd.compile(parallel_mode=mode)(models.train_step), model, optim, idx, targets, world_size=256
    )
    by_dim = rep.collectives_by_dim
    assert set(by_dim) == {"dp_shard", "tp"}
    assert "reduce_scatter" in by_dim["dp_shard"] and "all_reduce" in by_dim["tp"]  # grads / activations
    assert sum(rep.comm_bytes_by_dim().values()) == rep.comm_bytes


def _gpt4():
    with FakeTensorMode():
        model = GPT(GPTConfig(vocab=64, seq=16, d_model=32, n_layers=4, n_heads=4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.zeros(2, 16, dtype=torch.long)
    return model, optim, idx, idx.clone()


@pytest.fixture(scope="module")
def tp_plan_rows() -> spmd.Plan:
    return plan(
        spmd.compile()(models.train_step),
        *_gpt4(),
        world_size=W,
        device="h100-80gb",
        styles=("fully_shard",),
        prefetch=(1,),
        min_unit_mb=(1.0,),
        reshard=(True,),
        remat=(None,),
        tp_plan=NamedPlan(tp_plans.gpt(), "tp_plans.gpt()"),
        tp=(1, 2),
        fold_depths=(1, 2),
    )


def test_tp_sizes_join_the_search_with_their_mesh_and_runnable_code(tp_plan_rows: spmd.Plan) -> None:
    rows = {r.options.get("tp_size", 1): r for r in tp_plan_rows.rows}
    assert set(rows) == {1, 2}
    tp = rows[2]
    assert "tp 2" in tp.label and tp.mesh == "dp_shard 4 x tp 2" and rows[1].mesh == "dp_shard 8"
    assert set(tp.comm_bytes_by_dim) == {"tp", "dp_shard"} and set(rows[1].comm_bytes_by_dim) == {"world"}
    assert sum(tp.comm_bytes_by_dim.values()) == tp.comm_bytes
    assert tp.code.startswith("import spmd; from spmd.parallel import tp_plans; spmd.compile(")
    scope: dict = {}
    exec(tp.code.replace("spmd.compile(", "step = spmd.compile(", 1), scope)
    mode = scope["step"](models.train_step).parallel_mode
    assert mode.tp_size == 2 and mode.parallel_style == "fully_shard"
    assert {k: type(v) for k, v in mode.tp_plan.items()} == {k: type(v) for k, v in tp_plans.gpt().items()}
    text = str(tp_plan_rows)
    assert " mesh " in text.splitlines()[1] and "dp_shard 4 x tp 2" in text
    assert f"best: {tp_plan_rows.best.code}" in text
    # tokens per GPU are the same: a tp group's data rank takes tp ranks' sequences
    assert tp.tokens_per_s == pytest.approx(tp_plan_rows.tokens_per_step / tp.step_s)


def test_folded_tp_row_matches_the_exact_lowering(tp_plan_rows: spmd.Plan) -> None:
    """The tp row was extrapolated from copies with 1 and 2 of the 4 blocks; simulate lowers the
    full model with the same configuration (and tp x the batch): the same peak and bytes."""
    assert tp_plan_rows.fold is not None
    tp = next(r for r in tp_plan_rows.rows if r.options.get("tp_size") == 2)
    assert not tp.exact
    opts = {k: v for k, v in tp.options.items() if k != "remat"}
    step = spmd.compile(parallel_mode=spmd.DataParallel(**opts), remat=None)(models.train_step)
    model, optim, idx, tgt = _gpt4()
    (idx, tgt), _ = _scaled_batch((idx, tgt), {}, 2)
    rep = spmd.simulate(step, model, optim, idx, tgt, world_size=W, device="h100-80gb")
    assert rep.peak_memory_bytes == tp.peak_bytes
    assert rep.comm_bytes == tp.comm_bytes and rep.comm_bytes_by_dim() == tp.comm_bytes_by_dim


def test_scaled_batch_repeats_the_batch_tp_times() -> None:
    (a, b), kw = _scaled_batch((torch.zeros(2, 5), 3), {"t": torch.ones(2)}, 4)
    assert a.shape == (8, 5) and b == 3 and kw["t"].shape == (8,)


def test_command_line_uses_the_llama_plan_for_llama_family_configs() -> None:
    args = argparse.Namespace(hf_config=None, preset="llama3.1-8b", model=None)
    p = default_tp_plan(args)
    assert isinstance(p, NamedPlan) and repr(p) == "tp_plans.llama(sequence_parallel=True)"
    assert p.keys() == tp_plans.llama(sequence_parallel=True).keys()
    assert default_tp_plan(argparse.Namespace(hf_config=None, preset=None, model="tiny")) == "auto"


def _tiny_llama() -> tuple:
    cfg = dict(models.PRESETS["llama3.1-8b"], model_type="llama", vocab_size=256)
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    cfg.update(num_attention_heads=8, num_key_value_heads=4)  # GQA, 1 key/value head per tp rank
    return models.build_hf(cfg, batch=2, seq=64)


def test_full_remat_recomputes_the_forward_with_its_tp_layouts() -> None:
    """remat="full" under TP on HF Llama: the recomputed forward (phase backward, copies of
    forward nodes) takes the forward's layouts at the planned modules' boundaries, not the
    gradients', so it lowers (it did not: the recomputed norm output entered q_proj split on
    the hidden dimension, and attention's output could not be viewed back) and repeats exactly
    the forward's tensor-parallel collectives. Backward's are Megatron's too."""
    tp_bytes = {}
    for remat in (None, "full"):
        mode = spmd.DataParallel("fully_shard", tp_size=4, tp_plan=tp_plans.llama())
        step = spmd.compile(parallel_mode=mode, remat=remat)(models.causal_lm_step)
        rep = spmd.simulate(step, *_tiny_llama(), world_size=W)
        tp_bytes[remat] = {k: c.bytes for k, c in rep.collectives_by_dim["tp"].items()}
    # Megatron's layout: one all-reduce per tensor-parallel region each way, nothing else on tp.
    # (Autograd's sum of q/k/v's input gradients once took q_proj's output-gradient layout,
    # Shard(-1): a reduce-scatter on the hidden dimension and an all-gather back, per layer.)
    assert set(tp_bytes[None]) == {"all_reduce"}, tp_bytes[None]
    # The recompute repeats the first layer's forward (backward reads the last layer's as
    # saved): its two row-parallel outputs' all-reduces (batch x seq x d, fp32) and the
    # vocabulary-parallel loss head's [tokens, 1] statistics; nothing else is added.
    extra = sum(tp_bytes["full"].values()) - sum(tp_bytes[None].values())
    assert extra == 2 * (2 * 64 * 256 * 4) + 2 * 64 * 4


def test_hybrid_shard_joins_the_tp_search_on_a_3d_mesh() -> None:
    """16 ranks on nodes of 8: hybrid_shard x tp 2 is searched on a (dp_replicate 2, dp_shard 4,
    tp 2) mesh, its bytes split over the three dimensions; at tp 8 a node holds one tp group
    (dp_shard 1, replicate's row): no hybrid_shard row."""
    from spmd.plan.space import configurations

    p = plan(
        spmd.compile()(models.train_step),
        *models.build("tiny", batch=2, fake=True),
        world_size=16, device="h100-80gb", gpus_per_node=8, styles=("hybrid_shard",), prefetch=(1,),
        remat=(None,), tp_plan=NamedPlan(tp_plans.gpt(), "tp_plans.gpt()"), tp=(2,), exact=True,
    )  # fmt: skip
    row = next(r for r in p.rows if r.options.get("tp_size") == 2)
    assert row.options["parallel_style"] == "hybrid_shard"
    assert row.mesh == "dp_replicate 2 x dp_shard 4 x tp 2"
    assert set(row.comm_bytes_by_dim) == {"dp_replicate", "dp_shard", "tp"}
    assert "DataParallel('hybrid_shard', tp_size=2," in row.expression
    at8 = configurations(
        world_size=64, gpus_per_node=8, mixed_precision=None, styles=("hybrid_shard",), prefetch=(1,),
        min_unit_mb=(1.0,), reshard=(True,), remat=(), tp_plan="auto", tp=(2, 8),
    )  # fmt: skip
    assert sorted(o.get("tp_size", 1) for o in at8) == [1, 2]
