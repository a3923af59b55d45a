"""No stale graph: a plain module attribute the trace read, a hook, or anything else the
cached graph depends on changes between calls -> the step retraces (or refuses), and an
unchanged call takes the fast path (``LastCall``) without walking the model."""

from __future__ import annotations

import dataclasses
import enum
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from spmd.frontend import guards
from tests import models


class Scaled(nn.Module):
    """A forward that reads a float and a bool attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.scale = 2.0
        self.use_relu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.scale
        return F.relu(h) if self.use_relu else h


def fwd_step(model, x):
    return model(x)


def train_step(model, optim, x, y):
    loss = models.loss_fn(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_plain_attribute_changes_retrace(caplog: pytest.LogCaptureFixture) -> None:
    model = Scaled()
    step = spmd.compile()(fwd_step)
    x = _x()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 1
        model.scale = 3.0
        with caplog.at_level(logging.INFO, logger="spmd"):
            assert torch.equal(step(model, x), model(x))
        assert "scale changed from 2.0 to 3.0" in caplog.text
        model.use_relu = True
        assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 3
        model.scale, model.use_relu = 2.0, False  # back to the first graph: no new trace
        assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 3
        model.scale = 2  # an int is not the float the graph baked in
        assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 4


def test_dropout_p_and_train_eval_retrace() -> None:
    model = models.build("dropout")
    ref = models.twin(model)
    opt, ref_opt = (models.make_optimizer("sgd_momentum_foreach", m) for m in (model, ref))
    step = spmd.compile()(train_step)
    for i, (x, y) in enumerate(models.batches("dropout", 4)):
        if i == 1:
            model.drop.p = ref.drop.p = 0.0
        if i == 3:
            model.eval()
            ref.eval()
        torch.manual_seed(i)
        got = step(model, opt, x, y)
        torch.manual_seed(i)
        assert torch.equal(got, train_step(ref, ref_opt, x, y)), f"call {i}"
    assert step.num_graphs == 3
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_hook_added_or_removed_refuses() -> None:
    model = Scaled()
    step = spmd.compile()(fwd_step)
    x = _x()
    with torch.no_grad():
        step(model, x)
        handle = model.fc.register_forward_hook(lambda m, a, out: out * 0)
        with pytest.raises(spmd.ModelChangedError, match="'fc' .*hooks added or removed"):
            step(model, x)
        handle.remove()
        step(model, x)  # back to the traced structure
        handle = model.fc.register_forward_pre_hook(lambda m, a: None)
        with pytest.raises(spmd.ModelChangedError, match="hooks"):
            step(model, x)
        handle.remove()


def test_fast_path_taken_and_invalidated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unchanged calls skip the slow path; each kind of change sends the call through it."""
    model = models.build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # lr is a constant of the graph
    step = spmd.compile()(train_step)
    slow = []
    real_entry = step._entry
    monkeypatch.setattr(step, "_entry", lambda a: slow.append(1) or real_entry(a))
    data = models.batches("mlp", 3)
    x, y = data[0]
    step(model, opt, x, y)
    step(model, opt, *data[1])
    step(model, opt, *data[2])
    assert len(slow) == 1
    changes = [
        lambda: opt.param_groups[0].__setitem__("lr", 0.05),
        lambda: model.net[0].weight.requires_grad_(False),
        lambda: model.net[0].weight.requires_grad_(True),
        lambda: setattr(model.net[1], "note", "new"),  # any module attribute write
        lambda: model.net[0].register_forward_hook(lambda *a: None).remove(),
        lambda: torch.nn.modules.module.register_module_forward_hook(lambda *a: None).remove(),
    ]
    for i, change in enumerate(changes):
        change()
        step(model, opt, x, y)
        assert len(slow) == 2 + i, f"change {i} did not take the slow path"
        step(model, opt, x, y)
        assert len(slow) == 2 + i, f"after change {i} the fast path was not taken again"
    model.train()  # already training: assigns the same objects, the fast path stays
    step(model, opt, x, y)
    assert len(slow) == len(changes) + 1
    step(model, opt, x[:2], y[:2])  # a new shape
    assert len(slow) == len(changes) + 2
    step(model, opt, x=x[:2], y=y[:2])  # keyword arguments
    assert len(slow) == len(changes) + 3
    step(model, opt, x=x[:2], y=y[:2])
    assert len(slow) == len(changes) + 3


def test_fast_path_sees_replaced_optimizer_state() -> None:
    """A state tensor replaced inside optimizer.state (not through load_state_dict) is fed."""
    model = models.build("mlp")
    ref = models.twin(model)
    opt, ref_opt = (models.make_optimizer("adamw_fused", m) for m in (model, ref))
    step = spmd.compile()(train_step)
    for i, (x, y) in enumerate(models.batches("mlp", 4)):
        if i == 2:
            for o, m in ((opt, model), (ref_opt, ref)):
                st = o.state[m.net[0].weight]
                st["exp_avg"] = st["exp_avg"] * 0.5
        assert torch.equal(step(model, opt, x, y), train_step(ref, ref_opt, x, y)), f"call {i}"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_fast_path_sees_gradients_appear_and_go() -> None:
    """A step without zero_grad leaves .grad set: the next call must take the graph that
    accumulates onto it, and after a manual zero_grad the one that does not."""
    model = models.build("mlp")
    ref = models.twin(model)
    opt, ref_opt = (models.make_optimizer("sgd_momentum_foreach", m) for m in (model, ref))

    def no_zero(model, optim, x, y):
        loss = models.loss_fn(model(x), y)
        loss.backward()
        optim.step()
        return loss

    step = spmd.compile()(no_zero)
    for i, (x, y) in enumerate(models.batches("mlp", 5)):
        if i == 3:
            opt.zero_grad()
            ref_opt.zero_grad()
        assert torch.equal(step(model, opt, x, y), no_zero(ref, ref_opt, x, y)), f"call {i}"
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad), f"call {i}"
    assert step.num_graphs == 2


def test_trace_restores_module_getattribute() -> None:
    model = Scaled()
    spmd.compile()(fwd_step)(model, _x())
    assert "__getattribute__" not in nn.Module.__dict__
    before = guards.module_version()
    model.scale = 5.0
    assert guards.module_version() > before


class Config:
    """Like a Hugging Face ``PretrainedConfig``: a plain object the modules hold, read in
    forward through ``self.config.X``, with a class-level ``__getattribute__`` that maps names."""

    attribute_map = {"n_layer": "num_layers"}

    def __init__(self) -> None:
        self.num_layers = 2
        self.act = "relu"
        self.sub = SubConfig()

    def __getattribute__(self, key: str) -> object:
        if key != "attribute_map" and key in super().__getattribute__("attribute_map"):
            key = super().__getattribute__("attribute_map")[key]
        return super().__getattribute__(key)


class SubConfig:
    def __init__(self) -> None:
        self.scale = 1.0


class Configured(nn.Module):
    """Reads ``config.n_layer`` (mapped), ``config.act`` and ``config.sub.scale`` in forward."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: self.config.n_layer]:
            x = layer(x)
            x = F.relu(x) if self.config.act == "relu" else F.gelu(x)
        return x * self.config.sub.scale


def test_config_object_attribute_changes_retrace(caplog: pytest.LogCaptureFixture) -> None:
    """A change to a held config object (no nn.Module write, so the fast path must see it too)
    retraces instead of running the stale graph (Llama's ``self.layers[: config.num_hidden_layers]``)."""
    model = Configured(Config())
    step = spmd.compile()(fwd_step)
    x = _x().repeat(1, 2)[:, :8]
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(step(model, x), model(x))
        with caplog.at_level(logging.INFO, logger="spmd"):
            model.config.num_layers = 1
            assert torch.equal(step(model, x), model(x))
        assert "config.num_layers changed from 2 to 1" in caplog.text
        model.config.act = "gelu"
        assert torch.equal(step(model, x), model(x))
        model.config.sub.scale = 0.5
        assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 4
        assert torch.equal(step(model, x), model(x))  # unchanged: the cached graph
        model.config.num_layers, model.config.act, model.config.sub.scale = 2, "relu", 1.0
        assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 4
    assert "__getattribute__" in Config.__dict__ and "__getattribute__" not in SubConfig.__dict__


class Mode(enum.Enum):
    A = 1
    B = 2


def test_enum_and_tuple_module_attributes_retrace() -> None:
    model = nn.Conv2d(2, 3, 3, padding=1)
    model.mode = Mode.A

    def step_fn(model, x):
        y = model(x)
        return y if model.mode is Mode.A else -y

    step = spmd.compile()(step_fn)
    x = torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(step(model, x), step_fn(model, x))
        model.mode = Mode.B
        assert torch.equal(step(model, x), step_fn(model, x))
        model.padding = (0, 0)  # Conv2d.padding is a tuple: baked into the graph
        assert torch.equal(step(model, x), step_fn(model, x))
        assert step.num_graphs == 3


@dataclasses.dataclass(frozen=True)
class Args:
    """A frozen config (torchtitan's ``ModelArgs`` style): changed only by replacing it."""

    n_layers: int = 2


class ArgsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.args = Args()
        self.holder = Config()  # its ``sub`` gets replaced: a holder that is not a module
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: self.args.n_layers]:
            x = layer(x)
        return x * self.holder.sub.scale


def test_replaced_config_object_retraces() -> None:
    model = ArgsModel()
    step = spmd.compile()(fwd_step)
    x = _x()
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(step(model, x), model(x))
        model.args = dataclasses.replace(model.args, n_layers=1)
        assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 2
        step(model, x)  # the fast path again
        sub = SubConfig()
        sub.scale = 3.0
        model.holder.sub = sub  # no module write: the fast path must see it
        assert torch.equal(step(model, x), model(x))
        assert step.num_graphs == 3


class SetsOnFirstCall(nn.Module):
    """Sets ``config.act`` (unset) in its first forward and reads it (as HF classifiers set
    ``config.problem_type``), and counts calls in ``self.calls``, baked into the output."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.config = Config()
        self.config.act = None
        self.count = count
        self.calls = 0
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.act is None:
            self.config.act = "relu" if self.fc.out_features > 4 else "gelu"
        x = F.relu(self.fc(x)) if self.config.act == "relu" else F.gelu(self.fc(x))
        if self.count:  # a write that changes the graph on every call: no graph may be reused
            x = x * self.calls
            self.calls += 1
        return x


def test_attribute_set_by_the_first_call_compiles_once(caplog: pytest.LogCaptureFixture) -> None:
    model = SetsOnFirstCall()
    ref = SetsOnFirstCall()
    ref.load_state_dict(model.state_dict())
    step = spmd.compile()(fwd_step)
    x = _x()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="spmd"):
        for _ in range(3):
            assert torch.equal(step(model, x), fwd_step(ref, x))
        assert step.num_graphs == 1
        assert "config.act changed from None to 'relu' by the traced step itself" in caplog.text
        model.config.act = "gelu"  # a real change after compile still retraces
        ref.config.act = "gelu"
        assert torch.equal(step(model, x), fwd_step(ref, x))
        assert step.num_graphs == 2


def test_attribute_the_step_changes_every_call_retraces_as_eager() -> None:
    """A write that the second trace does not repeat identically (a call counter baked into the
    graph): every call retraces, and the counter ends where eager's does (the verifying trace's
    write is undone)."""
    model = SetsOnFirstCall(count=True)
    ref = SetsOnFirstCall(count=True)
    ref.load_state_dict(model.state_dict())
    step = spmd.compile()(fwd_step)
    x = _x()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(step(model, x), fwd_step(ref, x))
    assert model.calls == ref.calls == 3
    assert step.num_graphs == 3
