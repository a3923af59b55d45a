"""Activation checkpointing keeps resharding: ``torch.utils.checkpoint`` (and Hugging Face's
``gradient_checkpointing_enable()``) re-runs a block's forward inside backward; those ops are
backward ops of that block, so under fully_shard with ``reshard_after_forward=True`` they read
the backward's all-gather, and a checkpointed model gathers exactly as an un-checkpointed one.

Compiled in one process under the fake process group (world size 2), 2-block models::

    un-checkpointed : forward  AG(unit) ...            backward  AG(unit) ... (reversed)
    checkpointed    : forward  AG(unit) ...            backward  AG(unit) ... recompute(unit) bwd(unit)
                      same gathers; the recompute reads the backward AG (reshard invariant)
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import spmd
from passes import collectives as C
from passes.invariants import check_reshard
from passes.meta import MICROBATCH, PHASE, ROLE, STATE_NAME, Phase, Role, module_of
from passes.ops import GET_RNG_STATE, SET_RNG_STATE
from tests import models
from tests import sweep_models as S
from tests.unit.fake_pg import fake_process_group


@pytest.fixture(scope="module")
def fake_world():
    with fake_process_group(2):
        yield
    _LOWERED.clear()


def _hf_llama(checkpoint: bool) -> torch.nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=S.V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.1,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(cfg)
    if checkpoint:
        model.activation_checkpointing_enable()  # gradient_checkpointing_enable(); non-reentrant
    return model.train()


def _tiny_gpt(checkpoint: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.TinyGPT(n_layers=2, checkpoint=checkpoint)


def _tiny_gpt_reentrant(checkpoint: bool) -> torch.nn.Module:
    """``use_reentrant=True``: the recompute runs a backward of its own inside backward."""
    torch.manual_seed(0)
    return models.TinyGPT(n_layers=2, checkpoint=checkpoint, reentrant=True)


def _hf_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


_LOWERED: dict[tuple, dict[str, fx.GraphModule]] = {}
_MODELS = {
    "hf_llama": (_hf_llama, _hf_step),
    "tiny_gpt": (_tiny_gpt, models.train_step),
    "tiny_gpt_reentrant": (_tiny_gpt_reentrant, models.train_step),
}


def _lower(name: str, checkpoint: bool, reshard: bool = True) -> dict[str, fx.GraphModule]:
    key = (name, checkpoint, reshard)
    if key not in _LOWERED:
        build, fn = _MODELS[name]
        model = build(checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        dp = spmd.DataParallel("fully_shard", reshard_after_forward=reshard, min_unit_mb=0)
        step = spmd.compile(parallel_mode=dp, check_invariants=True)(fn)
        ids = torch.randint(0, S.V, (2, 8), generator=torch.Generator().manual_seed(1))
        args = (ids,) if name == "hf_llama" else (ids, ids)
        if not checkpoint and name == "tiny_gpt_reentrant":
            return _lower("tiny_gpt", False, reshard)
        _LOWERED[key] = dict(step.lower(model, opt, *args))
    return _LOWERED[key]


def _gathers(gm: fx.GraphModule) -> dict[Phase, int]:
    out = {Phase.FORWARD: 0, Phase.BACKWARD: 0}
    for c in C.collectives(gm.graph):
        if C.kind_of(c) is C.Kind.ALL_GATHER:
            out[c.meta[PHASE]] += 1
    return out


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_checkpointed_model_gathers_as_an_uncheckpointed_one(fake_world, name: str) -> None:
    """Same all-gathers per phase in the final graph (one per unit and phase); none of
    forward's is read in backward. Per parameter (the partitioned graph) backward gathers
    at least what the un-checkpointed backward does: a recompute also reads the biases
    that a linear's backward does not."""
    plain, ckpt = _lower(name, False), _lower(name, True)
    assert _gathers(ckpt["final"]) == _gathers(plain["final"])
    fwd, bwd = _gathers(ckpt["partitioned"]), _gathers(plain["partitioned"])
    assert fwd[Phase.FORWARD] == bwd[Phase.FORWARD] and fwd[Phase.BACKWARD] >= bwd[Phase.BACKWARD] > 0
    for stage in ("partitioned", "final"):
        assert check_reshard(ckpt[stage]) == []


def test_shard_grad_op_is_unchanged(fake_world) -> None:
    """reshard_after_forward=False: forward's gathers serve backward, checkpointed or not."""
    plain, ckpt = (_lower("tiny_gpt", c, reshard=False)["final"] for c in (False, True))
    assert _gathers(ckpt) == _gathers(plain)
    assert _gathers(plain)[Phase.BACKWARD] == 0


def _phase_runs(gm: fx.GraphModule) -> list[tuple[int, Phase]]:
    """The traced graph's (micro-batch, phase) sequence with repeats collapsed."""
    runs: list[tuple[int, Phase]] = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and (key := (n.meta[MICROBATCH], n.meta[PHASE])) != (runs or [None])[-1]:
            runs.append(key)
    return runs


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_recomputed_ops_are_backward_ops_of_their_module(fake_world, name: str) -> None:
    """In trace order the phases run forward, backward, optimizer, once each; the recompute
    reads the parameters in backward, each read labelled with the parameter's own module."""
    traced = _lower(name, True)["traced"]
    assert _phase_runs(traced) == [(0, Phase.FORWARD), (0, Phase.BACKWARD), (1, Phase.OPTIMIZER)]
    reads = [
        (p, u)
        for p in traced.graph.nodes
        if p.op == "placeholder" and p.meta[ROLE] is Role.PARAM
        for u in p.users
        if u.meta[PHASE] is Phase.BACKWARD
    ]
    assert reads, "the recompute reads parameters in backward"
    for p, u in reads:
        assert module_of(u) == p.meta[STATE_NAME].rpartition(".")[0], (p.name, u.name, module_of(u))


def _is_random(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags


def test_checkpointed_dropout_restores_the_generator_in_backward(fake_world) -> None:
    """The forward saves the generator's state, the recompute sets it back to draw forward's
    dropout mask, then puts the stream back: forward draws, then per layer in backward
    get (the stream), set (forward's state), draw, set (the stream back) -- all backward ops
    of that layer's unit (HF Llama: attention dropout in each layer)."""
    traced = _lower("hf_llama", True)["traced"]
    rng = [n for n in traced.graph.nodes if n.target in (GET_RNG_STATE, SET_RNG_STATE) or _is_random(n)]
    seen = [(n.target, n.meta[PHASE], module_of(n).split(".")[2]) for n in rng]
    get, set_, draw = GET_RNG_STATE, SET_RNG_STATE, torch.ops.aten.bernoulli_.float
    fwd, bwd = Phase.FORWARD, Phase.BACKWARD
    assert seen == [
        *[(op, fwd, layer) for layer in "01" for op in (get, draw)],
        *[(op, bwd, layer) for layer in "10" for op in (get, set_, draw, set_)],
    ]
