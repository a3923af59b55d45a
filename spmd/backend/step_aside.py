"""The inductor backend steps aside where it loses: a measured whole-step choice between the
inductor-generated code and the eager runtime of the same final graph
(``spmd.compile(..., backend="inductor", inductor_fallback="measure")``, the default).

Inductor's code is not faster on every machine and graph (issue 25: on an AVX2 CPU it was
1.15-1.5x the eager backend's step). Both callables compute the same step of the same final
graph -- the same collectives in the same order, the same in-place updates of the parameters,
buffers and optimizer state (inductor copies its results back into the inputs' storage) -- and
differ only in rounding. So the first calls after the compile time both, on the user's real
steps, and the faster one runs from then on:

* **Schedule.** :data:`SCHEDULE`: the compile call runs inductor (its warm-up), the next one
  eager (its warm-up: the first-run layout check of :mod:`spmd.backend.runtime`), then
  :data:`TIMED_STEPS` of each, alternating, so drifting load falls on both alike. Each is a
  real training step. Timed: the callable's wall time (:func:`time_call`), collectives' waits
  included, as the user sees it.
* **Decision.** The median of each callable's timed steps; with collectives in the graph, the
  largest median over the ranks (a data-parallel step takes as long as its slowest rank): one
  all-reduce (max) of the two medians on each process group of the graph, in the order the
  graph first uses them, right after the last timed step. Every rank runs the same step
  there, so the collective cannot hang and every rank keeps the same callable whatever its own
  timings say. A graph without collectives decides alone (world size 1, or a step that some
  ranks may run alone: a rank-0-only evaluation). Eager is kept only where its median is below
  inductor's by more than :data:`MARGIN`; ties keep inductor.
* **Cost.** ``len(SCHEDULE)`` steps, half of them on eager, plus one 16-byte all-reduce per
  process group; nothing after. A retrace (new shapes, a guard failing) is a new graph and
  measures again.

Numerics: the two callables round differently (within the inductor backend's tolerance), so a
run with the measurement is not bit-identical to one without (its first steps alternate); with
eager kept, later steps are the eager runtime's bits. ``inductor_fallback="never"`` pins
inductor and never runs the eager runtime.
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
# Timed steps per callable. Three is the fewest with a median that ignores one outlier step (a
# collection, another job's burst); each costs a real step, half of them on the slower callable.
TIMED_STEPS = 3
# One warm-up call of each (the compile call runs inductor), then timed calls alternating.
_WARM_UP = ((INDUCTOR, False), (EAGER, False))
SCHEDULE: tuple[tuple[str, bool], ...] = _WARM_UP + ((INDUCTOR, True), (EAGER, True)) * TIMED_STEPS
# Eager must beat inductor's median by more than this fraction to be kept: a small floor, so a
# tie keeps inductor's code, while a real loss of a few percent still steps aside. The noise is
# larger on loaded cores: with the same callable in both slots (benchmarks/step_aside_noise.py,
# 2026-11-25, world size 1, 1 thread, load ~8 on 2 cores) the medians differed by a median 2.9%
# (encoder), 5.9% (GPT), 14% (overhead model); a pick by noise costs at most that difference.
MARGIN = 0.03


def check_fallback(value: Any) -> str:
    """The ``inductor_fallback`` option, validated."""
    return check_choice(
        "inductor_fallback",
        value,
        FALLBACKS,
        "'measure' times inductor's code against the eager runtime of the same graph on the first "
        "steps and keeps the faster, 'never' always runs inductor's code",
    )


def time_call(which: str, fn: Callable[..., Any], flat: Sequence[torch.Tensor]) -> tuple[Any, float]:
    """Run ``fn(*flat)``; return its outputs and its wall time in seconds. ``which`` (``"inductor"``
    or ``"eager"``) names the callable (tests replace this function to inject timings)."""
    t0 = time.perf_counter()
    outs = fn(*flat)
    return outs, time.perf_counter() - t0


def choose(inductor_ms: float, eager_ms: float) -> str:
    """Eager where it beats inductor by more than :data:`MARGIN`; inductor otherwise."""
    return EAGER if eager_ms < inductor_ms * (1 - MARGIN) else INDUCTOR


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


def _max_over_ranks(medians: torch.Tensor, groups: Sequence[tuple[str, torch.device]]) -> torch.Tensor:
    """``medians`` (float64) reduced by max over every rank of ``groups``: one group after the
    other, so on a 2-D mesh (hybrid_shard) the max over the shard group, then over the replicas."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for name, device in groups:
        t = medians.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_resolve_process_group(name))  # type: ignore[arg-type]
        medians = t.cpu()
    return medians


class StepAside:
    """``fn(*flat) -> outputs`` that alternates inductor's code and the eager runtime of the same
    graph for the calls of :data:`SCHEDULE`, then keeps the faster (see the module docstring).

    Args:
        inductor: the inductor-compiled graph.
        eager: the eager runtime of the same graph.
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
        self.times: dict[str, list[float]] = {INDUCTOR: [], EAGER: []}
        self.kept: str | None = None
        # The medians the decision was made from (ms; the max over ranks with collectives).
        self.medians_ms: dict[str, float] = {}

    def __call__(self, *flat: torch.Tensor) -> Any:
        if self.kept is not None:
            return self.callables[self.kept](*flat)
        which, timed = SCHEDULE[self.calls]
        outs, seconds = time_call(which, self.callables[which], flat)
        self.calls += 1
        if timed:
            self.times[which].append(seconds)
        if self.calls == len(SCHEDULE):
            self._decide()
        return outs

    def _decide(self) -> None:
        local = torch.tensor(
            [1e3 * statistics.median(self.times[INDUCTOR]), 1e3 * statistics.median(self.times[EAGER])],
            dtype=torch.float64,
        )
        agreed = _max_over_ranks(local, self.groups) if self.groups else local
        inductor_ms, eager_ms = (float(v) for v in agreed)
        self.medians_ms = {INDUCTOR: inductor_ms, EAGER: eager_ms}
        self.kept = choose(inductor_ms, eager_ms)
        log.info(
            "spmd: %s: kept %s's code after timing %d steps of each: median %.2f ms inductor, %.2f ms "
            "eager runtime of the same graph (%s; eager is kept if more than %.0f%% faster)",
            self.label,
            self.kept,
            TIMED_STEPS,
            inductor_ms,
            eager_ms,
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
        "measured_steps": {k: len(v) for k, v in aside.times.items()},
    }
