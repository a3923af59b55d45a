"""The world-size-1 tracer: a compiled step trains exactly like eager, and its graph is labelled.

Parity tests train a model and its twin from identical state for 10 steps, on a new
random batch every step, one side compiled with ``spmd.compile()`` (no process group:
world size 1), the other eager, and compare parameters, buffers, optimizer state and
the returned values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd
from passes import meta
from passes.meta import Phase, Role
from passes.ops import TAG_GRAD
from tests import models
from tests.parity import assert_same_state, run_pair

# The non-fused Adam/AdamW path is traced through the optimizer's `capturable` branch
# (spmd/frontend/optim.py: trace_group_overrides), which computes the bias corrections as float32
# tensor arithmetic and folds lr into the denominator, where eager uses float64 Python
# scalars. Measured: ~6e-7 abs on parameters and ~1e-6 on the loss after 10 steps; the
# tolerance leaves ~5x headroom and is still ~1000x below what a wrong lr or a missed
# update would produce (each step moves parameters by ~1e-2).
CAPTURABLE_TOL = {"rtol": 1e-5, "atol": 5e-6}

# A covering set of the model x optimizer matrix: every model and every optimizer appears,
# every optimizer on the MLP. Non-fused Adam runs on models without parameters whose
# gradient is mathematically zero (see test_capturable_adam_tinygpt for why).
PARITY = [
    *[("mlp", o) for o in models.OPTIMIZERS],
    ("tinygpt", "sgd_momentum_foreach"),
    ("tinygpt", "sgd_nesterov_wd"),
    ("tinygpt", "adamw_fused"),
    ("convbn", "sgd_momentum_fused"),
    ("convbn", "sgd_default"),
    ("convbn", "adam_fused"),
    ("frozen_unused", "sgd_momentum_foreach"),
    ("frozen_unused", "sgd_default"),
    ("frozen_unused", "adamw_fused"),
    ("frozen_unused", "adamw_foreach"),
    ("frozen_unused", "adam_two_groups"),
]


def _tol(optim_name: str) -> dict[str, float] | None:
    return None if optim_name in models.EXACT_OPTIMIZERS else CAPTURABLE_TOL


def test_parity_matrix_covers_every_model_and_optimizer():
    assert {m for m, _ in PARITY} >= {"mlp", "tinygpt", "convbn", "frozen_unused"}
    assert {o for _, o in PARITY} == set(models.OPTIMIZERS)


@pytest.mark.parametrize(("model_name", "optim_name"), PARITY, ids=[f"{m}-{o}" for m, o in PARITY])
def test_parity_with_eager(model_name, optim_name):
    pair = run_pair(model_name, optim_name)
    assert_same_state(pair, tol=_tol(optim_name))
    assert pair.step.num_graphs == 1


def test_capturable_adam_tinygpt():
    """Non-fused AdamW on TinyGPT: within tolerance, except the attention key bias.

    The key bias gets a mathematically zero gradient (softmax is invariant to adding the
    same q.b_k to every score), so its computed gradient is pure rounding noise, which
    Adam normalises to steps of size ~lr. The last-bit difference of the capturable path
    changes that noise, so the key bias diverges by ~1e-2 while nothing that depends on it
    does. (ConvBN's conv bias, cancelled by BatchNorm, behaves the same way.)
    """
    pair = run_pair("tinygpt", "adamw_foreach")
    d = pair.compiled.blocks[0].qkv.bias.shape[0] // 3
    assert_same_state(pair, tol={"rtol": 1e-4, "atol": 1e-5}, skip=lambda n: n.endswith("qkv.bias"))
    for blk_c, blk_e in zip(pair.compiled.blocks, pair.eager.blocks):
        qb_c, _, vb_c = blk_c.qkv.bias.detach().split(d)
        qb_e, _, vb_e = blk_e.qkv.bias.detach().split(d)
        torch.testing.assert_close(qb_c, qb_e, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(vb_c, vb_e, rtol=1e-4, atol=1e-5)


def test_tied_weight_is_one_input_with_one_gradient():
    pair = run_pair("tinygpt", "sgd_momentum_foreach", steps=1)
    gm = pair.step.graphs["traced"]
    params = [n.meta[meta.STATE_NAME] for n in gm.graph.nodes if n.meta.get(meta.ROLE) is Role.PARAM]
    assert "tok.weight" in params and "head.weight" not in params
    grads = [n.meta[meta.GRAD_OF] for n in gm.graph.nodes if n.target is TAG_GRAD]
    assert grads.count("tok.weight") == 1
    assert pair.compiled.head.weight is pair.compiled.tok.weight


def test_dropout_matches_eager_under_same_seed():
    pair = run_pair("dropout", "sgd_momentum_foreach", seed_each_step=True)
    assert_same_state(pair)
    # the graph draws its own random mask at run time (not one baked in at trace time)
    targets = {str(n.target) for n in pair.step.graphs["traced"].graph.nodes}
    assert any("dropout" in t or "bernoulli" in t for t in targets), targets


def _clip_step(model, optim, x, y):
    loss = models.loss_fn(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad()
    return loss, norm


def test_clip_grad_norm_inside_step_is_bit_exact():
    pair = run_pair("tinygpt", "sgd_momentum_foreach", step_fn=_clip_step)
    assert_same_state(pair)
    # clipping was active (otherwise the test would not exercise it)
    assert any(norm > 1.0 for _, norm in pair.eager_out)


def _zero_grad_first(model, optim, x, y):
    optim.zero_grad()
    loss = models.loss_fn(model(x), y)
    loss.backward()
    optim.step()
    return loss


@pytest.mark.parametrize(
    "step_fn", [models.train_step, _zero_grad_first], ids=["zero_grad_last", "zero_grad_first"]
)
def test_zero_grad_position(step_fn):
    pair = run_pair("mlp", "adamw_fused", step_fn=step_fn)
    assert_same_state(pair)


def _pytree_step(model, optim, x, y):
    out = model(x)
    loss = models.loss_fn(out, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return {"losses": (loss, out.detach().abs().mean()), "batch": x.shape[0], "tag": "ok"}


def test_step_returning_a_pytree():
    pair = run_pair("mlp", "sgd_momentum_fused", step_fn=_pytree_step, steps=3)
    assert_same_state(pair)
    out = pair.compiled_out[-1]
    assert set(out) == {"losses", "batch", "tag"}
    assert isinstance(out["losses"], tuple) and len(out["losses"]) == 2
    assert out["batch"] == 4 and isinstance(out["batch"], int) and out["tag"] == "ok"


def test_last_train_step_keyword_is_accepted():
    model = models.build("mlp")
    eager = models.twin(model)
    opt, eopt = (
        models.make_optimizer("sgd_momentum_foreach", model),
        models.make_optimizer("sgd_momentum_foreach", eager),
    )
    step = spmd.compile()(models.train_step)
    (x0, y0), (x1, y1) = models.batches("mlp", 2)
    step(model, opt, x0, y0)
    loss = step(model, opt, x1, y1, last_train_step=True)
    models.train_step(eager, eopt, x0, y0)
    assert torch.equal(loss, models.train_step(eager, eopt, x1, y1))
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- metadata


@pytest.fixture(scope="module")
def convbn_graph():
    """graphs['traced'] of ConvBN with fused AdamW (params, buffers, state, a lifted lr, inputs)."""
    return run_pair("convbn", "adamw_fused", steps=1).step.graphs["traced"]


@pytest.fixture(scope="module")
def mlp_graph():
    return run_pair("mlp", "sgd_momentum_foreach", steps=1).step.graphs["traced"]


def test_every_node_has_role_and_phase(convbn_graph):
    for n in convbn_graph.graph.nodes:
        if n.op == "output":
            continue  # see test_output_node_keeps_meta_in_recorded_stages
        assert isinstance(n.meta.get(meta.ROLE), Role), n.format_node()
        assert isinstance(n.meta.get(meta.PHASE), Phase), n.format_node()


def test_output_node_has_role_and_phase_when_traced():
    """The tracer labels the output node too (checked on the graph the tracer returns)."""
    from spmd.frontend import step_inputs, tracing

    model = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_foreach", model)
    args = step_inputs.split_args((model, opt, *models.batches("mlp", 1)[0]), {})
    from spmd.frontend import optim as optim_utils

    optim_utils.ensure_state(opt, list(model.parameters()))
    traced = tracing.trace_step(models.train_step, args, step_inputs.lift_state(model, opt))
    out = traced.gm.graph.output_node()
    assert out.meta[meta.ROLE] is Role.ACTIVATION and out.meta[meta.PHASE] is Phase.OPTIMIZER


def test_output_node_keeps_meta_in_recorded_stages(convbn_graph):
    out = convbn_graph.graph.output_node()
    assert isinstance(out.meta.get(meta.ROLE), Role) and isinstance(out.meta.get(meta.PHASE), Phase)


def test_placeholder_roles(convbn_graph):
    ph = [n for n in convbn_graph.graph.nodes if n.op == "placeholder"]
    by_role: dict[Role, list[str]] = {}
    for n in ph:
        by_role.setdefault(n.meta[meta.ROLE], []).append(n.meta[meta.STATE_NAME])
    assert set(by_role) == {Role.PARAM, Role.BUFFER, Role.OPTIM_STATE, Role.HYPERPARAM, Role.INPUT}
    assert sorted(by_role[Role.PARAM]) == sorted(n for n, _ in models.ConvBN().named_parameters())
    assert sorted(by_role[Role.BUFFER]) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    assert "conv.weight.exp_avg_sq" in by_role[Role.OPTIM_STATE]
    assert by_role[Role.HYPERPARAM] == ["lr.0"]
    assert by_role[Role.INPUT] == ["input.0", "input.1"]
    # state first, then the step's tensor arguments
    assert [n.meta[meta.ROLE] for n in ph][-2:] == [Role.INPUT, Role.INPUT]


def test_phases_are_forward_then_backward_then_optimizer(convbn_graph):
    order = [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
    phases = [n.meta[meta.PHASE] for n in convbn_graph.graph.nodes if n.op == "call_function"]
    assert set(phases) == set(order)
    ranks = [order.index(p) for p in phases]
    assert ranks == sorted(ranks), "phases are not in forward, backward, optimizer order"
    # the fused AdamW kernel is the optimizer; the convolution backward is backward
    by_target = {
        str(n.target): n.meta[meta.PHASE] for n in convbn_graph.graph.nodes if n.op == "call_function"
    }
    assert by_target["aten._fused_adamw_.tensor_lr"] is Phase.OPTIMIZER
    assert by_target["aten.convolution_backward.default"] is Phase.BACKWARD
    assert by_target["aten.convolution.default"] is Phase.FORWARD


def test_grad_tags_carry_role_and_parameter(mlp_graph):
    tags = [n for n in mlp_graph.graph.nodes if n.target is TAG_GRAD]
    assert sorted(n.meta[meta.GRAD_OF] for n in tags) == sorted(n for n, _ in models.MLP().named_parameters())
    for n in tags:
        assert n.meta[meta.ROLE] is Role.GRAD
        assert n.meta[meta.PHASE] is Phase.BACKWARD
        assert n.meta[meta.GRAD_OF] == n.args[1]
        assert n.meta[meta.MODULE] == n.meta[meta.GRAD_OF].rsplit(".", 1)[0]


def test_forward_and_backward_nodes_carry_module_paths(mlp_graph):
    nodes = [n for n in mlp_graph.graph.nodes if n.op == "call_function"]
    fwd_linear = [n for n in nodes if n.target is torch.ops.aten.addmm.default]
    assert [n.meta[meta.MODULE] for n in fwd_linear] == ["net.0", "net.2"]
    assert all(n.meta[meta.PHASE] is Phase.FORWARD for n in fwd_linear)
    bwd_mm = [
        n for n in nodes if n.target is torch.ops.aten.mm.default and n.meta[meta.PHASE] is Phase.BACKWARD
    ]
    assert {n.meta[meta.MODULE] for n in bwd_mm} == {"net.0", "net.2"}
    relu_bwd = [n for n in nodes if n.target is torch.ops.aten.threshold_backward.default]
    assert [n.meta[meta.MODULE] for n in relu_bwd] == ["net.1"]
    # optimizer nodes belong to no module
    assert all(n.meta[meta.MODULE] == "" for n in nodes if n.meta[meta.PHASE] is Phase.OPTIMIZER)


def test_state_is_not_left_fake_after_tracing():
    """After compiling, the model and optimizer hold the real tensors they held before."""
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    before = {n: p for n, p in model.named_parameters()}
    step = spmd.compile()(models.train_step)
    step(model, opt, *models.batches("mlp", 1)[0])
    for n, p in model.named_parameters():
        assert p is before[n] and isinstance(p, nn.Parameter)
        assert type(opt.state[p]["exp_avg"]) is torch.Tensor
    assert opt.param_groups[0]["params"] == list(before.values())
    assert isinstance(opt.param_groups[0]["lr"], float)
    assert "capturable" not in opt.param_groups[0] or opt.param_groups[0]["capturable"] is False


class _CheckpointedDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.c = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 16))
        self.h = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.utils.checkpoint.checkpoint(self.c, h, use_reentrant=False) + h
        return nn.functional.dropout(self.h(h), 0.2)


def test_checkpointed_dropout_recomputes_the_forward_mask() -> None:
    """Activation checkpointing restores the generator's state to recompute dropout in backward
    (and restores the stream after it). Found by the foreign-model sweep: without the state in
    the graph the recomputation drew a fresh mask, the gradients differed from eager's and so did
    the generator after the step."""

    def step(model, opt, x, y):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    model = _CheckpointedDropout()
    ref = models.twin(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    compiled = spmd.compile()(step)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(5)
    for i in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        before = torch.get_rng_state()
        got = compiled(model, opt, x, y)
        after = torch.get_rng_state()
        torch.set_rng_state(before)
        assert torch.equal(got, step(ref, ref_opt, x, y)), f"step {i} loss"
        assert torch.equal(after, torch.get_rng_state()), f"step {i}: generator state after the step"
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"step {i}: {n}"
    ops = [n.target for n in compiled.graphs["final"].graph.nodes]
    assert ops.count(torch.ops.spmd.set_rng_state.default) == 2  # restore, then put back


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 12, batch_first=True)
        self.lstm = nn.LSTM(12, 12, num_layers=2)
        self.h = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(x)
        h, _ = self.lstm(h.transpose(0, 1))
        return self.h(h.mean(0))


def test_lstm_and_gru_train_like_eager() -> None:
    """CPU LSTM/GRU layers trace to ``aten.mkldnn_rnn_layer``, whose kernel returns its backward's
    workspace only in grad mode; the graph runs under no_grad. Found by the foreign-model sweep:
    the first call raised a KernelError in ``mkldnn_rnn_layer_backward`` ("workspace" undefined)."""
    torch.manual_seed(0)
    model = _Recurrent()
    ref = models.twin(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, ref))
    compiled = spmd.compile()(models.train_step)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = torch.randn(4, 6, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        assert torch.equal(compiled(model, opt, x, y), models.train_step(ref, ref_opt, x, y)), f"step {i}"
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
