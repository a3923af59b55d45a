"""The rest of the bad-input catalogue (tests/unit/test_errors.py has the argument, tracing and
configuration errors): tensors on different devices, and a model or optimizer changed after
compile. A change must either retrace (a new graph, results equal to eager) or raise
ModelChangedError; running the stale graph is never allowed.

The 'meta' device stands in for a second device on a CPU-only machine.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

import spmd
from tests import models


def _step(model, optim, x, y):
    loss = models.loss_fn(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _step_varargs(model, optim, *batch):
    return _step(model, optim, *batch)


# ----------------------------------------------------------------------------- devices


def test_batch_on_another_device_names_the_argument():
    m = models.build("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = models.batches("mlp", 1)[0]
    with pytest.raises(spmd.InvalidArgumentsError) as info:
        spmd.compile()(_step)(m, opt, x.to("meta"), y)
    msg = str(info.value)
    assert "different devices" in msg and "parameters are on cpu" in msg, msg
    assert "argument x (float32[4, 8]) on meta" in msg, msg
    assert "argument y" not in msg, msg  # y is on the right device
    assert ".to(" in msg, msg


def test_batch_on_another_device_inside_varargs():
    m = models.build("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = models.batches("mlp", 1)[0]
    with pytest.raises(spmd.InvalidArgumentsError, match=r"argument batch\[1\] \(int64\[4\]\) on meta"):
        spmd.compile()(_step_varargs)(m, opt, x, y.to("meta"))


def test_model_on_two_devices():
    m = models.build("mlp")
    m.net[2].to("meta")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = models.batches("mlp", 1)[0]
    with pytest.raises(spmd.InvalidArgumentsError) as info:
        spmd.compile()(_step)(m, opt, x, y)
    msg = str(info.value)
    assert "parameters are on different devices" in msg and "net.2.weight" in msg and "meta" in msg, msg
    assert "model.to(device)" in msg


def test_buffer_on_another_device():
    m = models.build("convbn")
    m.bn.running_mean = m.bn.running_mean.to("meta")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = models.batches("convbn", 1)[0]
    with pytest.raises(spmd.InvalidArgumentsError, match="buffer 'bn.running_mean' on meta"):
        spmd.compile()(_step)(m, opt, x, y)


def test_batch_moved_after_compile_is_caught_too():
    """A new device is a new signature, so the check runs again on the retrace."""
    m = models.build("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = spmd.compile()(_step)
    x, y = models.batches("mlp", 1)[0]
    step(m, opt, x, y)
    with pytest.raises(spmd.InvalidArgumentsError, match="argument x"):
        step(m, opt, x.to("meta"), y)


def test_zero_dim_cpu_tensors_may_accompany_the_model():
    """torch lets a 0-d CPU tensor meet tensors of any device (Adam keeps `step` there), so
    the check must not refuse it; on CPU it simply traces."""
    m = models.build("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = models.batches("mlp", 1)[0]
    step = spmd.compile()(lambda m, o, x, y, s: _step(m, o, x * s, y))
    step(m, opt, x, y, torch.tensor(2.0))


# ----------------------------------------------------------------------------- model changed


def _train(change: Callable[[nn.Module, torch.optim.Optimizer], torch.optim.Optimizer | None], optim: str):
    """Two steps, ``change`` applied to both sides, three more steps: compiled vs eager."""
    compiled = models.build("mlp")
    eager = models.twin(compiled)
    co, eo = models.make_optimizer(optim, compiled), models.make_optimizer(optim, eager)
    step = spmd.compile()(_step)
    batches = models.batches("mlp", 5)
    for x, y in batches[:2]:
        step(compiled, co, x, y)
        _step(eager, eo, x, y)
    before = step.num_graphs
    co, eo = change(compiled, co) or co, change(eager, eo) or eo
    for i, (x, y) in enumerate(batches[2:]):
        got, want = step(compiled, co, x, y), _step(eager, eo, x, y)
        assert torch.equal(got, want), f"step {i + 2} after the change: loss {got} != eager {want}"
    for (n, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), f"parameter {n} differs from eager after the change"
    return before, step.num_graphs


def _add_used_parameter(m, opt):
    m.register_parameter("gain", nn.Parameter(torch.linspace(0.5, 1.5, 4)))
    inner = m.forward
    m.forward = lambda x: inner(x) * m.gain  # used from now on
    opt.add_param_group({"params": [m.gain]})


def _add_frozen_parameter(m, opt):
    m.register_parameter("offset", nn.Parameter(torch.full((4,), 0.25), requires_grad=False))
    inner = m.forward
    m.forward = lambda x: inner(x) + m.offset


def _remove_parameter_rebuild_optimizer(m, opt):
    m.net[2].bias = None
    return models.make_optimizer("sgd_momentum_foreach", m)


def _freeze(m, opt):
    m.net[0].weight.requires_grad_(False)


def _freeze_head(m, opt):
    m.net[2].weight.requires_grad_(False)


def _append_module(m, opt):
    m.net.append(nn.Tanh())  # no parameters, but one more module: a new signature


def _set_lr(m, opt):
    opt.param_groups[0]["lr"] = 0.01


def _set_weight_decay(m, opt):
    opt.param_groups[0]["weight_decay"] = 0.5


def _set_momentum(m, opt):
    opt.param_groups[0]["momentum"] = 0.5


@pytest.mark.parametrize(
    ("change", "optim"),
    [
        (_add_used_parameter, "sgd_momentum_foreach"),
        (_add_used_parameter, "adamw_fused"),
        (_add_frozen_parameter, "sgd_momentum_foreach"),
        (_remove_parameter_rebuild_optimizer, "sgd_momentum_foreach"),
        (_append_module, "sgd_momentum_foreach"),
        (_freeze, "sgd_momentum_foreach"),
        (_freeze, "adamw_fused"),
        (_freeze_head, "adam_fused"),
        (_set_lr, "sgd_momentum_foreach"),  # SGD's lr is a graph constant
        (_set_weight_decay, "sgd_momentum_foreach"),
        (_set_weight_decay, "adamw_fused"),
        (_set_momentum, "sgd_momentum_foreach"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__.strip("_"),
)
def test_change_after_compile_retraces_and_matches_eager(change, optim):
    before, after = _train(change, optim)
    assert after == before + 1, f"expected a retrace ({before} -> {after} graphs)"


def test_freeze_then_thaw_reuses_the_first_graph():
    """Thawing restores the original signature: the first graph runs again, and it is right."""
    compiled = models.build("mlp")
    eager = models.twin(compiled)
    co, eo = (models.make_optimizer("adamw_fused", m) for m in (compiled, eager))
    step = spmd.compile()(_step)
    for i, (x, y) in enumerate(models.batches("mlp", 6)):
        frozen = i in (2, 3)
        for m in (compiled, eager):
            m.net[0].weight.requires_grad_(not frozen)
        got, want = step(compiled, co, x, y), _step(eager, eo, x, y)
        assert torch.equal(got, want), f"step {i} (frozen={frozen})"
    assert step.num_graphs == 2
    for (n, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), n


def test_fused_lr_change_needs_no_retrace():
    """A fused optimizer's lr is a graph input: changing it reuses the graph and still equals eager."""
    before, after = _train(_set_lr, "adamw_fused")
    assert after == before


def test_removed_parameter_still_in_optimizer_is_refused():
    m = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_foreach", m)
    step = spmd.compile()(_step)
    x, y = models.batches("mlp", 1)[0]
    step(m, opt, x, y)
    m.net[2].bias = None
    with pytest.raises(spmd.ModelChangedError) as info:
        step(m, opt, x, y)
    msg = str(info.value)
    assert "'net.2.bias' was removed" in msg and "Rebuild the optimizer" in msg, msg


def test_replaced_parameter_still_in_optimizer_is_refused():
    m = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", m)
    step = spmd.compile()(_step)
    x, y = models.batches("mlp", 1)[0]
    step(m, opt, x, y)
    m.net[0].weight = nn.Parameter(torch.zeros(16, 8))
    with pytest.raises(spmd.ModelChangedError, match="'net.0.weight' was removed .*or replaced"):
        step(m, opt, x, y)


def test_foreign_parameter_is_still_an_argument_error():
    """Only parameters the model once had count as a model change."""
    m, other = models.build("mlp"), models.build("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = spmd.compile()(_step)
    x, y = models.batches("mlp", 1)[0]
    step(m, opt, x, y)
    opt.add_param_group({"params": [other.net[0].weight]})
    with pytest.raises(spmd.InvalidArgumentsError, match="not a parameter of the model"):
        step(m, opt, x, y)


def _swap_activation(m):
    m.net[1] = nn.Tanh()


def _replace_forward(m):
    inner = m.forward
    m.forward = lambda x: inner(x) * 2


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_swap_activation, "module 'net.1' is now Tanh (was ReLU)"),
        (_replace_forward, "the root module (MLP) has a different forward"),
    ],
    ids=["swap_activation", "replace_forward"],
)
def test_parameter_free_change_is_refused_not_run_stale(change, expected):
    """No parameter, buffer or optimizer entry changes, so the graph cache would reuse the old
    graph: the run must refuse with ModelChangedError naming the module."""
    m = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_foreach", m)
    step = spmd.compile()(_step)
    x, y = models.batches("mlp", 1)[0]
    step(m, opt, x, y)
    eager = models.twin(m)
    eo = models.make_optimizer("sgd_momentum_foreach", eager)
    eo.load_state_dict(opt.state_dict())
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    change(m)
    change(eager)
    with pytest.raises(spmd.ModelChangedError) as info:
        step(m, opt, x, y)
    assert expected in str(info.value), str(info.value)
    assert "compile a new step" in str(info.value)
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]), f"{n} was updated by the refused step"
    # A new compiled step follows the changed model and matches eager.
    got = spmd.compile()(_step)(m, opt, x, y)
    assert torch.equal(got, _step(eager, eo, x, y))


def test_changing_back_reuses_the_graph():
    m = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_foreach", m)
    step = spmd.compile()(_step)
    x, y = models.batches("mlp", 1)[0]
    step(m, opt, x, y)
    relu = m.net[1]
    m.net[1] = nn.Tanh()
    with pytest.raises(spmd.ModelChangedError):
        step(m, opt, x, y)
    m.net[1] = relu
    step(m, opt, x, y)
    assert step.num_graphs == 1
