"""spmd.backend.bound_ops: the eager backend runs the graph's own code with its operators bound once.

The bound code must compute the graph's bits (the same operators, arguments and order), keep the
lines that name a failing node, and be what the runtime runs from the second call on, built again
whenever the graph's code changes.
"""

from __future__ import annotations

import linecache
import re

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import spmd
from spmd.backend import runtime
from spmd.backend.bound_ops import bind_ops
from tests.unit.fake_pg import fake_process_group


def _graph() -> torch.fx.GraphModule:
    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.mm(a, b).relu()
        return torch.cat([h * 2, h.t().t()], dim=0)

    return make_fx(f)(torch.randn(3, 4), torch.randn(4, 5))


def test_the_bound_code_computes_the_graphs_bits_without_overload_calls() -> None:
    gm = _graph()
    fn = bind_ops(gm)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.equal(fn(a, b), gm(a, b))
    code = "".join(linecache.getlines(fn.__wrapped__.__code__.co_filename))
    assert "torch.ops.aten.mm.default(" in gm.code
    assert "torch.ops." not in code  # every call bound
    calls = re.compile(r"torch\.ops\.\w+\.\w+\.\w+\(|_spmd_op\d+\(")
    # The same lines with only the callee renamed, one global per overload.
    assert calls.sub("CALL(", code) == calls.sub("CALL(", gm.code)
    overloads = set(re.findall(r"torch\.ops\.[\w.]+\(", gm.code))
    assert len(set(re.findall(r"_spmd_op\d+", code))) == len(overloads)


_LIB = torch.library.Library("spmd_test_bound", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CPU")


def _refuse(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("the Autograd kernel ran")


_LIB.impl("twice", _refuse, "Autograd")


def test_the_bound_code_runs_below_the_autograd_keys_and_still_bumps_versions() -> None:
    """An op's Autograd kernel (a Python one, as the functional collectives have) is skipped;
    ADInplaceOrView still runs: an in-place op bumps its input's version counter."""

    g = torch.fx.Graph()
    x_in = g.placeholder("x")
    y = g.call_function(torch.ops.spmd_test_bound.twice.default, (x_in,))
    bumped = g.call_function(torch.ops.aten.add_.Scalar, (x_in, 1))
    g.output(g.call_function(torch.ops.aten.add.Tensor, (bumped, y)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x = torch.zeros(3)
    with pytest.raises(RuntimeError, match="the Autograd kernel ran"):
        gm(x.clone())
    v = x._version
    out = bind_ops(gm)(x)
    assert torch.equal(out, torch.ones(3)) and x._version == v + 1


def test_a_failing_line_still_names_its_node() -> None:
    gm = _graph()
    fn = bind_ops(gm)
    with pytest.raises(RuntimeError) as info:
        fn(torch.randn(3, 4), torch.randn(6, 5))  # mm's inner sizes disagree
    node = runtime._failing_node(info.value, gm)
    assert node is not None and node.target is torch.ops.aten.mm.default


def _step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_the_runtime_runs_the_bound_code_and_binds_again_after_a_recompile() -> None:
    with fake_process_group():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"))(_step)
        x = torch.randn(4, 8)
        step(model, optim, x)  # the first run checks the layouts through fx's own code
        exe = step._last.exe  # type: ignore[union-attr]
        assert exe.bound is None
        step(model, optim, x)
        first = exe.bound
        assert first is not None and exe.bound_code is exe.gm.code
        exe.gm.recompile()  # new code: bound again before it runs
        step(model, optim, x)
        assert exe.bound is not first and exe.bound_code is exe.gm.code
