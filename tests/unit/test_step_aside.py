"""spmd.backend.step_aside: the measured choice between inductor's code and the eager runtime.

Fast, world size 1, no inductor compile: ``compile_graph`` is replaced by a stand-in whose
"inductor" callable runs the final graph and counts its calls, and the timings are injected
(``step_aside.time_call``), so the tests pin the schedule and the decision rule, not this
machine's speed. The real inductor code runs in test_lowering (world size 1) and
tests/dist/test_inductor.py (2 ranks, opposite timings per rank).
"""

from __future__ import annotations

import logging
import os

import pytest

import spmd
from spmd import api
from spmd.backend import runtime, step_aside
from spmd.backend.lowering import Lowered, graph_order
from spmd.backend.runtime import Executable
from spmd.reporting.dump import annotated_code
from spmd.reporting.report import (
    PEAK_FROM_EAGER,
    PEAK_FROM_EAGER_KEPT,
    PEAK_FROM_INDUCTOR,
    PEAK_FROM_INDUCTOR_DROPPED,
)
from tests import models

STEPS = step_aside.MIN_CALLS  # warm-up and the fewest timed pairs: a clear decision
CAP = step_aside.MAX_CALLS  # warm-up and the most timed pairs: a tie


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


def _inject(monkeypatch, inductor_ms: float | list[float], eager_ms: float | list[float]) -> None:
    """Per-call step times: a number, or a list cycled through call after call of that callable."""
    seen = {"inductor": 0, "eager": 0}

    def timer(which, fn, flat):  # noqa: ANN001, ANN202
        ms = inductor_ms if which == "inductor" else eager_ms
        if isinstance(ms, list):
            ms = ms[seen[which] % len(ms)]
        seen[which] += 1
        return fn(*flat), 1e-3 * ms

    monkeypatch.setattr(step_aside, "time_call", timer)


def _row(report: spmd.StepReport, key: str) -> str | None:
    """The value of ``str(report)``'s row ``key`` (None: no such row)."""
    for line in str(report).splitlines():
        if line.strip().startswith(key + "  "):
            return line.strip()[len(key) :].strip()
    return None


def test_choose_keeps_inductor_unless_eager_wins_by_the_margin() -> None:
    m = step_aside.MARGIN
    assert step_aside.choose(100.0, 100.0 * (1 - 2 * m)) == "eager"
    assert step_aside.choose(100.0, 100.0 * (1 - m / 2)) == "inductor"  # within the margin
    assert step_aside.choose(100.0, 100.0) == "inductor"
    assert step_aside.choose(100.0, 150.0) == "inductor"


def test_schedule_alternates_the_order_of_the_pairs() -> None:
    """A warm-up of each, then timed pairs inductor-eager, eager-inductor, ...: neither always first."""
    got = [step_aside.scheduled(i) for i in range(10)]
    assert [t for _, t in got] == [False, False] + [True] * 8
    assert "".join(w[0] for w, _ in got) == "ie" + "ie" + "ei" + "ie" + "ei"


def test_settled_needs_a_gap_beyond_spread_and_margin() -> None:
    """Stop after MIN_PAIRS only where the medians differ by more than both spreads and MARGIN;
    at MAX_PAIRS always."""
    lo, hi = step_aside.MIN_PAIRS, step_aside.MAX_PAIRS
    assert not step_aside.settled(100.0, 50.0, 0.0, 0.0, lo - 1)
    assert step_aside.settled(100.0, 50.0, 0.0, 0.0, lo)
    assert step_aside.settled(50.0, 100.0, 10.0, 20.0, lo)
    assert not step_aside.settled(100.0, 50.0, 60.0, 0.0, lo)  # inductor's spread is wider
    assert not step_aside.settled(100.0, 50.0, 0.0, 60.0, hi - 1)  # eager's spread is wider
    assert not step_aside.settled(100.0, 100.0 * (1 - step_aside.MARGIN / 2), 0.0, 0.0, lo)
    assert step_aside.settled(100.0, 100.0, 5.0, 5.0, hi)


@pytest.mark.parametrize(
    "inductor_ms,eager_ms,kept,pairs",
    [
        (10.0, 5.0, "eager", step_aside.MIN_PAIRS),
        (5.0, 10.0, "inductor", step_aside.MIN_PAIRS),
        (10.0, 10.0, "inductor", step_aside.MAX_PAIRS),
        (10.0, 10.0 * (1 - step_aside.MARGIN / 2), "inductor", step_aside.MAX_PAIRS),
        # timed inductor steps 10, 20, 10, 20, ... (the warm-up call takes the first 20)
        ([20.0, 10.0], 9.0, "eager", step_aside.MAX_PAIRS),
    ],
    ids=["eager_faster", "inductor_faster", "tie", "within_margin", "spread_wider_than_gap"],
)
def test_decision_follows_timings(
    ran, monkeypatch, caplog, tmp_path, inductor_ms, eager_ms, kept, pairs
) -> None:
    """Two warm-up calls, then timed pairs (inductor, eager): a clear win (medians apart by more
    than the spreads and MARGIN) stops at MIN_PAIRS; a tie, a gap within MARGIN, or a gap within
    the spread of the steps runs to MAX_PAIRS, then eager is kept only if more than MARGIN faster.
    From then on only the kept callable runs; the report, the dump's report.txt and the spmd logger
    give the decision, medians and spreads."""
    _inject(monkeypatch, inductor_ms, eager_ms)
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile(backend="inductor", dump_dir=str(tmp_path))(models.train_step)
    calls = len(step_aside.WARM_UP) + 2 * pairs
    report_txt = tmp_path / "train_step" / "rank0" / "report.txt"
    with caplog.at_level(logging.INFO, logger="spmd"):
        for i, (x, y) in enumerate(models.batches("mlp", calls + 3)):
            step(model, opt, x, y)
            if i == 2:
                assert ran == {"inductor": 2, "eager": 1}
                assert step.report().kept is None and "measuring" in str(step.report())
                assert "measuring" in report_txt.read_text()
            if i == calls - 2:  # the last call of the measurement is still to come
                assert step.report().kept is None
    assert ran == {
        "inductor": calls // 2 + (3 if kept == "inductor" else 0),
        "eager": calls // 2 + (3 if kept == "eager" else 0),
    }
    report = step.report()
    assert report.inductor_fallback == "measure" and report.kept == kept
    if not isinstance(inductor_ms, list):
        assert report.measured_ms == pytest.approx({"inductor": inductor_ms, "eager": eager_ms})
        assert report.measured_iqr_ms == {"inductor": 0.0, "eager": 0.0}
    assert report.measured_steps == {"inductor": pairs, "eager": pairs}
    assert f"{kept} (median step " in str(report)
    assert f"{kept} (median step " in report_txt.read_text() and "measuring" not in report_txt.read_text()
    what = "inductor's code" if kept == "inductor" else "the eager backend's graph"
    assert any(f"kept {what} after timing {pairs} pairs" in r.getMessage() for r in caplog.records)


def test_eager_candidate_is_the_eager_backends_graph(ran, monkeypatch, tmp_path) -> None:
    """The eager candidate runs the graph backend="eager" runs (its own pipeline: in-place
    collectives, buffer reuse), not the inductor pipeline's final graph, and is checked for the
    ranks' agreement under its own name; while measuring, the dump has it as the stage after
    inductor's code. With eager kept, the steps run it, and everything that says what runs says
    so: ``graphs["final"]`` is it (the inductor pipeline's graph moves to the stage before,
    ``inductor_graph``), the dump's ``NN_final.py`` is it (no ``eager_alternative`` file left), and
    report() (and the dump's report.txt) is of it: the peak of the graph that runs (the Llama's
    differs from the inductor pipeline's graph's: buffer reuse), labelled as such."""
    _inject(monkeypatch, 10.0, 5.0)
    agreed: list[str] = []  # the graphs checked for the ranks' agreement on their collectives
    monkeypatch.setattr(runtime, "check_rank_agreement", lambda gm, step_name: agreed.append(step_name))
    model, twin = models.build("llama"), models.build("llama")
    opt, twin_opt = models.make_optimizer("adamw_fused", model), models.make_optimizer("adamw_fused", twin)
    step = spmd.compile(backend="inductor", dump_dir=str(tmp_path))(models.train_step)
    eager = spmd.compile()(models.train_step)
    where = tmp_path / "train_step" / "rank0"
    for i, (x, y) in enumerate(models.batches("llama", STEPS + 1)):
        step(model, opt, x, y)
        eager(twin, twin_opt, x, y)
        if i == 2:  # measuring: "final" is the inductor pipeline's graph, the eager one a candidate
            assert step.graphs["final"] is step._last.exe.gm and "inductor_graph" not in step.graphs
            names = [f.split("_", 1)[1] for f in sorted(os.listdir(where)) if f.endswith(".py")]
            assert names[-3:] == ["final.py", "inductor.py", "eager_alternative.py"]
    exe = step._last.exe
    alt = exe.alt
    assert alt.gm.code == eager.graphs["final"].code
    assert alt.gm.code != exe.gm.code  # the inductor pipeline's graph differs
    assert exe.compiled == alt.run_graph
    assert agreed == ["train_step:eager_alternative"]
    # graphs: "final" is what runs; the graph inductor compiled is kept as the stage before it
    assert list(step.graphs)[-2:] == ["inductor_graph", "final"]
    assert step.graphs["final"] is alt.gm and step.graphs["inductor_graph"] is exe.gm
    files = sorted(f for f in os.listdir(where) if f.endswith(".py"))
    assert [f.split("_", 1)[1] for f in files[-3:]] == ["inductor_graph.py", "final.py", "inductor.py"]
    assert (where / files[-2]).read_text().endswith(annotated_code(alt.gm))
    assert "of stage 'inductor_graph'" in (where / files[-1]).read_text()
    report, runs = step.report(), eager.report()
    assert report.kept == "eager" and report.stage == "final"
    assert report.peak_from == PEAK_FROM_EAGER_KEPT and _row(report, "peak from") == PEAK_FROM_EAGER_KEPT
    assert report.peak_memory_bytes == runs.peak_memory_bytes
    assert report.num_nodes == runs.num_nodes
    dropped = step.report("inductor_graph")
    assert dropped.peak_from == PEAK_FROM_INDUCTOR_DROPPED
    assert dropped.peak_memory_bytes != runs.peak_memory_bytes  # what report() read before
    assert PEAK_FROM_EAGER_KEPT in (where / "report.txt").read_text()


def test_never_runs_only_inductor(ran, monkeypatch) -> None:
    """inductor_fallback='never' pins inductor: the eager runtime never runs, nothing is timed."""
    _inject(monkeypatch, 10.0, 1.0)  # eager "faster": ignored
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile(backend="inductor", inductor_fallback="never")(models.train_step)
    for x, y in models.batches("mlp", STEPS + 2):
        step(model, opt, x, y)
    assert ran == {"inductor": STEPS + 2, "eager": 0}
    assert step._last.exe.alt is None  # no eager candidate is built
    report = step.report()
    assert report.kept == "inductor" and report.measured_ms == {}
    assert "inductor_fallback='never'" in str(report)
    # the peak is predicted from spmd's graph, not inductor's code, and the report says so
    assert report.stage == "final" and report.peak_from == PEAK_FROM_INDUCTOR
    assert _row(report, "peak from") == PEAK_FROM_INDUCTOR


def test_gm_transformation_runs_once_and_pins_inductor(ran, monkeypatch) -> None:
    """With a gm_transformation the user's function runs once per compile, on the graph inductor
    compiles: no eager candidate (it would run the transformation a second time, on another
    pipeline's graph), nothing is timed, and the report says inductor runs, as under 'never'."""
    _inject(monkeypatch, 10.0, 1.0)  # eager "faster": not measured
    seen = []

    def transformation(gm):  # noqa: ANN001, ANN202
        seen.append(gm)
        return gm

    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile(backend="inductor", gm_transformation=transformation)(models.train_step)
    for x, y in models.batches("mlp", STEPS):
        step(model, opt, x, y)
    assert len(seen) == 1 and step.num_graphs == 1
    assert ran == {"inductor": STEPS, "eager": 0}
    assert step._last.exe.alt is None
    report = step.report()
    assert report.kept == "inductor" and report.measured_ms == {}
    assert report.peak_from == PEAK_FROM_INDUCTOR


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
    assert step._last.exe.alt is not None


def test_eager_backend_and_bad_option() -> None:
    with pytest.raises(spmd.ConfigError, match="inductor_fallback='sometimes' is not supported"):
        spmd.compile(backend="inductor", inductor_fallback="sometimes")
    model = models.build("mlp")
    opt = models.make_optimizer("sgd_momentum_fused", model)
    step = spmd.compile()(models.train_step)
    step(model, opt, *models.batches("mlp", 1)[0])
    report = step.report()
    assert report.inductor_fallback is None and report.kept is None and "kept" not in str(report)
    assert report.peak_from == PEAK_FROM_EAGER and _row(report, "peak from") is None
    assert report.measured_ms == {} and report.measured_steps == {}
