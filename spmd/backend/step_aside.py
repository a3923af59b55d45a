"""The inductor backend steps aside where it loses: a measured whole-step choice between the
inductor-generated code and the eager backend's own graph
(``spmd.compile(..., backend="inductor", inductor_fallback="measure")``, the default).

Inductor's code is not faster on every machine and graph (issue 25: on an AVX2 CPU it was
1.15-1.5x the eager backend's step). So the first calls after the compile time it against
what ``backend="eager"`` would run for the same step, on the user's real steps, and the
faster one runs from then on.

**The two candidates.** Both start from the same partitioned graph. Inductor's is the
inductor pipeline's final graph compiled by inductor; the eager one is the eager backend's
pipeline (in-place collectives, buffer reuse: :func:`spmd.pipeline.backend_pipeline`) run on a
copy of the partitioned graph and run op by op by its own
:class:`~spmd.backend.runtime.Executable` (its first call checks and fixes layouts as the eager
backend's does). ``cross_step_prefetch`` is left out of the eager candidate: its gathers,
carried from an eager call to the next, would be in flight across the inductor calls between
them, and inductor's in-place writes to the parameters need not bump the version counters the
carry's validity check reads (:mod:`spmd.backend.carry`). Both graphs take the same flat inputs
(their placeholders are checked to match) and update the same parameter, buffer and optimizer
state storage in place (inductor copies its results back into the inputs), so either can run
any call. They differ in rounding and in what they issue: the same collectives of the same
partition, but bucketed and placed by pipelines that differ (in-place all-reduces). That is
safe because every rank runs the same candidate on every call: which one is a function of the
call count until the decision, and the decision is rank-agreed. Each candidate's graph passes
the rank-agreement check at compile (the ranks compiled the same collective sequence), and
inductor's code is checked against its graph's collective order (:mod:`spmd.backend.lowering`).

**Schedule.** The compile call runs inductor (its warm-up), the next one eager (its warm-up),
then pairs of timed calls, inductor-eager, eager-inductor, and so on (:func:`scheduled`), so
drifting load and the position in a pair fall on both alike. Each is a
real training step. Timed: the callable's wall time (:func:`time_call`), collectives' waits
included, as the user sees it.

**When to stop** (:func:`settled`). After each pair from the :data:`MIN_PAIRS`-th on, each
rank's median and interquartile range of each candidate's steps are reduced by max over the
ranks (a data-parallel step takes as long as its slowest rank; the largest spread is the
noise): one all-reduce of 4 float32 (16 bytes) on each process group of the graph, in the
order the graph first uses them. The measurement stops when the medians differ by more than
the larger spread and by more than :data:`MARGIN`, or at :data:`MAX_PAIRS`; then eager is kept
only where its median is below inductor's by more than :data:`MARGIN` (ties keep inductor). All
ranks run the step where the all-reduce is, so it cannot hang, and every rank reads the same
values, so all stop on the same call and keep the same callable whatever their own timings. A
graph without collectives decides alone (world size 1, or a step that some ranks may run alone:
a rank-0-only evaluation).

**Cost.** 2 warm-up calls and 3 to 10 pairs (8 to 22 steps), half of them on the slower
candidate, plus one 16-byte all-reduce per process group per pair from the third; nothing
after. Building the eager candidate runs the eager pass pipeline once more at compile (part of
``compile_s``). A retrace (new shapes, a guard failing) is a new graph and measures again.

Numerics: the two candidates round differently (within the inductor backend's tolerance), so a
run with the measurement is not bit-identical to one without (its first steps alternate); with
eager kept, later steps are the eager backend's bits. ``inductor_fallback="never"`` pins
inductor and never builds or runs the eager candidate.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from passes import collectives as C
from spmd.errors import check_choice

log = logging.getLogger("spmd")

FALLBACKS = ("measure", "never")
INDUCTOR, EAGER = "inductor", "eager"
# One untimed call of each first: the compile call runs inductor, the next the eager candidate.
WARM_UP = (INDUCTOR, EAGER)
# Timed pairs (a call of each): at least MIN_PAIRS, three being the fewest with a median that
# ignores one outlier step (a collection, another job's burst); at most MAX_PAIRS, so a tie
# costs at most 10 steps on the slower candidate.
MIN_PAIRS = 3
MAX_PAIRS = 10
MIN_CALLS = len(WARM_UP) + 2 * MIN_PAIRS
MAX_CALLS = len(WARM_UP) + 2 * MAX_PAIRS
# Eager must beat inductor's median by more than this fraction to be kept, and the medians must
# differ by more than it to stop before MAX_PAIRS: a small floor, so a tie keeps inductor's code,
# while a real loss of a few percent still steps aside. The noise is larger on loaded cores: with
# the same callable in both slots (benchmarks/profiles/step_aside_noise.py, 2026-11-25, world size 1, 1
# thread, load ~8 on 2 cores, 3+3 steps) the medians differed by a median 2.9% (encoder), 5.9%
# (GPT), 14% (overhead model); hence the spread test and the longer measurement.
MARGIN = 0.03


def check_fallback(value: Any) -> str:
    """The ``inductor_fallback`` option, validated."""
    return check_choice(
        "inductor_fallback",
        value,
        FALLBACKS,
        "'measure' times inductor's code against the eager backend's graph of the same step on the "
        "first steps and keeps the faster, 'never' always runs inductor's code",
    )


def time_call(which: str, fn: Callable[..., Any], flat: Sequence[torch.Tensor]) -> tuple[Any, float]:
    """Run ``fn(*flat)``; return its outputs and its wall time in seconds. ``which`` (``"inductor"``
    or ``"eager"``) names the callable (tests replace this function to inject timings)."""
    t0 = time.perf_counter()
    outs = fn(*flat)
    return outs, time.perf_counter() - t0


def scheduled(calls: int) -> tuple[str, bool]:
    """The candidate the call after ``calls`` earlier ones runs, and whether it is timed. Timed
    pairs alternate their order (inductor-eager, eager-inductor, ...), so neither candidate always
    runs first in a pair and a load that drifts steadily falls on both alike."""
    if calls < len(WARM_UP):
        return WARM_UP[calls], False
    k = calls - len(WARM_UP)
    first, second = (INDUCTOR, EAGER) if (k // 2) % 2 == 0 else (EAGER, INDUCTOR)
    return (first if k % 2 == 0 else second), True


def choose(inductor_ms: float, eager_ms: float) -> str:
    """Eager where it beats inductor by more than :data:`MARGIN`; inductor otherwise."""
    return EAGER if eager_ms < inductor_ms * (1 - MARGIN) else INDUCTOR


def settled(inductor_ms: float, eager_ms: float, inductor_iqr: float, eager_iqr: float, pairs: int) -> bool:
    """Whether the measurement stops after ``pairs`` timed pairs: the medians differ by more than
    the larger interquartile range and by more than :data:`MARGIN` of inductor's, or the cap."""
    if pairs >= MAX_PAIRS:
        return True
    return pairs >= MIN_PAIRS and abs(inductor_ms - eager_ms) > max(
        inductor_iqr, eager_iqr, MARGIN * inductor_ms
    )


def iqr(xs: Sequence[float]) -> float:
    """The interquartile range of ``xs`` (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[2] - q[0]


def deciding_groups(gm: fx.GraphModule) -> list[tuple[str, torch.device]]:
    """The process groups of ``gm``'s collectives, in the order the graph first uses them (the
    same on every rank: the ranks agreed on the graph), each with the device its tensors are on."""
    out: dict[str, torch.device] = {}
    for n in C.collectives(gm.graph):
        group = C.group_of(n)
        if group not in out:
            val = n.meta.get("val")
            first = val[0] if isinstance(val, list | tuple) else val
            out[group] = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    return list(out.items())


def _max_over_ranks(values: torch.Tensor, groups: Sequence[tuple[str, torch.device]]) -> torch.Tensor:
    """``values`` reduced by max over every rank of ``groups``: one group after the other, so on
    a 2-D mesh (hybrid_shard) the max over the shard group, then over the replicas."""
    from passes.torch_compat import resolve_process_group as _resolve_process_group

    for name, device in groups:
        t = values.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_resolve_process_group(name))  # type: ignore[arg-type]
        values = t.cpu()
    return values


class StepAside:
    """``fn(*flat) -> outputs`` that alternates inductor's code and the eager candidate on the
    first calls (:func:`scheduled`) until :func:`settled`, then keeps the faster (see the module
    docstring).

    Args:
        inductor: the inductor-compiled graph.
        eager: the eager candidate (the eager backend's graph of the same step, run op by op).
        groups: :func:`deciding_groups` of the graph (empty: decide on this rank alone).
        on_decide: told the kept callable's name once it is chosen.
    """

    def __init__(
        self,
        inductor: Callable[..., Any],
        eager: Callable[..., Any],
        *,
        groups: Sequence[tuple[str, torch.device]],
        on_decide: Callable[[str], None] | None = None,
        label: str = "train_step",
    ):
        self.callables = {INDUCTOR: inductor, EAGER: eager}
        self.groups = list(groups)
        self.on_decide = on_decide
        self.label = label
        self.calls = 0
        self.last: str | None = None  # the candidate the latest call ran
        self.times: dict[str, list[float]] = {INDUCTOR: [], EAGER: []}
        self.kept: str | None = None
        # What the last check read (ms; the max over ranks with collectives): medians and spreads.
        self.medians_ms: dict[str, float] = {}
        self.iqr_ms: dict[str, float] = {}

    def __call__(self, *flat: torch.Tensor) -> Any:
        if self.kept is not None:
            return self.callables[self.kept](*flat)
        which, timed = scheduled(self.calls)
        self.last = which
        outs, seconds = time_call(which, self.callables[which], flat)
        self.calls += 1
        if timed:
            self.times[which].append(seconds)
            pairs = len(self.times[EAGER])
            if pairs == len(self.times[INDUCTOR]) and pairs >= MIN_PAIRS:  # a pair is complete
                self._check()
        return outs

    def _check(self) -> None:
        """After a pair: agree on the medians and spreads; decide if :func:`settled`."""
        ti, te = self.times[INDUCTOR], self.times[EAGER]
        local = torch.tensor(
            [1e3 * statistics.median(ti), 1e3 * statistics.median(te), 1e3 * iqr(ti), 1e3 * iqr(te)],
            dtype=torch.float32,
        )
        agreed = _max_over_ranks(local, self.groups) if self.groups else local
        inductor_ms, eager_ms, inductor_iqr, eager_iqr = (float(v) for v in agreed)
        self.medians_ms = {INDUCTOR: inductor_ms, EAGER: eager_ms}
        self.iqr_ms = {INDUCTOR: inductor_iqr, EAGER: eager_iqr}
        if not settled(inductor_ms, eager_ms, inductor_iqr, eager_iqr, len(te)):
            return
        self.kept = choose(inductor_ms, eager_ms)
        log.info(
            "spmd: %s: kept %s after timing %d pairs of steps: median %.2f ms inductor's code, %.2f ms "
            "the eager backend's graph, interquartile ranges %.2f / %.2f ms (%s; eager is kept if more "
            "than %.0f%% faster)",
            self.label,
            "inductor's code" if self.kept == INDUCTOR else "the eager backend's graph",
            len(te),
            inductor_ms,
            eager_ms,
            inductor_iqr,
            eager_iqr,
            "the largest over the ranks" if self.groups else "this rank's",
            100 * MARGIN,
        )
        if self.on_decide is not None:
            self.on_decide(self.kept)


def report_fields(aside: Any, fallback: str | None) -> dict[str, Any]:
    """For ``report()``: which callable runs an inductor step, and the timings it was chosen by.
    ``aside`` is the executable's measurement (None: the eager backend, or ``"never"``)."""
    if aside is None:
        return {"kept": INDUCTOR if fallback else None}
    return {
        "kept": aside.kept,
        "measured_ms": dict(aside.medians_ms),
        "measured_iqr_ms": dict(aside.iqr_ms),
        "measured_steps": {k: len(v) for k, v in aside.times.items()},
    }
