"""Per-rank bodies of the inductor-backend tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch.fx as fx

import spmd
from passes import collectives as C
from spmd.backend import gemm_policy, step_aside
from spmd.backend.lowering import code_order, compile_graph, graph_order
from spmd.parallel.sharding import local
from tests import models as shared
from tests.dist import parity_models as pm
from tests.dist.workers import _diff, _full, train_step

# Per step, inductor vs the eager backend (fusion changes float rounding, nothing else).
TOL = 1e-5


def inductor_vs_eager(
    rank: int,
    world: int,
    cases: list[tuple[str, str, str]],
    steps: int = step_aside.MAX_CALLS + 1,
    reorder: bool = True,
) -> dict[str, Any]:
    """For each (style, model, optimizer): the same training on backend='eager' and 'inductor'.

    Returns the problems found, the largest differences, per-case compile times, the
    generated code's collective order next to the final graph's, and whether the code calls
    oneDNN's matmul. In the replicate case the GEMM timings disagree across ranks (rank 0
    finds oneDNN faster, the others ATen): every rank must lower with rank 0's choice,
    oneDNN. Each case starts from an empty GEMM policy cache. The steps cover the measured choice
    between inductor's code and the eager backend's graph (spmd.backend.step_aside, up to its
    cap) and one after it; in
    the replicate case its timings disagree across ranks too (:func:`_disagreeing_step_times`):
    ``out["kept"]`` and ``out["measured_ms"]`` are each case's decision and the medians it was
    made from. With ``reorder``, the last
    case's final graph is lowered once more with a pass that swaps two collectives, and
    ``out["reorder"]`` is the LoweringError's message.
    """
    problems: list[str] = []
    out: dict[str, Any] = {
        "problems": problems,
        "max_diff": {},
        "lower_s": {},
        "orders": {},
        "onednn": {},
        "kinds": {},
        "kept": {},
        "measured_ms": {},
        "measured_steps": {},
        "alt_is_eager": {},
    }
    real_timer = gemm_policy.time_gemm
    real_time_call = step_aside.time_call
    for style, model_name, opt_name in cases:
        tag = f"{style}/{model_name}/{opt_name}"
        os.environ["SPMD_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd_gemm_")
        gemm_policy.time_gemm = _disagreeing_timer(rank) if style == "replicate" else real_timer
        step_aside.time_call = _disagreeing_step_times(rank) if style == "replicate" else real_time_call
        model = pm.build(model_name)
        twin = shared.twin(model)
        opt, twin_opt = shared.make_optimizer(opt_name, model), shared.make_optimizer(opt_name, twin)
        # fully_shard: a unit per layer (the mlp is below one default unit, which would stay gathered
        # into backward): gathers, re-gathers and reduce-scatters for the order checks.
        knobs = {"min_unit_mb": 0} if style == "fully_shard" else {}
        mode = spmd.DataParallel(style, **knobs)
        ind = spmd.compile(parallel_mode=mode, backend="inductor")(train_step)
        eag = spmd.compile(parallel_mode=spmd.DataParallel(style, **knobs))(train_step)
        worst = 0.0
        for i in range(steps):
            b = pm.batch(model_name, i, rank)
            ptrs = [local(p).data_ptr() for p in model.parameters()]
            got, want = ind(model, opt, *b), eag(twin, twin_opt, *b)
            # (the first call turns parameters into DTensors: storage is checked from then on)
            if i > 0 and [local(p).data_ptr() for p in model.parameters()] != ptrs:
                problems.append(f"{tag}: step {i} replaced parameter storage (not updated in place)")
            worst = max(worst, _diff(got, want))
            if _diff(got, want) > TOL:
                problems.append(f"{tag}: step {i} loss {got.item()!r} vs eager backend {want.item()!r}")
            for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
                d = _diff(_full(p), _full(q))
                worst = max(worst, d)
                if d > TOL:
                    problems.append(f"{tag}: step {i} param {n} differs from the eager backend by {d:.3g}")
        report = ind.report()
        if report.backend != "inductor" or not report.lower_s:
            problems.append(f"{tag}: report says backend={report.backend!r} lower_s={report.lower_s!r}")
        # the graph inductor compiled (graphs["final"] is the eager backend's where that is kept)
        lowered = ind._last.exe.gm  # type: ignore[union-attr]
        want_order = graph_order(lowered)
        got_order = code_order(ind.lowered_code or "")
        # (sizes the code does not show read as None; check_collective_order treats them as unknown)
        if not want_order or [o[:3] for o in got_order] != [o[:3] for o in want_order]:
            problems.append(f"{tag}: code order {got_order} vs graph order {want_order}")
        out["max_diff"][tag] = worst
        out["lower_s"][tag] = report.lower_s
        out["orders"][tag] = len(got_order)
        out["onednn"][tag] = "onednn_mm" in (ind.lowered_code or "")
        out["kept"][tag] = report.kept
        out["measured_ms"][tag] = report.measured_ms
        out["measured_steps"][tag] = report.measured_steps
        alt = ind._last.exe.alt  # type: ignore[union-attr]
        out["alt_is_eager"][tag] = alt is not None and alt.gm.code == eag.graphs["final"].code
        out["kinds"][tag] = sorted({C.kind_of(n).value for n in C.collectives(lowered.graph)})
    gemm_policy.time_gemm = real_timer
    step_aside.time_call = real_time_call
    if reorder:
        t0 = time.perf_counter()
        out["reorder"] = reorder_detected(eag, twin, twin_opt, *pm.batch(model_name, steps, rank))
        out["lower_s"]["reorder"] = time.perf_counter() - t0
    return out


def _disagreeing_timer(rank: int) -> Any:
    """Fake GEMM timings (ATen ms, oneDNN ms): oneDNN twice as fast on rank 0, half as fast elsewhere."""

    def timer(g: gemm_policy.Gemm) -> tuple[float, float]:
        return (2.0, 1.0) if rank == 0 else (1.0, 2.0)

    return timer


# Injected step times (ms, inductor / eager; a list is cycled call after call, its first entry
# going to the warm-up call). Alone, rank 0 would stop after MIN_PAIRS and keep eager (2x
# faster); rank 1, whose inductor steps alternate 6 / 12 ms (an interquartile range of 3-6 ms),
# would run to MAX_PAIRS and keep inductor (median 9 vs 9.5). Agreed over the ranks (max of
# medians and spreads: 10 / 9.5 ms, spread >= 3 ms > the 0.5 ms gap), both run to MAX_PAIRS and
# keep eager (more than MARGIN below 10).
STEP_MS: dict[int, tuple[float | list[float], float]] = {0: (10.0, 5.0), 1: ([12.0, 6.0], 9.5)}


def _disagreeing_step_times(rank: int) -> Any:
    """A step_aside.time_call that runs the step and reports :data:`STEP_MS` for this rank."""
    seen = {step_aside.INDUCTOR: 0, step_aside.EAGER: 0}

    def time_call(which: str, fn: Any, flat: Any) -> tuple[Any, float]:
        ms = STEP_MS[rank % 2][0 if which == step_aside.INDUCTOR else 1]
        if isinstance(ms, list):
            ms = ms[seen[which] % len(ms)]
        seen[which] += 1
        return fn(*flat), 1e-3 * ms

    return time_call


def _swap_first_independent_collectives(graph: fx.Graph) -> None:
    """A deliberately wrong inductor post-grad pass: issue some collective before the one preceding it."""
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    colls = [n for n in order if C.is_collective(n)]
    for c1, c2 in zip(colls, colls[1:]):
        if c1.meta["val"].shape == c2.meta["val"].shape:
            continue  # swapping equal-sized collectives of one group is not an observable reorder
        # c2's ancestors that run after c1 move with it; legal unless c2 depends on c1.
        todo, moving = list(c2.all_input_nodes), {c2}
        while todo:
            a = todo.pop()
            if a is c1:
                break
            if pos[a] > pos[c1] and a not in moving:
                moving.add(a)
                todo.extend(a.all_input_nodes)
        else:
            for n in sorted(moving, key=pos.__getitem__):
                c1.prepend(n)
            return
    raise AssertionError("no two independent adjacent collectives to swap")


def reorder_detected(step: spmd.CompiledStep, *step_args: Any) -> str:
    """Lower ``step``'s final graph with a pass that reorders two collectives; return the error."""
    from spmd.frontend import step_inputs

    exe = step._last.exe  # type: ignore[union-attr]
    flat = [local(t) for t in exe.inputs(step_inputs.split_args(step_args, {}))]
    try:
        compile_graph(
            step.graphs["final"],
            flat,
            "inductor",
            inductor_config={"post_grad_custom_post_pass": _swap_first_independent_collectives},
        )
    except spmd.LoweringError as exc:
        return str(exc)
    return "no LoweringError"
