"""spmd.frontend.optim: optimizer capture, lifted learning rates, optimizer state and the graph cache."""

from __future__ import annotations

import pytest
import torch

import spmd
from passes import meta
from passes.meta import Role
from spmd.frontend import optim as optim_utils
from tests import models
from tests.parity import assert_same_state, run_pair


def _train_with_scheduler(optim_name, make_scheduler, steps=10, **compile_options):
    model = models.build("mlp")
    eager = models.twin(model)
    opt, eopt = models.make_optimizer(optim_name, model), models.make_optimizer(optim_name, eager)
    sched, esched = make_scheduler(opt), make_scheduler(eopt)
    step = spmd.compile(**compile_options)(models.train_step)
    lrs = []
    for x, y in models.batches("mlp", steps):
        lrs.append(opt.param_groups[0]["lr"])
        assert torch.equal(step(model, opt, x, y), models.train_step(eager, eopt, x, y))
        sched.step()
        esched.step()
    for (n, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a, b), n
    for k, v in eopt.state_dict()["state"].items():
        for kk, t in v.items():
            assert torch.equal(opt.state_dict()["state"][k][kk], t), (k, kk)
    return step, lrs


def test_scheduler_with_fused_adamw_is_one_graph():
    step, lrs = _train_with_scheduler(
        "adamw_fused", lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s))
    )
    assert len(set(lrs)) == 10  # the lr really changed every step
    assert step.num_graphs == 1
    hyper = [n for n in step.graphs["traced"].graph.nodes if n.meta.get(meta.ROLE) is Role.HYPERPARAM]
    assert [n.meta[meta.STATE_NAME] for n in hyper] == ["lr.0"]


def test_scheduler_with_sgd_foreach_retraces_per_lr_value():
    # SGD foreach cannot take a tensor lr bit-exactly, so each distinct lr is its own graph.
    step, lrs = _train_with_scheduler(
        "sgd_momentum_foreach", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5)
    )
    assert len(set(lrs)) == 3
    assert step.num_graphs == 3
    assert not any(n.meta.get(meta.ROLE) is Role.HYPERPARAM for n in step.graphs["traced"].graph.nodes)


def test_changed_batch_shape_traces_a_second_graph():
    model = models.build("mlp")
    eager = models.twin(model)
    opt, eopt = models.make_optimizer("adam_fused", model), models.make_optimizer("adam_fused", eager)
    step = spmd.compile()(models.train_step)
    g = torch.Generator().manual_seed(3)
    for n in (4, 6, 4, 6, 4):
        x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
        assert torch.equal(step(model, opt, x, y), models.train_step(eager, eopt, x, y))
    assert step.num_graphs == 2
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def test_cache_size_limit_raises():
    model = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_foreach", model)
    step = spmd.compile(cache_size_limit=2)(models.train_step)
    for n in (2, 3):
        step(model, opt, torch.randn(n, 8), torch.randint(0, 4, (n,)))
    step(model, opt, torch.randn(2, 8), torch.randint(0, 4, (2,)))  # cached: fine
    with pytest.raises(spmd.CacheLimitError, match="cache_size_limit=2"):
        step(model, opt, torch.randn(5, 8), torch.randint(0, 4, (5,)))
    assert step.num_graphs == 2


def test_default_cache_size_limit_is_8():
    model = models.build("mlp")
    step = spmd.compile()(lambda m, x: m(x).sum())
    for n in range(1, 9):
        step(model, torch.randn(n, 8))
    with pytest.raises(spmd.CacheLimitError, match="cache_size_limit"):
        step(model, torch.randn(9, 8))


def test_traceable_optimizers_sets_is_compiling_only_inside_step():
    """The flag is true inside ``optimizer.step()`` (where torch.optim needs it), false around it
    (model code gets eager's answer) and in the user's earlier step hooks, and restored after an
    exception."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append(("user hook", torch.compiler.is_compiling())))
    p.grad = torch.ones(2)
    with optim_utils.traceable_optimizers(opt):
        opt.register_step_pre_hook(lambda *a: seen.append(("in step", torch.compiler.is_compiling())))
        seen.append(("before", torch.compiler.is_compiling()))
        opt.step()
        seen.append(("after", torch.compiler.is_compiling()))
    assert seen == [("before", False), ("user hook", False), ("in step", True), ("after", False)]
    with pytest.raises(ValueError), optim_utils.traceable_optimizers(opt):
        opt.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(ValueError("boom")))
        opt.step()
    assert not torch.compiler.is_compiling()


def test_is_compiling_is_off_after_a_compiled_step():
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_foreach", model)
    spmd.compile()(models.train_step)(model, opt, *models.batches("mlp", 1)[0])
    assert not torch.compiler.is_compiling()


@pytest.mark.parametrize("optim_name", ["adamw_fused", "sgd_momentum_foreach", "adam_two_groups"])
def test_no_state_for_parameter_unused_in_forward(optim_name):
    pair = run_pair("frozen_unused", optim_name, steps=3)
    assert_same_state(
        pair, tol=None if optim_name in models.EXACT_OPTIMIZERS else {"rtol": 1e-5, "atol": 5e-6}
    )
    unused = pair.compiled.unused
    assert unused not in pair.compiled_optim.state
    assert torch.equal(unused.detach(), pair.initial["unused"])
    assert len(pair.compiled_optim.state_dict()["state"]) == len(pair.eager_optim.state_dict()["state"]) == 4


def test_stateless_sgd_gets_no_state():
    pair = run_pair("mlp", "sgd_default", steps=2)
    assert pair.compiled_optim.state_dict()["state"] == pair.eager_optim.state_dict()["state"] == {}
    assert len(pair.compiled_optim.state) == 0


def test_ensure_state_leaves_params_and_existing_state_untouched():
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    before = [p.detach().clone() for p in model.parameters()]
    fresh = optim_utils.ensure_state(opt, list(model.parameters()))
    assert len(fresh) == 4
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
        assert p.grad is None
        assert float(opt.state[p]["step"]) == 0.0
        assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
    assert optim_utils.ensure_state(opt, list(model.parameters())) == []
    assert opt.param_groups[0]["lr"] == 1e-2


def test_lr_is_liftable():
    model = models.build("mlp")
    for name, liftable in [
        ("adamw_fused", True),
        ("sgd_momentum_fused", True),
        ("adamw_foreach", True),
        ("sgd_momentum_foreach", False),
        ("sgd_default", False),
    ]:
        opt = models.make_optimizer(name, model)
        assert optim_utils.lr_is_liftable(opt, opt.param_groups[0]) is liftable, name


def test_hyperparameters_key():
    opt = models.make_optimizer("adam_two_groups", models.build("mlp"))
    g0, g1 = opt.param_groups
    assert dict(optim_utils.hyperparameters(g0, skip_lr=False))["lr"] == 1e-2
    assert "lr" not in dict(optim_utils.hyperparameters(g0, skip_lr=True))
    assert "params" not in dict(optim_utils.hyperparameters(g0, skip_lr=False))
    assert optim_utils.hyperparameters(g0, skip_lr=True) != optim_utils.hyperparameters(g1, skip_lr=True)
    hash(optim_utils.hyperparameters(g0, skip_lr=False))


def test_trace_group_overrides():
    model = models.build("mlp")
    assert optim_utils.trace_group_overrides(models.make_optimizer("adamw_foreach", model), {}) == {
        "capturable": True
    }
    fused = models.make_optimizer("adamw_fused", model)
    assert optim_utils.trace_group_overrides(fused, fused.param_groups[0]) == {}
    sgd = models.make_optimizer("sgd_momentum_foreach", model)
    assert optim_utils.trace_group_overrides(sgd, sgd.param_groups[0]) == {}


def test_hyperparameter_change_retraces():
    """A changed non-lr hyperparameter (weight decay) is baked into the graph: a new graph, still exact."""
    model = models.build("mlp")
    eager = models.twin(model)
    opt, eopt = models.make_optimizer("adamw_fused", model), models.make_optimizer("adamw_fused", eager)
    step = spmd.compile()(models.train_step)
    for i, (x, y) in enumerate(models.batches("mlp", 4)):
        if i == 2:
            opt.param_groups[0]["weight_decay"] = eopt.param_groups[0]["weight_decay"] = 0.5
        assert torch.equal(step(model, opt, x, y), models.train_step(eager, eopt, x, y))
    assert step.num_graphs == 2
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optim_name", ["adamw_fused", "adam_fused", "sgd_momentum_fused"])
def test_fused_kernels_are_traced_without_running_them(optim_name, monkeypatch):
    """Fake tensor mode must not fall back to the real fused kernel (zero-filled copies of all state)."""
    from torch._subclasses import fake_tensor

    fallbacks = []
    real = fake_tensor.run_fallback_kernel

    def spy(mode, func, *args, **kwargs):
        fallbacks.append(str(func))
        return real(mode, func, *args, **kwargs)

    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", spy)
    pair = run_pair("mlp", optim_name, steps=2)
    assert_same_state(pair)
    assert fallbacks == []
    fused = [n for n in pair.step.graphs["traced"].graph.nodes if "_fused_" in str(n.target)]
    assert len(fused) == 1 and str(fused[0].target).endswith(".tensor_lr")  # the lifted-lr overload
    assert optim_utils.register_fused_meta_kernels() == []  # idempotent


def test_fully_shard_pads_for_the_fused_kernel_only_shards_off_64_bytes():
    """Under fully_shard the fused AdamW runs on shards; only shards that do not start (or end,
    before the tensor's end) at a 64-byte boundary, where the CPU kernel's SIMD loop splits, are
    padded inside ``spmd::aligned_fused_optimizer_``. At 2 ranks a 64-element float32 bias is
    two shards of 32 (aligned: no padding, the kernel runs on the shards as they are; the old
    64-element alignment padded both), a 40-element one two of 20 (ragged: padded)."""
    from passes.fused_align import ALIGNED_FUSED
    from tests.unit.fake_pg import fake_process_group

    class Two(torch.nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(n))

        def forward(self, x):
            return (x * self.w).sum()

    padded = {}
    with fake_process_group(2):
        for n in (64, 40):
            model = Two(n)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
            mode = spmd.DataParallel("fully_shard", min_unit_mb=0)
            step = spmd.compile(parallel_mode=mode)(models.loss_step)
            gm = dict(step.lower(model, opt, torch.randn(n)))["final"]
            calls = [c for c in gm.graph.nodes if c.target is ALIGNED_FUSED]
            kernels = (torch.ops.aten._fused_adamw_.default, torch.ops.aten._fused_adamw_.tensor_lr)
            plain = [c for c in gm.graph.nodes if c.target in kernels]
            assert len(calls) + len(plain) == 1
            # rank 0 holds elements [0, n/2): ragged where n/2 is not a multiple of 16
            padded[n] = calls[0].args[7] if calls else None
    assert padded == {64: None, 40: [12]}
