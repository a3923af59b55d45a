"""Every misuse raises the right spmd.SpmdError subclass, and the message says where and what to do."""

from __future__ import annotations

import heapq
import inspect
import os
import random

import numpy
import pytest
import torch
import torch.nn as nn

import spmd
from tests import models


def _step(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _line_of(fn, marker: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if marker in line)


class ReadsItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        scale = h.abs().max().item()  # marker: item
        return h / scale


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # marker: branch
            return h * 2
        return h


class ComparesInStdlib(nn.Module):
    """The tensor comparison happens inside heapq (standard library), called from this file."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        biggest = heapq.nlargest(1, [h.sum(), h.mean()])[0]  # marker: stdlib
        return h * biggest


class Nonzero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h[torch.nonzero(h > 0)[:, 0]]


class LayerDrop(nn.Module):
    """Skips its layer at random, drawing with Python's global generator (as HF's MusicGen does)."""

    def __init__(self, draw=None):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.draw = draw

    def forward(self, x):
        u = self.draw(0, 1) if self.draw else random.uniform(0, 1)  # marker: draw
        if self.training and u < 0.5:
            return x
        return self.fc(x)


class NumpyMask(nn.Module):
    """Zeroes a random half of the features, drawn with numpy (HF's SpecAugment masks)."""

    def forward(self, x):
        keep = numpy.random.rand(x.shape[-1]) < 0.5  # marker: numpy
        return x * torch.tensor(keep, dtype=x.dtype)


def _uniform_alias(a, b):
    """A draw spmd's wrappers cannot see: the generator's bound method taken before the trace."""
    return _RANDOM_ALIAS(a, b)


_RANDOM_ALIAS = random.uniform


class Outer(nn.Module):
    """Puts the offending module at path 'body.1'."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), inner)

    def forward(self, x):
        return self.body(x)


def _compile_and_call(inner: nn.Module):
    model = Outer(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spmd.compile()(_step)(model, opt, torch.randn(4, 8))


# ----------------------------------------------------------------------------- arguments


def test_no_module_among_arguments():
    step = spmd.compile()(lambda x: x.sum())
    with pytest.raises(spmd.InvalidArgumentsError, match="no nn.Module"):
        step(torch.randn(3))


def test_two_modules():
    a, b = models.build("mlp"), models.build("mlp")
    with pytest.raises(spmd.InvalidArgumentsError, match="2 nn.Modules.*exactly one"):
        spmd.compile()(lambda m1, m2, x: m1(x).sum() + m2(x).sum())(a, b, torch.randn(2, 8))


def test_two_modules_nested_in_a_container():
    a, b = models.build("mlp"), models.build("mlp")
    with pytest.raises(spmd.InvalidArgumentsError, match="exactly one"):
        spmd.compile()(lambda ms, x: ms[0](x).sum())([a, b], torch.randn(2, 8))


def test_two_optimizers():
    m = models.build("mlp")
    o1, o2 = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(spmd.InvalidArgumentsError, match="2 optimizers.*param_groups"):
        spmd.compile()(lambda m, a, b, x: m(x).sum())(m, o1, o2, torch.randn(2, 8))


def test_optimizer_over_another_models_parameters():
    m, other = models.build("mlp"), models.build("mlp")
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(spmd.InvalidArgumentsError, match="not a parameter of the model"):
        spmd.compile()(_step)(m, opt, torch.randn(2, 8))


def test_unsupported_argument_type():
    m = models.build("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(spmd.InvalidArgumentsError, match="unsupported argument of type 'object'"):
        spmd.compile()(lambda m, o, x, extra: _step(m, o, x))(m, opt, torch.randn(2, 8), object())


def test_plain_python_values_are_accepted():
    m = models.build("mlp")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    step = spmd.compile()(lambda m, o, x, cfg: _step(m, o, x * cfg["scale"]) if cfg["on"] else None)
    out = step(m, opt, torch.randn(2, 8), {"scale": 2.0, "on": True, "name": "a", "dtype": torch.float32})
    assert isinstance(out, torch.Tensor)


# ----------------------------------------------------------------------------- tracing


@pytest.mark.parametrize(
    ("inner", "marker"),
    [(ReadsItem, "marker: item"), (Branches, "marker: branch"), (ComparesInStdlib, "marker: stdlib")],
    ids=["item", "branch", "via_stdlib"],
)
def test_data_dependent_control_flow(inner, marker):
    with pytest.raises(spmd.DataDependentControlFlowError) as info:
        _compile_and_call(inner())
    msg = str(info.value)
    assert f"{os.path.basename(__file__)}:{_line_of(inner.forward, marker)}" in msg, msg
    assert "'body.1'" in msg, msg
    assert "Override" in msg and "torch.where" in msg
    assert isinstance(info.value, spmd.TraceError)


def test_untraceable_op():
    with pytest.raises(spmd.UntraceableOpError) as info:
        _compile_and_call(Nonzero())
    msg = str(info.value)
    assert "nonzero" in msg and "'body.1'" in msg
    assert "spmd.Override" in msg and "fixed shapes" in msg
    assert "expert" not in msg, msg  # not an experts module: no mixture-of-experts advice
    assert f"{os.path.basename(__file__)}:{_line_of(Nonzero.forward, 'torch.nonzero')}" in msg, msg


@pytest.mark.parametrize(
    ("inner", "call", "marker"),
    [
        (LayerDrop(), "random.uniform()", "marker: draw"),
        (NumpyMask(), "numpy.random.rand()", "marker: numpy"),
    ],
    ids=["python_random", "numpy"],
)
def test_host_random_draw_is_refused(inner, call, marker):
    """A draw from numpy's or Python's global generator inside the step would be replayed at every
    step (compiled without the check: the same layer dropped, the same mask, at every call)."""
    with pytest.raises(spmd.HostRandomError) as info:
        _compile_and_call(inner)
    msg = str(info.value)
    assert call in msg and "'body.1'" in msg, msg
    assert f"{os.path.basename(__file__)}:{_line_of(type(inner).forward, marker)}" in msg, msg
    assert "torch.rand" in msg and isinstance(info.value, spmd.TraceError)


def test_host_random_draw_through_an_alias_is_refused():
    state = random.getstate()
    with pytest.raises(spmd.HostRandomError, match="global random generator"):
        _compile_and_call(LayerDrop(draw=_uniform_alias))
    random.setstate(state)
    _compile_and_call(LayerDrop(draw=lambda a, b: 0.9))  # a Python value that is not drawn is fine


def test_host_random_draws_of_other_threads_go_on():
    """Only the tracing thread is refused: a program's other thread (a data-loading thread) keeps
    drawing while a step is traced, and its draws do not make the trace fail."""
    import threading

    from spmd.frontend.host_random import refuse_host_random

    drawn: list[object] = []
    with refuse_host_random(nn.Linear(2, 2)):
        t = threading.Thread(target=lambda: drawn.append(random.random()))
        t.start()
        t.join()
        with pytest.raises(spmd.HostRandomError):
            random.random()
    assert len(drawn) == 1 and isinstance(drawn[0], float)


def test_failed_trace_leaves_model_and_optimizer_usable():
    """A trace error must not leave hooks, fake tensors or the compiling flag behind."""
    model = Outer(Branches())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    with pytest.raises(spmd.DataDependentControlFlowError):
        spmd.compile()(_step)(model, opt, torch.randn(4, 8))
    assert not torch.compiler.is_compiling()
    assert list(model.parameters()) == params and opt.param_groups[0]["params"] == params
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.autograd.backward.__module__ == "torch.autograd"
    _step(model, opt, torch.randn(4, 8))  # eager still works


# ----------------------------------------------------------------------------- configuration


def test_unknown_compile_option():
    with pytest.raises(spmd.ConfigError, match=r"unknown option\(s\) \['dumpdir'\].*dump_dir"):
        spmd.compile(dumpdir="/tmp/x")


def test_unknown_data_parallel_style():
    with pytest.raises(spmd.ConfigError) as info:
        spmd.DataParallel("zigzag")
    msg = str(info.value)
    assert "'zigzag'" in msg and "'replicate'" in msg and "'fully_shard'" in msg


def test_parallel_mode_must_be_a_parallel_mode():
    with pytest.raises(spmd.ConfigError, match="ParallelMode"):
        spmd.compile(parallel_mode="fully_shard")


def test_module_override_items_must_be_overrides():
    with pytest.raises(spmd.ConfigError, match="spmd.Override"):
        spmd.compile(module_override=[lambda fqn, m: m])


def test_all_errors_derive_from_spmd_error():
    for cls in (
        spmd.InvalidArgumentsError,
        spmd.ConfigError,
        spmd.TraceError,
        spmd.DataDependentControlFlowError,
        spmd.UntraceableOpError,
        spmd.CacheLimitError,
    ):
        assert issubclass(cls, spmd.SpmdError)


class _Cache:
    """Like Hugging Face's ``DynamicCache``: not a pytree node, holds tensors."""

    def __init__(self, t: torch.Tensor) -> None:
        self.layers = [t]


def test_output_holding_tensors_in_an_opaque_object_raises() -> None:
    """Handing such an object back as traced would give the caller the trace's fake tensors."""
    model = nn.Linear(4, 4)

    def step(model, x):
        y = model(x)
        return {"y": y, "cache": _Cache(y)}

    with pytest.raises(spmd.TraceError, match=r"_Cache at output\['cache'\] that holds tensors"):
        spmd.compile()(step)(model, torch.randn(2, 4))

    def ok(model, x):
        return {"y": model(x), "note": "plain leaves are constants", "cfg": _Cache(None)}  # type: ignore[arg-type]

    out = spmd.compile()(ok)(model, torch.randn(2, 4))
    assert out["note"] == "plain leaves are constants" and out["cfg"].layers == [None]


def test_kernel_refusing_what_the_trace_accepted_names_the_op_and_the_fix():
    # bf16 BatchNorm weights with fp32 running statistics: the fake kernel accepts the mix, the
    # CPU kernel refuses it (as eager does). The first run says which op, where, and what to do.
    import torch.nn.functional as F

    def train_step(model, optim, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    def run(mp: spmd.MixedPrecision) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", mixed_precision=mp))(train_step)
        return step(model, optim, torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)))

    with pytest.raises(spmd.KernelError, match=r"native_batch_norm.*buffer_dtype") as info:
        run(spmd.MixedPrecision(param_dtype=torch.bfloat16))
    assert isinstance(info.value, RuntimeError)  # callers catching RuntimeError still do
    assert (
        run(spmd.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)).dtype
        is torch.bfloat16
    )


def test_rank_agreement_leaves_the_store_alone_for_a_step_without_collectives(monkeypatch):
    """A step that issues no collective cannot hang, so its ranks do not publish fingerprints: the
    publication could be a script's last store operation, racing a rank that hosts the store and has
    already exited (two eval steps of different models have the same empty fingerprint, so the
    second finds every rank's key at once). A step with a collective (here the data checks') does."""
    import torch.fx as fx

    from spmd.parallel import agreement

    class Store:  # any use fails
        def __getattr__(self, name):
            raise RuntimeError(f"store.{name} used")

    monkeypatch.setattr(agreement.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(agreement.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(agreement.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(agreement.torch_compat, "get_default_store", lambda: Store())
    g = fx.Graph()
    g.output(g.placeholder("x"))
    gm = fx.GraphModule({}, g)
    agreement.check_rank_agreement(gm, step_name="eval_step")
    with pytest.raises(RuntimeError, match="store.add used"):
        agreement.check_rank_agreement(gm, step_name="eval_step", before=[("ar", "checks")])
