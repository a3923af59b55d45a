"""Which library each float32 CPU matmul of the inductor backend calls, measured per shape
(``spmd.compile(..., backend="inductor", inductor_gemm="auto")``, the default).

Inductor calls ATen's ``mm``/``addmm`` for a float32 CPU matmul, which in torch's x86 build is
MKL's sgemm. oneDNN's matmul (``mkldnn._linear_pointwise``) computes the same product. Which is
faster depends on the CPU, the shape and the layout: on an AMD EPYC with AVX-512 oneDNN won
1.5-3x on every matmul of the bench GPT; on an AMD EPYC with AVX2 only, MKL won on most of them
(benchmarks/results/performance.md, "The inductor backend on an AVX2 CPU"). So no fixed rule is right; this
module times both on the machine that runs the step:

* **What is timed.** Each distinct :class:`Gemm` of the graph -- ``(m, k, n)``, the strides of
  both operands, bias or not -- on real tensors of that layout, in the calling thread with
  torch's current thread count: one warm-up call of each library, then alternating calls
  (``_MIN_REPS`` to ``_MAX_REPS``, as many as fit ``_BUDGET_S`` per shape), median of each;
  with one thread in CPU time of the calling thread, so other processes' load does not count.
  oneDNN is chosen only where its median is below ATen's by more than ``_MARGIN``.
* **Cost.** About ``2 * (1 + reps)`` calls per shape, at most ~``_BUDGET_S`` of CPU time after the
  warm-up: 3.5-4.8 s per compile for the 15 shapes of the bench encoder / GPT (measured here,
  2026-11-25; 11-18 s of wall time at load 12-18 on 2 cores).
* **Cache.** Decisions are stored in ``$SPMD_CACHE_DIR/gemm_policy.json`` (default
  ``~/.cache/spmd``), keyed by shape and by torch version, CPU model and ISA, and thread count;
  a later compile with the same key skips the timing.
* **Same on every rank.** Every rank must lower the same graph. With a process group of more
  than one rank, every rank sends its shapes to all (``all_gather_object``, default group);
  rank 0 alone decides the union (its cache, else its timings) and broadcasts the decisions
  (``broadcast_object_list``). These two collectives run on every rank whatever the caches
  hold, so the ranks stay in step; a failure on rank 0 is broadcast and raised everywhere.
  Rank 0 times while the others wait, so the timings see one busy rank, not all of them.
  A default group without gloo (NCCL alone, the fake test backend) cannot send these objects:
  then every rank keeps ATen for every matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx

from spmd.errors import LoweringError

log = logging.getLogger("spmd")

# Per shape: stop repeating once both libraries together used this much (after the warm-up).
_BUDGET_S = 0.3
_MIN_REPS, _MAX_REPS = 3, 15
# oneDNN must beat ATen (inductor's own choice) by more than this fraction of ATen's median:
# medians of the same call differ by a few percent between runs on loaded cores (two runs of
# benchmarks/profiles/gemm_shapes.py here, 2026-11-25), so a closer call keeps inductor's default.
_MARGIN = 0.05
_CACHE_FILE = "gemm_policy.json"

ATEN, ONEDNN = "aten", "onednn"


@dataclasses.dataclass(frozen=True, order=True)
class Gemm:
    """One float32 CPU matmul as the library sees it: ``(m x k) @ (k x n)`` (``+ bias[n]``)."""

    m: int
    k: int
    n: int
    a_stride: tuple[int, int]
    b_stride: tuple[int, int]
    bias: bool

    def key(self) -> str:
        """The cache key of this shape and layout, e.g. ``1024x256x768 a(256,1) b(1,256) +bias``."""
        a, b = ",".join(map(str, self.a_stride)), ",".join(map(str, self.b_stride))
        return f"{self.m}x{self.k}x{self.n} a({a}) b({b}){' +bias' if self.bias else ''}"


@dataclasses.dataclass(frozen=True)
class Decision:
    """The library chosen for one :class:`Gemm`, with the medians it was chosen from."""

    choice: str  # ATEN or ONEDNN
    aten_ms: float
    onednn_ms: float
    cached: bool = False  # read from the cache, not timed by this compile


# ----------------------------------------------------------------------------- graph side


def _val(a: Any) -> torch.Tensor | None:
    v = a.meta.get("val") if isinstance(a, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _cpu_f32_2d(a: Any) -> bool:
    v = _val(a)
    return v is not None and v.device.type == "cpu" and v.dtype == torch.float32 and v.dim() == 2


def gemm_of(n: fx.Node) -> Gemm | None:
    """The :class:`Gemm` of a float32 CPU ``mm(a, b)`` or ``addmm(bias, a, b)`` (1-D float32 bias,
    ``beta = alpha = 1``: what oneDNN's matmul with bias computes), else None."""
    if n.op != "call_function" or not torch.backends.mkldnn.is_available():
        return None
    if n.target is torch.ops.aten.mm.default:
        a, b, bias = n.args[0], n.args[1], None
    elif n.target is torch.ops.aten.addmm.default:
        bias, a, b = n.args[0], n.args[1], n.args[2]
        bv = _val(bias)
        if (
            n.kwargs.get("beta", 1) != 1
            or n.kwargs.get("alpha", 1) != 1
            or bv is None
            or bv.dim() != 1
            or bv.dtype != torch.float32
        ):
            return None
    else:
        return None
    if not (_cpu_f32_2d(a) and _cpu_f32_2d(b)):
        return None
    av, bv2 = _val(a), _val(b)
    assert av is not None and bv2 is not None
    (m, k), nn = av.shape, bv2.shape[1]
    return Gemm(
        int(m),
        int(k),
        int(nn),
        (int(av.stride(0)), int(av.stride(1))),
        (int(bv2.stride(0)), int(bv2.stride(1))),
        bias is not None,
    )


# ----------------------------------------------------------------------------- timing


def onednn_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` by oneDNN's matmul (``mkldnn._linear_pointwise`` takes ``b`` as a
    transposed weight, any strides)."""
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


def _strided(rows: int, cols: int, stride: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """A random ``rows x cols`` tensor with ``stride`` (overlapping or padded layouts included)."""
    span = 1 + (rows - 1) * stride[0] + (cols - 1) * stride[1]
    return torch.randn(span, generator=gen).as_strided((rows, cols), stride)


def _median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def _clock() -> Callable[[], float]:
    """The clock the timings read: with one torch thread the calling thread's CPU time (both
    libraries then compute in this thread, and time the OS gives other processes is not counted:
    on 2 cores shared by 10 runnable processes, wall-clock medians of 3-5 calls put oneDNN ahead on
    shapes where it is 1.6-1.9x slower); with more threads the wall clock (the work is spread over
    threads this one does not see)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def time_gemm(g: Gemm) -> tuple[float, float]:
    """Median milliseconds of ATen's and of oneDNN's call for ``g`` on this machine, now
    (:func:`_clock`).

    One warm-up call each (oneDNN builds its primitive, MKL its buffers), then calls that
    alternate between the two so drifting load falls on both alike.
    """
    clock = _clock()
    gen = torch.Generator().manual_seed(0)
    a, b = _strided(g.m, g.k, g.a_stride, gen), _strided(g.k, g.n, g.b_stride, gen)
    bias = torch.randn(g.n, generator=gen) if g.bias else None

    def aten() -> torch.Tensor:
        return torch.addmm(bias, a, b) if bias is not None else torch.mm(a, b)

    def dnn() -> torch.Tensor:
        return onednn_matmul(a, b, bias)

    times: dict[str, list[float]] = {ATEN: [], ONEDNN: []}
    with torch.no_grad():
        warm = 0.0
        for fn in (aten, dnn):
            t0 = clock()
            fn()
            warm += clock() - t0
        reps = max(_MIN_REPS, min(_MAX_REPS, int(_BUDGET_S / max(warm, 1e-9))))
        for _ in range(reps):
            for name, fn in ((ATEN, aten), (ONEDNN, dnn)):
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
    return _median_ms(times[ATEN]), _median_ms(times[ONEDNN])


def choose(aten_ms: float, onednn_ms: float) -> str:
    """oneDNN where it beats ATen by more than ``_MARGIN``; ATen (inductor's default) otherwise."""
    return ONEDNN if onednn_ms < aten_ms * (1 - _MARGIN) else ATEN


# ----------------------------------------------------------------------------- cache


def cache_dir() -> str:
    """``$SPMD_CACHE_DIR``, else ``~/.cache/spmd``."""
    return os.environ.get("SPMD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spmd")


@functools.cache
def _cpu_model() -> str:
    """The CPU's name, family and model (Linux ``/proc/cpuinfo``), else ``platform.processor()``."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                k, _, v = line.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    return f"{name} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def machine_key() -> str:
    """What a decision depends on besides the shape: torch, the CPU and its vector ISA, threads."""
    isa = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__} | {_cpu_model()} | {isa} | {torch.get_num_threads()} threads"


def load_cache(directory: str) -> dict[str, Decision]:
    """This machine's cached decisions by :meth:`Gemm.key` (empty if none or unreadable)."""
    try:
        with open(os.path.join(directory, _CACHE_FILE)) as f:
            entries = json.load(f).get(machine_key(), {})
        return {
            k: Decision(v["choice"], v["aten_ms"], v["onednn_ms"], cached=True) for k, v in entries.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def save_cache(directory: str, decisions: dict[str, Decision]) -> None:
    """Merge ``decisions`` into the cache file under this machine's key (atomic replace)."""
    path = os.path.join(directory, _CACHE_FILE)
    try:
        os.makedirs(directory, exist_ok=True)
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        mine = data.setdefault(machine_key(), {})
        for k, d in decisions.items():
            mine[k] = {"choice": d.choice, "aten_ms": round(d.aten_ms, 4), "onednn_ms": round(d.onednn_ms, 4)}
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".gemm_policy.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not fail the compile
        log.warning("spmd: could not write the GEMM policy cache %s (%s)", path, exc)


# ----------------------------------------------------------------------------- deciding


def decide_here(
    gemms: Iterable[Gemm],
    *,
    timer: Callable[[Gemm], tuple[float, float]] | None = None,
    directory: str | None = None,
) -> dict[Gemm, Decision]:
    """This process's decision for each of ``gemms``: from the cache where it has one, else timed
    with ``timer`` (default :func:`time_gemm`; then cached)."""
    timer = timer or time_gemm
    directory = directory or cache_dir()
    cached = load_cache(directory)
    out: dict[Gemm, Decision] = {}
    fresh: dict[str, Decision] = {}
    t0 = time.perf_counter()
    for g in sorted(set(gemms)):
        if g.key() in cached:
            out[g] = cached[g.key()]
            continue
        aten_ms, onednn_ms = timer(g)
        out[g] = fresh[g.key()] = Decision(choose(aten_ms, onednn_ms), aten_ms, onednn_ms)
    if fresh:
        save_cache(directory, fresh)
    log.info(
        "spmd: GEMM policy: %d matmul shape(s), %d timed in %.2f s, %d from the cache; oneDNN for %s",
        len(out),
        len(fresh),
        time.perf_counter() - t0,
        len(out) - len(fresh),
        ", ".join(g.key() for g, d in out.items() if d.choice == ONEDNN) or "none",
    )
    return out


def decide(
    gemms: Sequence[Gemm],
    *,
    timer: Callable[[Gemm], tuple[float, float]] | None = None,
    directory: str | None = None,
) -> dict[Gemm, Decision]:
    """The decision for each of ``gemms``, the same on every rank (see the module docstring):
    with a default process group of more than one rank, rank 0 decides the union of all
    ranks' shapes and broadcasts; otherwise :func:`decide_here`. Every rank must call it at
    the same point (it runs two collectives on the default group).

    Raises:
        LoweringError: timing failed (on rank 0, for every rank).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return decide_here(gemms, timer=timer, directory=directory)
    if "gloo" not in str(dist.get_backend()):
        # No CPU collectives to agree with (NCCL alone, the fake test backend): ATen everywhere is
        # the same on every rank.
        log.info(
            "spmd: GEMM policy: no gloo in the default group (%s): ATen for every matmul", dist.get_backend()
        )
        return {g: Decision(ATEN, math.nan, math.nan) for g in gemms}
    world, rank = dist.get_world_size(), dist.get_rank()
    shapes: list[Any] = [None] * world
    dist.all_gather_object(shapes, sorted(set(gemms)))
    union = sorted({g for s in shapes for g in s})
    result: list[Any] = [None]
    if rank == 0:
        try:
            result[0] = decide_here(union, timer=timer, directory=directory)
        except Exception as exc:  # noqa: BLE001  (sent to the other ranks, raised below)
            result[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], str):
        raise LoweringError(
            f"spmd: inductor_gemm='auto' could not time the matmuls on rank 0 ({result[0]}). "
            "Pass inductor_gemm='aten' or 'onednn' to choose the library yourself."
        )
    decisions: dict[Gemm, Decision] = result[0]
    return {g: decisions[g] for g in gemms}
