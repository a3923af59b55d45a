"""``p.grad`` after a compiled step is what eager leaves (world size 1).

A step that never zeroes gradients accumulates onto the existing ``.grad`` (lifted into
the graph as a ``g_<param>`` input) bit for bit with eager; a step that ends with
``zero_grad()`` leaves ``None`` and its graph has no gradient inputs or outputs.
"""

from __future__ import annotations

import pytest
import torch

import spmd
from passes.meta import ROLE, Role
from tests import models


def step_no_zero(model, optim, x, y):
    loss = models.loss_fn(model(x), y)
    loss.backward()
    optim.step()
    return loss


def step_zero_keep(model, optim, x, y):
    loss = step_no_zero(model, optim, x, y)
    optim.zero_grad(set_to_none=False)
    return loss


def _grad_placeholders(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(ROLE) is Role.PARAM_GRAD]


def _assert_same(model, ref, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{what}: parameter {n} differs"
        assert (p.grad is None) == (q.grad is None), f"{what}: {n}.grad is {p.grad!r}, eager {q.grad!r}"
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{what}: {n}.grad differs"


@pytest.mark.parametrize("optim_name", ["sgd_momentum_foreach", "adamw_fused"])
def test_accumulates_across_calls_like_eager(optim_name: str) -> None:
    model = models.build("mlp")
    ref = models.twin(model)
    opt, ref_opt = models.make_optimizer(optim_name, model), models.make_optimizer(optim_name, ref)
    step = spmd.compile()(step_no_zero)
    data = models.batches("mlp", 5)
    for i, (x, y) in enumerate(data[:3]):
        assert torch.equal(step(model, opt, x, y), step_no_zero(ref, ref_opt, x, y))
        _assert_same(model, ref, f"call {i}")
    assert step.num_graphs == 2  # without, then with gradients to accumulate onto
    names = [n for n, _ in model.named_parameters()]
    assert _grad_placeholders(step.graphs["final"]) == ["g_" + n.replace(".", "_") for n in names]
    # zero_grad between calls: the first graph (no gradient inputs) is picked again.
    opt.zero_grad()
    ref_opt.zero_grad()
    x, y = data[3]
    assert torch.equal(step(model, opt, x, y), step_no_zero(ref, ref_opt, x, y))
    _assert_same(model, ref, "after zero_grad")
    assert step.num_graphs == 2 and not _grad_placeholders(step.graphs["final"])


def test_zero_grad_step_pays_nothing() -> None:
    """set_to_none: no gradient inputs, the loss is the only output, every .grad is None."""
    model = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_foreach", model)
    step = spmd.compile()(models.train_step)
    for x, y in models.batches("mlp", 2):
        step(model, opt, x, y)
        assert all(p.grad is None for p in model.parameters())
    gm = step.graphs["final"]
    assert step.num_graphs == 1 and not _grad_placeholders(gm)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    assert len(out.args[0]) == 1


def test_zero_grad_set_to_none_false_leaves_zeros() -> None:
    model = models.build("mlp")
    ref = models.twin(model)
    opt, ref_opt = (models.make_optimizer("sgd_momentum_foreach", m) for m in (model, ref))
    step = spmd.compile()(step_zero_keep)
    for i, (x, y) in enumerate(models.batches("mlp", 3)):
        assert torch.equal(step(model, opt, x, y), step_zero_keep(ref, ref_opt, x, y))
        _assert_same(model, ref, f"call {i}")
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_gradient_of_unused_parameter_is_read_and_kept() -> None:
    """A .grad set by hand on a parameter the forward does not use: the optimizer reads it
    (as eager's does) and the step leaves it as it was."""
    model = models.build("frozen_unused")
    ref = models.twin(model)
    opt, ref_opt = (models.make_optimizer("sgd_momentum_foreach", m) for m in (model, ref))
    for m in (model, ref):
        m.unused.grad = torch.full((3, 3), 0.25)
    kept = model.unused.grad
    step = spmd.compile()(step_no_zero)
    for i, (x, y) in enumerate(models.batches("frozen_unused", 2)):
        assert torch.equal(step(model, opt, x, y), step_no_zero(ref, ref_opt, x, y))
        _assert_same(model, ref, f"call {i}")
    assert model.unused.grad is kept
