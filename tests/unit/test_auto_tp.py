"""Automatic tensor-parallel placements (spmd.parallel.auto_tp) on traced steps under the fake
process group: the solver's choice on a standard Llama block, what the DTensor check refuses,
determinism, and the configuration around it. The parity tests are tests/dist/test_auto_tp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import spmd
from spmd.frontend import optim as optim_utils
from spmd.frontend import step_inputs, tracing
from spmd.parallel import auto_tp
from tests.unit.fake_pg import fake_process_group

V = 64


def _llama(kv_heads: int = 2) -> nn.Module:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg)


def _step(model, optim, ids, labels):
    model(input_ids=ids, labels=labels).loss.backward()
    optim.step()
    optim.zero_grad()


def _choose(
    model: nn.Module, tp: int, times: int = 1, profile=None, vocab: int = V, seq: int = 8
) -> auto_tp.AutoPlan:
    """Trace the step on the undistributed model (as spmd.compile does) and choose for tp ranks
    (``times`` solves of the same trace; the last is returned, all must agree), priced on
    ``profile`` (None: the local device's; none under the tests' conftest)."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, vocab, (2, seq))
    args = step_inputs.split_args((model, optim, ids, ids.roll(-1, 1)), {})
    optim_utils.ensure_state(optim, list(model.parameters()))
    traced = tracing.trace_step(
        _step, args, step_inputs.lift_state(model, optim), casts=None, accumulate_after_reduce=False
    )
    mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp_shard", "tp"))
    first = auto_tp.choose(model, traced.gm, mesh, profile)
    for _ in range(times - 1):
        again = auto_tp.choose(model, traced.gm, mesh, profile)
        assert list(again.plan) == list(first.plan) and again.placements == first.placements
    return first


def _layouts(plan: dict) -> dict:
    """A plan's entries as comparable values: each style's type and activation layouts."""
    keys = ("input_layouts", "output_layouts", "sequence_sharding")
    return {k: (type(v).__name__, *(getattr(v, a, None) for a in keys)) for k, v in plan.items()}


def test_llama_block_gets_torchtitans_plan() -> None:
    """Column-parallel q/k/v and gate/up, row-parallel o and down, the embedding and the head
    split on the vocabulary: torchtitan's Llama plan, found from the graph (grouped-query
    attention: 4 query, 2 key/value heads, one of each per rank). The repeated layers are one
    class each for attention and MLP, written as one pattern. A second solve gives the same
    choice, and resolving the written plan (what tp_plan_of hands a user to freeze) gives the
    chosen placements. Between the regions the norms and residuals split on the sequence:
    the plan is torchtitan's sequence-parallel one, layouts included
    (``tp_plans.llama(sequence_parallel=True)``), and without it torchtitan's plain one."""
    from spmd.parallel import tp_plans
    from spmd.parallel.tensor_parallel import resolve_plan

    model = _llama()
    with fake_process_group(2):
        choice = _choose(model, 2, times=2)
    resolved = resolve_plan(model, spmd.tp_plan_of(model)).params
    assert {k: v for k, v in resolved.items() if isinstance(v, Shard)} == choice.placements
    col, row = ColwiseParallel, RowwiseParallel
    want = {
        "model.embed_tokens": row,
        "model.layers.*.self_attn.q_proj": col,
        "model.layers.*.self_attn.k_proj": col,
        "model.layers.*.self_attn.v_proj": col,
        "model.layers.*.self_attn.o_proj": row,
        "model.layers.*.mlp.gate_proj": col,
        "model.layers.*.mlp.up_proj": col,
        "model.layers.*.mlp.down_proj": row,
        "lm_head": col,
        "model.norm": SequenceParallel,
        "model.layers.*.input_layernorm": SequenceParallel,
        "model.layers.*.post_attention_layernorm": SequenceParallel,
    }
    assert {k: type(v) for k, v in choice.plan.items()} == want
    assert _layouts(choice.plan) == _layouts(tp_plans.llama(sequence_parallel=True))
    off = tp_plans.without_sequence_parallel(choice.plan)
    assert _layouts(off) == _layouts(tp_plans.llama())
    assert choice.placements["model.layers.1.self_attn.o_proj.weight"] == Shard(1)
    kinds = sorted((d.regions[0].kind, len(d.regions), d.sharded) for d in choice.decisions if d.regions)
    assert kinds == [("embedding", 1, True), ("head", 1, True), ("pair", 2, True), ("pair", 2, True)]
    assert "column -> row, sharded: saves" in choice.reasons["model.layers.0.mlp.down_proj.weight"]
    assert choice.reasons["model.layers.1.input_layernorm.weight"].startswith(
        "model.layers.*.input_layernorm, model.layers.*.post_attention_layernorm, model.norm: "
        "sequence-parallel, sharded: the values between the regions split on the sequence (dim 1): saves"
    )


def _slow_link():
    """An H100 whose link takes 1 ms per ring step: every all-reduce costs 2 ms."""
    import dataclasses

    from spmd.profiles import PROFILES

    return dataclasses.replace(PROFILES["h100-80gb"], name="slow-link", intra_node_latency_s=1e-3)


def test_llama_block_priced_on_an_h100_gets_torchtitans_plan() -> None:
    """Priced by the cost model on h100-80gb at a Llama's proportions (d 512, ffn 2048, 8 query and
    4 key/value heads, 2 x 256 tokens, fp32), every class pays and the choice is torchtitan's
    sequence-parallel plan; each reason gives the times. The MLP saves more matmul time than its
    two all-reduces cost; sequence parallelism adds time (the norms' gradient all-reduces, and a
    reduce-scatter + all-gather is slower than the all-reduce it replaces at NCCL's measured bus
    bandwidths) and is taken for the memory, within 5% of the step."""
    import transformers as tf

    from spmd.parallel import tp_plans
    from spmd.profiles import PROFILES

    cfg = tf.LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with fake_process_group(2):
        choice = _choose(tf.LlamaForCausalLM(cfg), 2, profile=PROFILES["h100-80gb"], vocab=4096, seq=256)
    assert _layouts(choice.plan) == _layouts(tp_plans.llama(sequence_parallel=True))
    assert all(d.sharded for d in choice.decisions)
    mlp = choice.reasons["model.layers.0.mlp.down_proj.weight"]
    assert "column -> row, sharded: saves " in mlp and "adds 4 all-reduces (4.0 MiB)" in mlp, mlp
    assert "on h100-80gb: saves " in mlp and mlp.endswith(" a step"), mlp
    sp = choice.reasons["model.norm.weight"]
    assert "sequence-parallel, sharded" in sp and "within 5% of the step's" in sp, sp


def test_a_region_that_does_not_pay_replicates() -> None:
    """A small matmul pair (8 -> 16 -> 8) on a slow link: its two all-reduces cost 4 ms, far more
    than the step's matmuls save and more than 5% of the step, and it saves a few KiB a rank with
    no memory to gain from: replicated, the reason in times. Without a profile (nothing to weigh)
    the same pair is sharded, as the tp degree asks; spmd.simulate's device is the profile the
    choice prices on."""
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with fake_process_group(2):
        slow = _trace_choose(mlp, lambda m, x: m(x).sum(), torch.randn(4, 8), profile=_slow_link())
        plain = _trace_choose(mlp, lambda m, x: m(x).sum(), torch.randn(4, 8))
    (pair,) = slow.decisions
    assert not pair.sharded and slow.placements == {} and slow.plan == {}
    assert pair.describe().startswith("0.weight -> 2.weight: column -> row, replicated: saves ")
    assert "adds 2 all-reduces (256 B) 4.00 ms on slow-link: costs 4.00 ms a step, more than 5%" in pair.why
    assert plain.decisions[0].sharded and "no device profile" in plain.decisions[0].why

    def step(model, optim, x):
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()

    compiled = spmd.compile(parallel_mode=spmd.DataParallel("replicate", tp_size=2))(step)
    optim = torch.optim.SGD(mlp.parameters(), lr=0.1)
    report = spmd.simulate(compiled, mlp, optim, torch.randn(4, 8), world_size=2, device=_slow_link())
    assert any("replicated" in c and "on slow-link" in c for c in report.tp_choices), report.tp_choices


def test_gpt2_conv1d_and_fused_qkv() -> None:
    """GPT-2's Conv1D stores its weight (in, out) and the graph uses it untransposed: the MLP's
    c_fc splits dim 1 (column) and c_proj dim 0 (row), written as the same styles. The fused
    c_attn's output is split into q, k, v: an even split would cut heads, so it splits strided
    (each rank its share of q, of k and of v: ``_StridedShard(1, split_factor=3)``, its bias on
    dim 0), written as parameter placements that resolve back to the same. The token embedding
    is tied to the head: one vocabulary split."""
    import transformers as tf

    from passes.torch_compat import StridedShard
    from spmd.parallel.tensor_parallel import resolve_plan

    cfg = tf.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg)
    with fake_process_group(2):
        choice = _choose(model, 2)
    assert choice.placements["transformer.h.0.mlp.c_fc.weight"] == Shard(1)
    assert choice.placements["transformer.h.1.mlp.c_proj.weight"] == Shard(0)
    assert choice.placements["transformer.wte.weight"] == Shard(0)
    assert type(choice.plan["transformer.h.*.mlp.c_fc"]) is ColwiseParallel
    attn = next(d for d in choice.decisions if "c_attn" in d.describe())
    assert attn.sharded, attn.describe()
    assert choice.placements["transformer.h.1.attn.c_attn.weight"] == StridedShard(1, split_factor=3)
    assert choice.placements["transformer.h.1.attn.c_attn.bias"] == StridedShard(0, split_factor=3)
    assert choice.placements["transformer.h.1.attn.c_proj.weight"] == Shard(0)
    assert choice.plan["transformer.h.*.attn.c_attn.weight"] == StridedShard(1, split_factor=3)
    resolved = resolve_plan(model, spmd.tp_plan_of(model)).params
    assert {k: v for k, v in resolved.items() if k in choice.placements} == choice.placements


def test_phi3_fused_projections_split_strided() -> None:
    """Phi-3 slices its fused qkv_proj into q, k, v and chunks gate_up_proj in two: both split
    strided over tp (dim 0 of an nn.Linear weight). With grouped key/value heads the parts are
    unequal (q twice k): a strided split by the common part gives each rank q heads the
    key/value heads it holds do not serve, DTensor redistributes at the attention, and the
    attention replicates with that reason (the MLP stays split)."""
    import transformers as tf

    from passes.torch_compat import StridedShard

    def phi3(kv: int) -> nn.Module:
        cfg = tf.Phi3Config(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=kv, max_position_embeddings=32, use_cache=False, pad_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)
        return tf.Phi3ForCausalLM(cfg)

    with fake_process_group(2):
        choice = _choose(phi3(4), 2)
        gqa = _choose(phi3(2), 2)
    assert choice.placements["model.layers.0.self_attn.qkv_proj.weight"] == StridedShard(0, split_factor=3)
    assert choice.placements["model.layers.0.mlp.gate_up_proj.weight"] == StridedShard(0, split_factor=2)
    assert choice.placements["model.layers.1.self_attn.o_proj.weight"] == Shard(1)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in gqa.placements
    attn = next(d for d in gqa.decisions if "qkv_proj" in d.describe())
    assert not attn.sharded and "DTensor redistributes inside it" in attn.why
    assert gqa.placements["model.layers.0.mlp.gate_up_proj.weight"] == StridedShard(0, split_factor=2)


def test_per_head_qk_norms_keep_attention_split() -> None:
    """Qwen3 (and Gemma 3) normalise q and k per head (an RMSNorm over head_dim after the view
    into heads): the norm's mean reduces within one head, so a column split into whole heads
    stays on its rank and q/k/v -> o is one clean region. OLMo 2's q/k norms are over all the
    projection's features: split, each rank sums its share and the mean is all-reduced (a
    [tokens, 1] statistic), which the DTensor check accepts and the price counts (two per norm,
    forward and backward: 2 + 2 x 2 per layer). Its row outputs' post-norms still stop there."""
    import transformers as tf

    common = dict(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with fake_process_group(2):
        choice = _choose(tf.Qwen3ForCausalLM(tf.Qwen3Config(**common)), 2)
        olmo2 = _choose(tf.Olmo2ForCausalLM(tf.Olmo2Config(**common)), 2)
    assert choice.placements["model.layers.0.self_attn.q_proj.weight"] == Shard(0)
    assert choice.placements["model.layers.1.self_attn.k_proj.weight"] == Shard(0)
    assert type(choice.plan["model.layers.*.self_attn.q_proj"]) is ColwiseParallel
    assert olmo2.placements["model.layers.0.self_attn.q_proj.weight"] == Shard(0)
    assert olmo2.placements["model.layers.1.self_attn.k_proj.weight"] == Shard(0)
    assert olmo2.placements["model.layers.0.self_attn.o_proj.weight"] == Shard(1)
    attn = next(d for d in olmo2.decisions if "q_proj" in d.describe())
    assert attn.sharded and attn.price.collectives == 2 * (2 + 2 * 2), attn.describe()
    assert olmo2.placements["model.layers.0.mlp.down_proj.weight"] == Shard(1)


def test_gemma2_builds_with_eager_attention() -> None:
    """Gemma 2 has no sdpa path in transformers (soft-capped attention logits): a config built by
    spmd.models.hf_config asks for eager attention for it (sdpa for the others), and its
    attention and MLP split like Llama's."""
    from spmd import models

    cfg = {
        "model_type": "gemma2", "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 32, "sliding_window": 8,
    }  # fmt: skip
    assert models.hf_config(cfg)._attn_implementation == "eager"
    assert models.hf_config({**cfg, "model_type": "llama"})._attn_implementation == "sdpa"
    torch.manual_seed(0)
    model = models.build_hf(cfg, batch=2, seq=8, fake=False)[0]
    with fake_process_group(2):
        choice = _choose(model, 2)
    assert choice.placements["model.layers.0.self_attn.q_proj.weight"] == Shard(0)
    assert choice.placements["model.layers.0.mlp.down_proj.weight"] == Shard(1)


def test_dtensor_check_replicates_what_would_redistribute() -> None:
    """tp 4 with 2 key/value heads: k_proj and v_proj split into half heads, so DTensor must
    redistribute inside attention: the attention class replicates (the reason names the op and
    module), the MLP still splits. A linear whose output reaches a norm first is no candidate."""
    with fake_process_group(4):
        choice = _choose(_llama(kv_heads=2), 4)
    attn = next(d for d in choice.decisions if "q_proj" in d.describe())
    assert not attn.sharded and "DTensor redistributes inside it" in attn.why and "self_attn" in attn.why
    assert choice.placements["model.layers.0.mlp.down_proj.weight"] == Shard(1)
    assert "model.layers.0.self_attn.q_proj.weight" not in choice.placements
    # Attention left whole mixes the tokens a sequence split would divide: no sequence parallelism.
    seq = choice.decisions[-1].describe()
    assert "sequence-parallel, replicated: DTensor redistributes on it" in seq and "self_attn" in seq
    assert not any(isinstance(v, SequenceParallel) for v in choice.plan.values())
    assert choice.plan["model.layers.*.mlp.down_proj"].output_layouts == (Replicate(),)

    class NormBetween(nn.Module):  # up -> LayerNorm -> down: a column split would be gathered
        def __init__(self) -> None:
            super().__init__()
            self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.norm(self.up(x)))

    def step(model, optim, x):
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()

    model = NormBetween()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    args = step_inputs.split_args((model, optim, torch.randn(4, 8)), {})
    traced = tracing.trace_step(
        step, args, step_inputs.lift_state(model, optim), casts=None, accumulate_after_reduce=False
    )
    shapes = {"up.weight": (16, 8), "up.bias": (16,), "down.weight": (8, 16), "down.bias": (8,)}
    assert auto_tp.find_regions(traced.gm, shapes) == []


class _Tokens(nn.Module):
    """Embedding -> norm -> up -> down (+ residual) -> [cumsum over the sequence] -> norm -> head."""

    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.mix = mix
        self.emb, self.norm1, self.norm2 = nn.Embedding(V, 16), nn.LayerNorm(16), nn.LayerNorm(16)
        self.up, self.down, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.down(torch.relu(self.up(self.norm1(h))))
        if self.mix:
            h = h.cumsum(1)  # every position reads the ones before it
        return self.head(self.norm2(h))


def _trace_choose(model: nn.Module, loss, *inputs: torch.Tensor, profile=None) -> auto_tp.AutoPlan:
    def step(model, optim, *xs):
        loss(model, *xs).backward()
        optim.step()
        optim.zero_grad()

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    args = step_inputs.split_args((model, optim, *inputs), {})
    traced = tracing.trace_step(
        step, args, step_inputs.lift_state(model, optim), casts=None, accumulate_after_reduce=False
    )
    return auto_tp.choose(
        model, traced.gm, init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "tp")), profile
    )


def test_routed_experts_split_on_their_ffn_dimension_where_it_pays() -> None:
    """Experts multiplied by ``grouped_mm`` (tokens [S, d] by experts [E, ffn, d]; up, ReLU, down)
    form a column -> row region: up split on its ffn rows (Shard(1)), down on its ffn columns
    (Shard(2)), clean by DTensor's own grouped_mm strategy (tests/dist/test_auto_tp.py checks the
    values). The cost model decides: on an H100 the split of this tiny layer costs
    more than the step (replicated); on a device whose matmuls run at 1 GFLOP/s it saves time."""
    import dataclasses

    from spmd.profiles import PROFILES
    from tests.dist.workers_tp import PlainExperts

    ids = torch.randint(0, V, (2, 8))

    def ce(model, ids):
        return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())

    slow_mm = dataclasses.replace(PROFILES["h100-80gb"], name="slow-matmul", peak_flops={"fp32": 1e9})
    torch.manual_seed(0)
    with fake_process_group(2):
        plain = _trace_choose(PlainExperts(), ce, ids)
        h100 = _trace_choose(PlainExperts(), ce, ids, profile=PROFILES["h100-80gb"])
        slow = _trace_choose(PlainExperts(), ce, ids, profile=slow_mm)
    assert plain.placements["experts.up"] == Shard(1) and plain.placements["experts.down"] == Shard(2)
    assert plain.plan["experts.up"] == Shard(1)
    experts = "experts.up -> experts.down: column -> row, "
    assert h100.reasons["experts.up"].startswith(experts + "replicated: saves "), h100.reasons["experts.up"]
    assert "experts.up" not in h100.placements
    assert slow.reasons["experts.up"].startswith(experts + "sharded: saves "), slow.reasons["experts.up"]
    assert slow.placements["experts.down"] == Shard(2)
    assert "on slow-matmul: saves " in slow.reasons["experts.up"]


def test_sequence_parallel_only_where_every_op_is_token_wise() -> None:
    """The values between the regions split on the sequence when every op there works token by
    token (norms, the residual add); a cumulative sum over the sequence there, or a loss summed
    over the tokens of a row-parallel output (a partial sum per rank, no collective), keeps them
    replicated."""
    ids = torch.randint(0, V, (2, 8))

    def ce(model, ids):
        return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())

    with fake_process_group(2):
        plain = _trace_choose(_Tokens(mix=False), ce, ids)
        mixed = _trace_choose(_Tokens(mix=True), ce, ids)
        mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        summed = _trace_choose(mlp, lambda m, x: m(x).sum(), torch.randn(4, 8))
    assert type(plain.plan["norm1"]) is SequenceParallel and type(plain.plan["norm2"]) is SequenceParallel
    assert plain.plan["down"].output_layouts == (Shard(1),) and plain.plan["emb"].output_layouts == (
        Shard(1),
    )
    assert plain.decisions[-1].describe().startswith("norm1, norm2: sequence-parallel, sharded: ")
    seq = mixed.decisions[-1]
    assert not seq.sharded and "aten.cumsum" in seq.why, seq.why
    assert not any(isinstance(v, SequenceParallel) for v in mixed.plan.values())
    assert mixed.plan["down"].output_layouts == (Replicate(),)
    assert not summed.decisions[-1].sharded and "aten.sum" in summed.decisions[-1].why
    assert summed.plan["2"].output_layouts == (Replicate(),)


def test_configuration() -> None:
    """tp ranks without a plan mean automatic placements; the model cannot be distributed before
    the step is traced; tp_plan_of before any choice names the fix."""
    mode = spmd.DataParallel("fully_shard", tp_size=2)
    assert mode.tp_plan == "auto"
    with pytest.raises(spmd.ConfigError, match="tp_plan must be a dict"):
        spmd.DataParallel("fully_shard", tp_size=2, tp_plan="automatic")
    with pytest.raises(spmd.ConfigError, match="no automatic tensor-parallel choice"):
        spmd.tp_plan_of(nn.Linear(2, 2))
    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        with pytest.raises(spmd.ConfigError, match="Call the step first"):
            mode.distribute(model)
        with torch.device("meta"):
            meta = nn.Linear(4, 4)
        with pytest.raises(spmd.ConfigError, match="on the meta device"):
            mode.needs_trace_before_prepare(meta)


def test_report_and_dump_show_the_choice(tmp_path) -> None:
    """A compiled step with automatic placements (built-in GPT, 2 x 2 under the fake process
    group): the report lists each candidate class with its verdict and reason (the sequence-parallel
    one too: refused here), the dump's header each parameter's placement followed by its class's
    line, and tp_plan_of the equivalent plan."""
    from spmd.models import CONFIGS, GPT, train_step

    torch.manual_seed(0)
    model = GPT(CONFIGS["tiny"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.randint(0, 64, (2, 16))
    mode = spmd.DataParallel("fully_shard", tp_size=2)
    step = spmd.compile(parallel_mode=mode, dump_dir=str(tmp_path))(train_step)
    with fake_process_group(4):
        step(model, optim, idx, idx.roll(-1, 1))
        choices = step.report().tp_choices
    assert any(
        c.startswith("blocks.*.fc.weight -> blocks.*.out.weight (x2): column -> row, sharded")
        for c in choices
    )
    # The fused qkv splits strided (each rank its share of q, k and v); written as parameter
    # placements (no style), its input is read whole: no sequence parallelism, and the line says why.
    assert any(
        c.startswith("blocks.*.qkv.weight -> blocks.*.proj.weight (x2): column -> row, sharded")
        for c in choices
    )
    seq = "blocks.*.ln1, blocks.*.ln2, ln_f: sequence-parallel, replicated"
    assert any(c.startswith(seq) and "aten.addmm.default in 'blocks.0.qkv'" in c for c in choices)
    final = next(tmp_path.glob("**/rank0/*_final.py")).read_text()
    assert "# blocks.0.out.weight: (Shard(dim=0), Shard(dim=1))" in final
    # Split strided on dim 0 over tp, the fused weight replicates over the data dimension.
    assert "# blocks.0.qkv.weight: (Replicate(), _StridedShard(dim=0, sf=3))" in final
    assert "(tp: blocks.*.fc.weight -> blocks.*.out.weight (x2): column -> row, sharded: saves" in final
    ln1 = next(line for line in final.splitlines() if line.startswith("# blocks.0.ln1.weight: "))
    assert f"(tp: {seq}" in ln1
    assert type(spmd.tp_plan_of(model)["blocks.*.fc"]) is ColwiseParallel


def test_mla_keys_built_in_new_empty_stay_split() -> None:
    """DeepSeek-V2's MLA builds its keys with ``new_empty`` (last dimension nope + rope, its
    input's nope + v) and copies the heads' parts into slices: the new tensor follows its input's
    split on heads (expand_rules), so q_b/kv_b -> o is one clean region (replicated, the copy
    gathered the heads)."""
    from spmd import models

    cfg = {
        "model_type": "deepseek_v2", "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 32, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 1, "n_routed_experts": 2,
        "num_experts_per_tok": 1, "moe_intermediate_size": 16, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1,
    }  # fmt: skip
    torch.manual_seed(0)
    model = models.build_hf(cfg, batch=2, seq=8, fake=False)[0]
    with fake_process_group(2):
        choice = _choose(model, 2)
    assert choice.placements["model.layers.0.self_attn.kv_b_proj.weight"] == Shard(0)
    assert choice.placements["model.layers.0.self_attn.q_b_proj.weight"] == Shard(0)
    assert choice.placements["model.layers.0.self_attn.o_proj.weight"] == Shard(1)


def test_mixtrals_fused_gate_up_experts_split_strided() -> None:
    """Mixtral's experts: one fused ``gate_up_proj`` [E, 2 ffn, d] whose grouped_mm output is
    chunked into gate and up. Split strided (each rank its share of gate and of up), the experts'
    matmuls run on the local pieces (expand_rules.strided_as_shard: DTensor's grouped_mm strategy
    takes no strided split) and the previous layer's partial output is all-reduced where the
    experts read it: clean, so split (no profile under the tests: a clean class is split).
    tests/dist/test_auto_tp.py checks the values against one device."""
    pytest.importorskip("transformers")
    import transformers as tf

    from tests.dist.workers_tp import _LLAMA

    cfg = tf.MixtralConfig(**_LLAMA, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(cfg)
    with fake_process_group(2):
        choice = _choose(model, 2)
    pl = choice.placements
    assert str(pl["model.layers.1.mlp.experts.gate_up_proj"]) == "_S(1, 2)", pl
    assert pl["model.layers.1.mlp.experts.down_proj"] == Shard(2)
