"""spmd.backend.step_aside: the measured choice between inductor's code and the eager runtime.

Fast, world size 1, no inductor compile: ``compile_graph`` is replaced by a stand-in whose
"inductor" callable runs the final graph and counts its calls, and the timings are injected
(``step_aside.time_call``), so the tests pin the schedule and the decision rule, not this
machine's speed. The real inductor code runs in test_lowering (world size 1) and
tests/dist/test_inductor.py (2 ranks, opposite timings per rank).
"""

from __future__ import annotations

import logging

import pytest

import spmd
from spmd import api
from spmd.backend import step_aside
from spmd.backend.lowering import Lowered, graph_order
from spmd.backend.runtime import Executable
from tests import models

STEPS = len(step_aside.SCHEDULE)


@pytest.fixture
def ran(monkeypatch) -> dict[str, int]:
    """Calls of each callable: "inductor" (the stand-in for inductor's code) and "eager" (the
    eager runtime, Executable.run_graph)."""
    counts = {"inductor": 0, "eager": 0}

    def fake_compile_graph(gm, example_inputs, backend, **kwargs):  # noqa: ANN001, ANN003, ANN202
        def fn(*flat):  # noqa: ANN002, ANN202
            counts["inductor"] += 1
            return gm(*flat)

        return Lowered(fn, backend, "# stand-in", 0.0, graph_order(gm))

    real_run_graph = Executable.run_graph

    def run_graph(self, *flat):  # noqa: ANN001, ANN002, ANN202
        counts["eager"] += 1
        return real_run_graph(self, *flat)

    monkeypatch.setattr(api, "compile_graph", fake_compile_graph)
    monkeypatch.setattr(Executable, "run_graph", run_graph)
    return counts


def _inject(monkeypatch, inductor_ms: float, eager_ms: float) -> None:
    def timer(which, fn, flat):  # noqa: ANN001, ANN202
        return fn(*flat), 1e-3 * (inductor_ms if which == "inductor" else eager_ms)

    monkeypatch.setattr(step_aside, "time_call", timer)


def test_choose_keeps_inductor_unless_eager_wins_by_the_margin() -> None:
    m = step_aside.MARGIN
    assert step_aside.choose(100.0, 100.0 * (1 - 2 * m)) == "eager"
    assert step_aside.choose(100.0, 100.0 * (1 - m / 2)) == "inductor"  # within the margin
    assert step_aside.choose(100.0, 100.0) == "inductor"
    assert step_aside.choose(100.0, 150.0) == "inductor"


@pytest.mark.parametrize(
    "inductor_ms,eager_ms,kept",
    [(10.0, 5.0, "eager"), (5.0, 10.0, "inductor"), (10.0, 10.0 * (1 - step_aside.MARGIN / 2), "inductor")],
    ids=["eager_faster", "inductor_faster", "within_margin"],
)
def test_decision_follows_timings(ran, monkeypatch, caplog, inductor_ms, eager_ms, kept) -> None:
    """The first len(SCHEDULE) calls alternate (a warm-up each, then TIMED_STEPS each); from then on
    only the kept callable runs; the report and the spmd logger give the decision and both medians."""
    _inject(monkeypatch, inductor_ms, eager_ms)
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile(backend="inductor")(models.train_step)
    half = STEPS // 2
    with caplog.at_level(logging.INFO, logger="spmd"):
        for i, (x, y) in enumerate(models.batches("mlp", STEPS + 3)):
            step(model, opt, x, y)
            if i == 2:
                assert ran == {"inductor": 2, "eager": 1}
                assert step.report().kept is None and "measuring" in str(step.report())
    assert ran == {
        "inductor": half + (3 if kept == "inductor" else 0),
        "eager": half + (3 if kept == "eager" else 0),
    }
    report = step.report()
    assert report.inductor_fallback == "measure" and report.kept == kept
    assert report.measured_ms == pytest.approx({"inductor": inductor_ms, "eager": eager_ms})
    assert report.measured_steps == {"inductor": step_aside.TIMED_STEPS, "eager": step_aside.TIMED_STEPS}
    assert f"{kept} (median step {inductor_ms:.2f} ms inductor" in str(report)
    assert any(f"kept {kept}'s code after timing" in r.getMessage() for r in caplog.records)


def test_never_runs_only_inductor(ran, monkeypatch) -> None:
    """inductor_fallback='never' pins inductor: the eager runtime never runs, nothing is timed."""
    _inject(monkeypatch, 10.0, 1.0)  # eager "faster": ignored
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile(backend="inductor", inductor_fallback="never")(models.train_step)
    for x, y in models.batches("mlp", STEPS + 2):
        step(model, opt, x, y)
    assert ran == {"inductor": STEPS + 2, "eager": 0}
    report = step.report()
    assert report.kept == "inductor" and report.measured_ms == {}
    assert "inductor_fallback='never'" in str(report)


def test_retrace_measures_again(ran, monkeypatch) -> None:
    """A new input shape is a new graph: it alternates and decides again, on its own."""
    _inject(monkeypatch, 10.0, 5.0)
    model = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_fused", model)
    step = spmd.compile(backend="inductor")(models.train_step)
    for x, y in models.batches("mlp", STEPS):
        step(model, opt, x, y)
    assert step.report().kept == "eager"
    for x, y in models.batches("mlp", 2):
        step(model, opt, x[:3], y[:3])
    assert step.num_graphs == 2 and step.report().kept is None
    assert ran == {"inductor": STEPS // 2 + 1, "eager": STEPS // 2 + 1}


def test_eager_backend_and_bad_option() -> None:
    with pytest.raises(spmd.ConfigError, match="inductor_fallback='sometimes' is not supported"):
        spmd.compile(backend="inductor", inductor_fallback="sometimes")
    model = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_fused", model)
    step = spmd.compile()(models.train_step)
    step(model, opt, *models.batches("mlp", 1)[0])
    report = step.report()
    assert report.inductor_fallback is None and report.kept is None and "kept" not in str(report)
    assert report.measured_ms == {} and report.measured_steps == {}
