"""Per-rank bodies of the FSDP x TP tests (module level, so forked ranks can import them).

Each model is a tiny configuration built in code (no download, no dropout: tensor-parallel ranks
draw their own random numbers, the single-device reference one stream) with a torchtitan-style
plan (``spmd.parallel.tp_plans``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import spmd
from passes.meta import ASYNC_TP_CHUNK
from spmd.parallel import tp_plans
from tests.dist.workers_expand import _masked_diff

V, T, B = 64, 8, 2  # vocabulary, sequence length, local batch
_LLAMA = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, use_cache=False,
)  # fmt: skip


class PlainExperts(nn.Module):
    """Embedding -> routed experts without a gate (up, ReLU, down: ``F.grouped_mm`` over the
    tokens in fixed groups by position, one per expert) + residual -> norm -> head. Experts a
    column -> row split divides on their ffn dimension, as Megatron splits an MLP (Mixtral's
    fused gate_up splits strided: tests/unit/test_auto_tp.py)."""

    def __init__(self, experts: int = 4, d: int = 32, ffn: int = 64) -> None:
        super().__init__()
        self.emb, self.norm, self.head = nn.Embedding(V, d), nn.LayerNorm(d), nn.Linear(d, V)
        self.experts = nn.Module()
        self.experts.up = nn.Parameter(torch.randn(experts, ffn, d) / d**0.5)
        self.experts.down = nn.Parameter(torch.randn(experts, d, ffn) / ffn**0.5)
        self.n_experts = experts

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # [B, T, d]
        b, t, d = x.shape
        # Routed by position: expert e takes positions [e T/E, (e+1) T/E) of every sequence, so a
        # token's expert does not depend on the batch around it (one device's reference runs
        # every data rank's batch at once). Tokens ordered by position, one group per expert.
        xt = x.transpose(0, 1).reshape(t * b, d)
        offs = (torch.arange(1, self.n_experts + 1) * (t // self.n_experts * b)).to(torch.int32)
        h = nn.functional.grouped_mm(xt, self.experts.up.transpose(-2, -1), offs=offs)
        h = nn.functional.grouped_mm(torch.relu(h), self.experts.down.transpose(-2, -1), offs=offs)
        h = h.view(t, b, d).transpose(0, 1)
        return self.head(self.norm(x + h))


def build(name: str) -> tuple[nn.Module, dict[str, Any], bool]:
    """(model, tp plan, whether the model returns HF outputs) for a test model name."""
    if name == "gpt":
        from spmd.models import CONFIGS, GPT

        return GPT(CONFIGS["tiny"]), tp_plans.gpt(), False
    if name == "experts":  # routed experts (grouped_mm); the plan is only for automatic placements
        return PlainExperts(), {}, False
    import transformers as tf

    if name == "hf_llama":  # grouped-query attention: 4 query heads, 2 key/value heads
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_LLAMA)), tp_plans.llama(), True
    if name == "hf_llama_sp":  # torchtitan's sequence parallelism
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_LLAMA)), tp_plans.llama(sequence_parallel=True), True
    if name == "hf_qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_LLAMA)), tp_plans.llama(), True
    if name == "hf_mixtral":  # experts replicated over tp (the plan does not name them)
        cfg = tf.MixtralConfig(**_LLAMA, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
        return tf.MixtralForCausalLM(cfg), tp_plans.llama(mlp=False), True
    if name.startswith("hf:"):  # any HF causal LM with Llama's module names: "hf:Qwen3"
        arch = name[3:]
        cfg = getattr(tf, f"{arch}Config")(**_LLAMA)
        return getattr(tf, f"{arch}ForCausalLM")(cfg), tp_plans.llama(), True
    if name == "hf_bert":  # masked LM with a tied decoder; the plan is only for automatic placements
        cfg = tf.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return tf.BertForMaskedLM(cfg), {}, True
    if name == "hf_phi3":  # fused qkv_proj (sliced) and gate_up_proj (chunked): strided splits
        cfg = tf.Phi3Config(**{**_LLAMA, "num_key_value_heads": 4}, pad_token_id=0)
        return tf.Phi3ForCausalLM(cfg), {}, True
    if name == "hf_olmo2":  # q/k norms over the whole projection: all-reduced statistics under tp
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**_LLAMA)), {}, True
    if name == "hf_deepseek_v2":  # MLA: keys built with new_empty + copy_ into slices
        cfg = tf.DeepseekV2Config(
            **{**_LLAMA, "num_key_value_heads": 4, "num_hidden_layers": 1}, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
            n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, topk_method="greedy",
            n_group=1, topk_group=1, attn_implementation="sdpa",
        )  # fmt: skip
        return tf.DeepseekV2ForCausalLM(cfg), {}, True
    if name == "hf_gpt2":  # transposed Conv1D weights
        cfg = tf.GPT2Config(
            vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(cfg), gpt2_plan(), True
    raise ValueError(name)


def _loss(model: nn.Module, hf: bool, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if hf:
        return model(input_ids=ids, labels=labels).loss
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make_step(hf: bool, clip: bool, accumulate: int = 1) -> Any:
    def train_step(model, optim, ids, labels):
        loss = 0
        for i, t in zip(ids.chunk(accumulate), labels.chunk(accumulate)):  # gradient accumulation
            micro = _loss(model, hf, i, t) / accumulate
            micro.backward()
            loss = loss + micro.detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        return loss

    return train_step


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, ids.roll(-1, dims=1)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def vs_single_device(
    rank: int,
    world: int,
    name: str,
    style: str = "fully_shard",
    tp: int = 2,
    steps: int = 5,
    optim: str = "adamw",
    accumulate: int = 1,
    mesh_shape: tuple[int, ...] | None = None,
    auto: bool = False,
    async_tp: bool | int | str = "auto",
    **compile_kw: Any,
) -> dict[str, Any]:
    """FSDP x TP (``style`` on the data dimension, ``tp`` ranks per tensor-parallel group) against
    one device training on the global batch (every data rank's batch), fused AdamW and
    ``clip_grad_norm_``; ``auto``: no plan, spmd chooses the placements. Returns the largest
    loss and parameter differences and each parameter's placements and local shape."""
    torch.manual_seed(0)  # the same initial values on every rank
    model, plan, hf = build(name)
    ref = copy.deepcopy(model)
    if optim.startswith("adamw"):
        eps = float(optim.split(":")[1]) if ":" in optim else 1e-8
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=eps, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=eps, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, fused=True)
    fn = make_step(hf, clip=True, accumulate=accumulate)
    if auto:
        plan = None
    if mesh_shape is None:
        mode = spmd.DataParallel(style, tp_size=tp, tp_plan=plan, async_tp=async_tp)
    else:  # an explicit mesh, e.g. (dp_replicate, dp_shard, tp) for hybrid_shard
        from torch.distributed.device_mesh import init_device_mesh

        names = ("dp_replicate", "dp_shard", "tp")[-len(mesh_shape) :]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        mode = spmd.DataParallel(style, mesh=mesh, tp_plan=plan, async_tp=async_tp)
    step = spmd.compile(parallel_mode=mode, check_invariants=True, **compile_kw)(fn)
    dp = world // tp
    dp_rank = rank // tp  # row-major meshes: the ranks of one tensor-parallel group are consecutive
    initial = [p.detach().clone() for p in ref.parameters()]
    loss_diff = 0.0
    for i in range(steps):
        batches = [batch(i, r) for r in range(dp)]
        loss = step(model, opt, *batches[dp_rank])
        want = fn(ref, ref_opt, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        got = loss.detach().clone()
        dist.all_reduce(got)  # the mean of the data ranks' local losses (each tp rank holds it too)
        loss_diff = max(loss_diff, (got / world - want).abs().item())
    diffs = {
        n: _masked_diff(n, _full(p), q)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
    }
    return {
        "loss_diff": loss_diff,
        "param_diff": max(diffs.values()),
        "worst": max(diffs, key=diffs.__getitem__),
        "moved": max((q - p0).abs().max().item() for q, p0 in zip(ref.parameters(), initial)),
        "placements": {n: tuple(map(str, p.placements)) for n, p in model.named_parameters()},
        "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
        "collectives": {k: v.count for k, v in step.report().collectives.items()},
        "tp_plan": sorted(spmd.tp_plan_of(model)) if auto else [],
        "tp_choices": step.report().tp_choices if auto else [],
        "chunked": sum(ASYNC_TP_CHUNK in n.meta for n in step.graphs["final"].graph.nodes),
    }


def auto_many(rank: int, world: int, names: list[str], style: str, tp: int) -> dict[str, dict[str, Any]]:
    """:func:`vs_single_device` with automatic placements for several models in one spawn."""
    import time

    out = {}
    for name in names:
        t0 = time.perf_counter()
        out[name] = vs_single_device(rank, world, name, style, tp, 5, "adamw:1e-6", auto=True)
        out[name]["seconds"] = time.perf_counter() - t0
    return out


def vs_fsdp2(
    rank: int, world: int, name: str, tp: int = 2, steps: int = 4, ckpt_dir: str | None = None
) -> dict[str, Any]:
    """The same step against FSDP2 ``fully_shard`` composed with ``parallelize_module`` by hand,
    with the same plan on the same 2-D mesh, different data on each data rank. With ``ckpt_dir``:
    FSDP2's model and optimizer state saved with DCP loads into a fresh spmd model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model, plan, hf = build(name)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    parallelize_module(ref, mesh["tp"], {k: v for k, v in tp_plans_for_fsdp2(plan).items()})
    for m in ref.modules():
        if type(m).__name__.endswith("DecoderLayer") or type(m).__name__ == "Block":
            fully_shard(m, mesh=mesh["dp_shard"])
    fully_shard(ref, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    fn = make_step(hf, clip=False)
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", mesh=mesh, tp_plan=plan))(fn)
    ids_rank = rank // tp
    loss_diff = 0.0
    for i in range(steps):
        ids, labels = batch(i, ids_rank)
        got = step(model, opt, ids, labels)
        want = fn(ref, ref_opt, ids, labels)
        loss_diff = max(loss_diff, (got.detach() - _full(want.detach())).abs().item())
    diffs = {
        n: _masked_diff(n, _full(p), _full(q.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
    }
    placement_diffs = [
        f"{n}: {tuple(p.placements)} vs FSDP2 {tuple(q.placements)}"
        for (n, p), q in zip(model.named_parameters(), ref.parameters())
        if tuple(p.placements) != tuple(q.placements)
    ]
    loaded_diffs: list[str] = []
    if ckpt_dir is not None:
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": ref.state_dict(), "optim": ref_opt.state_dict()}, checkpoint_id=ckpt_dir)
        torch.manual_seed(1)  # other initial values: the load must overwrite them
        fresh, _, _ = build(name)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3, fused=True)
        mode = spmd.DataParallel("fully_shard", mesh=mesh, tp_plan=plan)
        mode.distribute(fresh, fresh_opt)
        sd = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        dcp.load(sd, checkpoint_id=ckpt_dir)
        fresh.load_state_dict(sd["model"])
        fresh_opt.load_state_dict(sd["optim"])
        for (n, p), q in zip(fresh.named_parameters(), ref.parameters()):
            if not torch.equal(_full(p), _full(q.detach())):
                loaded_diffs.append(f"parameter {n}")
            for k, v in ref_opt.state[q].items():
                if isinstance(v, torch.Tensor) and not torch.equal(_full(fresh_opt.state[p][k]), _full(v)):
                    loaded_diffs.append(f"optimizer state {k} of {n}")
    return {
        "loss_diff": loss_diff,
        "param_diff": max(diffs.values()),
        "worst": max(diffs, key=diffs.__getitem__),
        "placement_diffs": placement_diffs,
        "loaded_diffs": loaded_diffs,
    }


def tp_plans_for_fsdp2(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as ``parallelize_module`` takes it: the embedding's output and the head's input
    replicated (what spmd's whole-step propagation gives), and the head's output gathered for
    the plain loss. ``fnmatch`` patterns are ``parallelize_module``'s own syntax too."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = dict(plan)
    for k, v in plan.items():
        if k in ("tok", "model.embed_tokens"):
            out[k] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if k == "lm_head":
            out[k] = ColwiseParallel(output_layouts=Replicate())
        del v
    return out


def _mesh_mode(shape: tuple[int, int], plan: dict[str, Any]) -> spmd.DataParallel:
    """fully_shard on a (dp_shard, tp) mesh of ``shape``; tp 1 is plain fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape[1] == 1:
        return spmd.DataParallel("fully_shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_shard", "tp"))
    return spmd.DataParallel("fully_shard", mesh=mesh, tp_plan=plan)


def resume_other_mesh(
    rank: int, world: int, name: str, save: tuple[int, int], load: tuple[int, int], ckpt_dir: str
) -> list[str]:
    """Train 2 steps on the ``save`` mesh, save with DCP; a fresh model on the ``load`` mesh loads
    it. The loaded parameters and optimizer state must equal the saved ones bit for bit (full
    values), and the next step must train on (its loss within the tensor-parallel tolerance of the
    saving run's next loss, on the same global batch)."""
    import torch.distributed.checkpoint as dcp

    problems: list[str] = []
    fn = make_step(*build(name)[2:], clip=True)

    def fresh(shape: tuple[int, int]) -> tuple[nn.Module, Any, Any, spmd.DataParallel]:
        torch.manual_seed(0)
        model, plan, _ = build(name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        mode = _mesh_mode(shape, plan)
        return model, opt, spmd.compile(parallel_mode=mode)(fn), mode

    def global_batch(i: int, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        # The same global batch of 4 sequences whatever the mesh: split over the data ranks.
        ids, labels = batch(i, 0)
        ids, labels = torch.cat([ids, batch(i, 1)[0]]), torch.cat([labels, batch(i, 1)[1]])
        dp, dp_rank = shape[0], rank // shape[1]
        n = ids.shape[0] // dp
        return ids[dp_rank * n : (dp_rank + 1) * n], labels[dp_rank * n : (dp_rank + 1) * n]

    model, opt, step, _ = fresh(save)
    for i in range(2):
        step(model, opt, *global_batch(i, save))
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt_dir)
    saved = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    saved_state = [
        {k: _full(v).clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        for p in model.parameters()
    ]
    next_loss = step(model, opt, *global_batch(2, save)).detach().clone()
    dist.all_reduce(next_loss)
    next_loss /= world

    model2, opt2, step2, mode2 = fresh(load)
    mode2.distribute(model2, opt2)
    sd = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt_dir)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    for n, p in model2.named_parameters():
        if not torch.equal(_full(p), saved[n]):
            problems.append(f"{save}->{load}: loaded {n} differs from the saved value")
    for p, want in zip(model2.parameters(), saved_state):
        for k, v in want.items():
            if not torch.equal(_full(opt2.state[p][k]), v):
                problems.append(f"{save}->{load}: loaded optimizer state {k} differs")
    loss = step2(model2, opt2, *global_batch(2, load)).detach().clone()
    dist.all_reduce(loss)
    loss /= world
    if (loss - next_loss).abs().item() > 1e-5:
        problems.append(f"{save}->{load}: resumed loss {loss.item()} vs {next_loss.item()}")
    return problems


def gpt2_plan() -> dict[str, Any]:
    """GPT-2's transposed ``Conv1D`` projections: ``c_attn`` (fused q, k, v) and ``mlp.c_fc``
    column-parallel, the two ``c_proj`` row-parallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "transformer.h.*.attn.c_attn": ColwiseParallel(),
        "transformer.h.*.attn.c_proj": RowwiseParallel(),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
    }
