"""How :mod:`spmd.calibrate` times a call: the median over repeats that each last about a step
(:func:`_best`), curves of (size, seconds) made monotone (:func:`_curve`), and an op timed as a
step's graph runs it (:func:`_in_graph`)."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.backend.bound_ops import bind_ops

# Each timed repeat of a compute measurement lasts at least this long (more calls per repeat
# for a short one): about a step of the bench models, so that on a machine shared with other
# work a measurement is preempted as often as the step it prices (a 5 us op timed in a burst
# shorter than the scheduler's slice would see an idle core).
_WINDOW_S = 0.02


def _best(fn: Callable[[], Any], repeats: int, inner: int = 1, *, window: bool = True) -> float:
    """The median time of ``fn`` (seconds) over ``repeats`` runs of ``inner`` calls (more calls
    where ``window`` and ``inner`` of them take less than ``_WINDOW_S``).

    The median, not the best: a step is timed by its median too, so on a machine shared
    with other work both see the same share of the cores. ``window=False`` where the calls
    are collectives (every rank must make the same number).
    """
    t0 = time.perf_counter()
    fn()  # warm up
    if window:
        inner = max(inner, math.ceil(_WINDOW_S / max(time.perf_counter() - t0, 1e-7)))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        ts.append((time.perf_counter() - t0) / inner)
    return statistics.median(ts)


_NUMELS = (2**6, 2**10, 2**14, 2**18, 2**21, 2**23)


def _curve(points: Sequence[tuple[float, float]]) -> list[list[float]]:
    """Ascending by size; points of equal size merged (their mean time); a point slower than a
    larger one takes the larger one's time (a call on more data is not faster: the difference is
    noise, e.g. the first calls of a kernel)."""
    by: dict[float, list[float]] = {}
    for x, t in points:
        by.setdefault(float(x), []).append(t)
    out = [[x, statistics.fmean(ts)] for x, ts in sorted(by.items())]
    for i in range(len(out) - 2, -1, -1):
        out[i][1] = min(out[i][1], out[i + 1][1])
    return out


# The working set of an in-graph measurement: each call reads its own copy of the inputs, so a
# small op's inputs come from memory or the last-level cache, as a step's do (a step's ops each
# read another layer's weights and activations), not from L1 as in a loop over one input.
_GRAPH_WORKING_SET = 32 * 2**20


def _in_graph(target: Any, args: tuple[Any, ...], repeats: int) -> float:
    """Seconds per call of ``target(*args)`` run as a step's graph runs its ops: a GraphModule
    of ``k`` calls, each on its own copy of the tensor arguments (the graph's code with the
    operators bound, the dispatcher, a fresh output freed when unused), timed whole and divided
    by ``k``."""
    per_call = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    k = max(2, min(64, _GRAPH_WORKING_SET // max(per_call, 1)))
    run, flat = _graph_of([(target, args)], k)
    return _best(functools.partial(run, *flat), repeats) / k


def _graph_of(calls: Sequence[tuple[Any, tuple[Any, ...]]], k: int) -> tuple[Any, list[torch.Tensor]]:
    """A GraphModule of ``k`` rounds of ``calls`` (each call on its own copies of its tensors), as
    the eager backend runs a graph (:func:`spmd.backend.bound_ops.bind_ops`), and its inputs."""
    import torch.fx as fx

    g = fx.Graph()
    flat: list[torch.Tensor] = []
    for i in range(k):
        for j, (op, args) in enumerate(calls):
            call_args = []
            for a_i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    call_args.append(g.placeholder(f"a{i}_{j}_{a_i}"))
                    flat.append(a.clone())
                else:
                    call_args.append(a)
            g.call_function(op, tuple(call_args))
    g.output(None)
    return bind_ops(fx.GraphModule(torch.nn.Module(), g)), flat
