"""Run a step compiled and eager from identical state, and compare everything they leave behind."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

import spmd
from tests import models


@dataclasses.dataclass
class Pair:
    """The compiled side and the eager side of one parity run."""

    compiled: nn.Module
    eager: nn.Module
    compiled_optim: torch.optim.Optimizer
    eager_optim: torch.optim.Optimizer
    compiled_out: list[Any]
    eager_out: list[Any]
    step: spmd.CompiledStep
    initial: dict[str, torch.Tensor]  # parameter values before the first step


def run_pair(
    model_name: str,
    optim_name: str,
    *,
    steps: int = 10,
    step_fn: Callable[..., Any] = models.train_step,
    seed_each_step: bool = False,
    **compile_options: Any,
) -> Pair:
    """Train a model and its twin for ``steps`` steps, one compiled, one eager, on the same batches."""
    compiled = models.build(model_name)
    eager = models.twin(compiled)
    initial = {n: p.detach().clone() for n, p in compiled.named_parameters()}
    co, eo = models.make_optimizer(optim_name, compiled), models.make_optimizer(optim_name, eager)
    step = spmd.compile(**compile_options)(step_fn)
    c_out, e_out = [], []
    for i, (x, y) in enumerate(models.batches(model_name, steps)):
        if seed_each_step:
            torch.manual_seed(100 + i)
        c_out.append(step(compiled, co, x, y))
        if seed_each_step:
            torch.manual_seed(100 + i)
        e_out.append(step_fn(eager, eo, x, y))
    return Pair(compiled, eager, co, eo, c_out, e_out, step, initial)


def _check(a: torch.Tensor, b: torch.Tensor, what: str, tol: dict[str, float] | None) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    if tol is None:
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{what}: not bit-for-bit equal (max abs diff {diff:.3g})")
    else:
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")


def assert_outputs_equal(a: Any, b: Any, tol: dict[str, float] | None = None, what: str = "output") -> None:
    """Same pytree structure, equal tensors, equal Python leaves."""
    la, sa = torch.utils._pytree.tree_flatten(a)
    lb, sb = torch.utils._pytree.tree_flatten(b)
    assert sa == sb, f"{what}: structure {sa} vs {sb}"
    for i, (x, y) in enumerate(zip(la, lb)):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor), f"{what}[{i}]: {type(x).__name__} vs tensor"
            _check(x, y, f"{what}[{i}]", tol)
        else:
            assert x == y and type(x) is type(y), f"{what}[{i}]: {x!r} vs {y!r}"


def assert_same_state(
    pair: Pair, tol: dict[str, float] | None = None, skip: Callable[[str], bool] = lambda n: False
):
    """Parameters, buffers, optimizer state and step outputs agree (bit for bit when ``tol`` is None).

    ``skip(name)`` leaves out parameters (and their optimizer state) by name. Also checks that
    training moved the parameters, so two sides that both did nothing cannot pass.
    """
    cp, ep = dict(pair.compiled.named_parameters()), dict(pair.eager.named_parameters())
    assert cp.keys() == ep.keys()
    for n in ep:
        if not skip(n):
            _check(cp[n].detach(), ep[n].detach(), f"parameter {n}", tol)
    cb, eb = dict(pair.compiled.named_buffers()), dict(pair.eager.named_buffers())
    assert cb.keys() == eb.keys()
    for n in eb:
        # num_batches_tracked is an integer count: always exact.
        _check(cb[n], eb[n], f"buffer {n}", None if not eb[n].is_floating_point() else tol)

    cs, es = pair.compiled_optim.state_dict(), pair.eager_optim.state_dict()
    assert cs["param_groups"] == es["param_groups"]
    assert cs["state"].keys() == es["state"].keys(), "optimizer state exists for different parameters"
    # state_dict numbers parameters in param_groups order; map back to names for skip().
    names = {id(p): n for n, p in pair.eager.named_parameters()}
    index_names = [names[id(p)] for g in pair.eager_optim.param_groups for p in g["params"]]
    for i, entries in es["state"].items():
        assert cs["state"][i].keys() == entries.keys(), f"state keys of {index_names[i]}"
        if skip(index_names[i]):
            continue
        for k, v in entries.items():
            what = f"optimizer state {index_names[i]}.{k}"
            if isinstance(v, torch.Tensor):
                # `step` counts are exact on every path.
                _check(cs["state"][i][k], v, what, None if k == "step" else tol)
            else:
                assert cs["state"][i][k] == v, what

    assert len(pair.compiled_out) == len(pair.eager_out)
    for i, (a, b) in enumerate(zip(pair.compiled_out, pair.eager_out)):
        assert_outputs_equal(a, b, tol, what=f"step {i} output")

    moved = [n for n, p in cp.items() if p.requires_grad and not torch.equal(p.detach(), pair.initial[n])]
    assert moved, "no parameter changed: the steps did not train"
