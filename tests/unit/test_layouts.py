"""Layouts hold at run time (issue #12): at world size 1 the compiled step equals eager bit for
bit on models whose kernels return another memory layout than their meta functions promised.

The family is tests/layout_models.py; its world-size-2 counterpart against DDP is
tests/dist/test_layouts.py, the pass itself is tested on hand-built graphs in
tests/unit/passes/test_layouts.py.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import spmd
from passes.invariants import check_invariants
from passes.meta import LAYOUT_FIX
from spmd.frontend.kernel_layouts import torch_fake_layouts
from tests import layout_models as L
from tests import models

# Traced with torch's own fake layouts (``torch_fake_layouts``), these need the first run's
# fix-ups, without which they crash ("view size is not compatible ...") on this CPU build:
# native_batch_norm(_backward) on a transposed 3-D input returns a contiguous tensor where
# torch's fake kernel kept the input's layout. spmd's trace knows that kernel's rule
# (spmd/frontend/kernel_layouts.py), so with it no model of the family needs a fix-up; these
# models then stand for a kernel whose rule the trace does not know (a GPU's, a custom op's).
MISMATCHING = {"transpose_batchnorm1d", "unfold", "as_strided", "transpose_batchnorm1d_dropout"}


def _fixes(step: spmd.CompiledStep) -> list[str]:
    return [n.meta[LAYOUT_FIX] for n in step.graphs["final"].graph.nodes if n.meta.get(LAYOUT_FIX)]


def _train(model: torch.nn.Module, name: str, steps: int = 3, optim: str = "sgd_momentum_foreach", **kw):
    """Train ``model`` compiled and a copy eagerly on the same batches; asserts bitwise equality."""
    eager = copy.deepcopy(model)
    co, eo = models.make_optimizer(optim, model), models.make_optimizer(optim, eager)
    step = spmd.compile(**kw)(models.train_step)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = (
            L.batch(name, g)
            if name in L.MODELS
            else (torch.randn(4, 6, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        )
        # The same seed for both: a model with dropout must draw eager's mask, element for element.
        torch.manual_seed(100 + i)
        got = step(model, co, x, y)
        torch.manual_seed(100 + i)
        want = models.train_step(eager, eo, x, y)
        assert torch.equal(got, want), f"step {i}: loss {got.item()!r} != eager {want.item()!r}"
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), f"parameter {n}: max diff {(p - q).abs().max().item():.3g}"
    for (n, b), c in zip(model.named_buffers(), eager.buffers()):
        assert torch.equal(b, c), f"buffer {n}"
    return step


@pytest.mark.parametrize("name", list(L.MODELS))
def test_layout_family_matches_eager_bitwise(name: str) -> None:
    step = _train(L.build(name), name)
    assert step.num_graphs == 1
    # The trace saw the layouts the kernels return: nothing to fix at the first run.
    assert not _fixes(step) and "fix_layouts" not in step.graphs, _fixes(step)


@pytest.mark.parametrize("optim", ["adamw_fused", "sgd_momentum_fused"])
@pytest.mark.parametrize("name", sorted(MISMATCHING))
def test_unknown_kernel_layouts_are_fixed_at_the_first_run(name: str, optim: str) -> None:
    with torch_fake_layouts():
        step = _train(L.build(name), name, optim=optim)
    assert _fixes(step) and "fix_layouts" in step.graphs
    check_invariants(step.graphs["final"])  # fix-ups carry val, role and phase


def test_fixed_graph_is_a_stage_and_marked_in_the_dump(tmp_path) -> None:
    with torch_fake_layouts():
        name = "transpose_batchnorm1d"
        step = _train(L.build(name), name, steps=2, dump_dir=str(tmp_path))
    stages = list(step.graphs)
    assert stages[-2:] == ["fix_layouts", "final"]
    where = tmp_path / "train_step" / "rank0"
    dumped = sorted(os.listdir(where))
    fixed = [f for f in dumped if f.endswith("_fix_layouts.py")]
    assert fixed, dumped
    assert len([f for f in dumped if f.endswith("_final.py")]) == 1, dumped
    text = (where / fixed[0]).read_text()
    assert text.count("| layout fix-up") == len(_fixes(step)) > 0
    assert "restride" in text


def test_non_contiguous_input_gets_its_own_graph() -> None:
    model = L.build("transpose_batchnorm1d")
    eager = copy.deepcopy(model)
    co, eo = models.make_optimizer("sgd_default", model), models.make_optimizer("sgd_default", eager)
    step = spmd.compile()(models.train_step)
    g = torch.Generator().manual_seed(3)
    for transposed in (False, True, False, True):
        x, y = L.batch("transpose_batchnorm1d", g)
        if transposed:  # same shape, strides of a transposed tensor
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        assert torch.equal(step(model, co, x, y), models.train_step(eager, eo, x, y))
    assert step.num_graphs == 2
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p, q)


def test_simulate_a_layout_model() -> None:
    model = L.build("transpose_batchnorm1d")
    opt = models.make_optimizer("sgd_momentum_foreach", model)
    x, y = L.batch("transpose_batchnorm1d", torch.Generator().manual_seed(0))
    for style in ("replicate", "fully_shard"):
        step = spmd.compile(parallel_mode=spmd.DataParallel(style))(models.train_step)
        report = spmd.simulate(step, model, opt, x, y, world_size=4)
        assert report.world_size == 4


# derandomize: the same ten examples on every run (a seed derived from the test's name). Drawn
# afresh per run, one run in many met a model that did not match eager and the suite failed at
# random; a new random hunt belongs in a separate run, and what it finds becomes an @example.
@settings(max_examples=10, deadline=None, database=None, derandomize=True)
@given(
    ops=st.lists(st.sampled_from(L.RandomLayoutModel.BLOCKS), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
# Found by this test (once in a while): BatchNorm1d on a transposed input, then a Linear, whose
# trace took addmm where eager took matmul + add (the bias gradient's last bit differed).
@example(ops=["bn", "lin", "conv"], seed=24367)
def test_random_layout_models_match_eager_bitwise(ops: list[str], seed: int) -> None:
    torch.manual_seed(seed)
    step = _train(L.RandomLayoutModel(ops, seed=seed), "random", steps=2)
    assert step.num_graphs == 1


def _eval_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _accumulating_step(model, optim, x, y):
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        models.loss_fn(model(xs), ys).backward()
    optim.step()
    optim.zero_grad()


@pytest.mark.parametrize("layouts", ["spmd", "torch"])
@pytest.mark.parametrize("name", sorted(MISMATCHING))
def test_eval_and_accumulating_steps(name: str, layouts: str) -> None:
    """An eval step (BatchNorm on running stats) and two backward passes per step equal eager:
    traced on the kernels' layouts, with no fix-up; traced on torch's fake layouts, with the
    fix-ups (the second backward's layouts are checked as well)."""
    with torch_fake_layouts() if layouts == "torch" else contextlib.nullcontext():
        _eval_and_accumulating_steps(name, fixed=layouts == "torch")


def _eval_and_accumulating_steps(name: str, fixed: bool) -> None:
    model = L.build(name)
    eager = copy.deepcopy(model)
    co, eo = (
        models.make_optimizer("sgd_momentum_foreach", model),
        models.make_optimizer("sgd_momentum_foreach", eager),
    )
    step = spmd.compile()(_accumulating_step)
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        x, y = L.batch(name, g)
        torch.manual_seed(i)
        step(model, co, x, y)
        torch.manual_seed(i)
        _accumulating_step(eager, eo, x, y)
    assert bool(_fixes(step)) == fixed
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p, q)
    model.eval(), eager.eval()
    evaluate = spmd.compile()(_eval_step)
    x, _ = L.batch(name, g)
    assert torch.equal(evaluate(model, x), _eval_step(eager, x))
    assert bool(_fixes(evaluate)) == fixed
