"""Item 4 of "Measurement": our final graph against inductor's overlap scheduler, by one cost model.

Three graphs of the same compiled step are compared: ``partitioned`` (collectives as the
partitioner placed them, before any pass), spmd's ``final``, and inductor's
``schedule_overlap_bucketing`` applied to a copy of ``partitioned`` -- the anchor our own
scheduling must beat (DESIGN.md). For each: collectives, predicted exposed communication,
predicted step time, and predicted peak memory (``passes.memory.estimate_peak_memory``).

The cost model (simple on purpose; the same numbers drive inductor's decisions, through its
``custom_runtime_estimation`` hook, and our evaluation of every graph):

* A compute node costs ``op_overhead + max(flops / flops_per_s, bytes / bytes_per_s)``:
  flops from ``torch.utils.flop_counter``'s formulas (plus one for CPU attention), bytes read
  and written by its ``meta["val"]`` tensors (views move none). ``getitem`` and waits cost
  nothing. The three constants are measured on this machine (one thread) at run time.
* A collective costs its launch (``op_overhead``) on the compute thread and
  ``latency + bytes / bandwidth`` on one communication channel, per kind; latency and
  bandwidth come from timing functional collectives of two sizes on the real gloo group.
  Bytes follow ``passes.collectives.bytes_of``.
* Simulation walks the graph in order with one compute thread and one communication channel
  (collectives run one at a time, in issue order, as on a gloo group): a wait blocks the
  compute thread until its collective has finished; that blocked time is the exposed
  communication. Compute and communication are assumed not to slow each other down, which on
  a CPU (gloo's threads share the cores with compute) is optimistic.

Inductor's scheduler is a private API: any failure (import, signature, an assertion on our
graphs) is caught and reported as ``unavailable: <reason>``, never raised. It assumes
functional graphs; ours update parameters in place at the end, so its reordering is only
evaluated here, never run.
"""

from __future__ import annotations

import dataclasses
import operator
import statistics
import time
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from passes import collectives as C
from passes.driver import copy_graph_module
from passes.memory import estimate_peak_memory

_c10d = torch.ops._c10d_functional

# Collectives inductor's bucketing emits that our vocabulary (passes.collectives) does not use.
_EXTRA_COLLECTIVES = {_c10d.all_gather_into_tensor_out.default: "all_gather"}


def _is_collective(node: fx.Node) -> bool:
    return C.is_collective(node) or (node.op == "call_function" and node.target in _EXTRA_COLLECTIVES)


def _kind(node: fx.Node) -> str:
    return C.kind_of(node).value if C.is_collective(node) else _EXTRA_COLLECTIVES[node.target]


def _collective_bytes(node: fx.Node) -> int:
    if C.is_collective(node):
        return C.bytes_of(node)
    return sum(t.numel() * t.element_size() for t in _tensors(node.meta.get("val")))  # the gathered output


def _collective_of(wait: fx.Node) -> fx.Node | None:
    src = wait.args[0]
    if isinstance(src, fx.Node) and src.target is operator.getitem:
        src = src.args[0]
    return src if isinstance(src, fx.Node) and _is_collective(src) else None


@dataclasses.dataclass(frozen=True)
class CostModel:
    flops_per_s: float  # single-thread matmul throughput
    bytes_per_s: float  # single-thread elementwise memory throughput (read + write)
    op_overhead_s: float  # eager dispatch cost of one small op
    comm: dict[str, tuple[float, float]]  # kind -> (latency s, bytes per s)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ per node

    def collective_s(self, node: fx.Node, nbytes: int | None = None) -> float:
        lat, bw = self.comm.get(_kind(node), self.comm["all_reduce"])
        return lat + (_collective_bytes(node) if nbytes is None else nbytes) / bw

    def compute_s(self, node: fx.Node) -> float:
        if node.op != "call_function" or node.target is operator.getitem or C.is_wait(node):
            return 0.0
        if _is_collective(node):
            return self.op_overhead_s
        flops = _flops(node)
        moved = 0 if _is_view(node) else _bytes_touched(node)
        return self.op_overhead_s + max(flops / self.flops_per_s, moved / self.bytes_per_s)


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _is_view(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.is_view


def _bytes_touched(node: fx.Node) -> int:
    ins = _tensors(pytree.tree_map(_val, (node.args, node.kwargs)))
    outs = _tensors(node.meta.get("val"))
    return sum(t.numel() * t.element_size() for t in ins + outs)


def _flops(node: fx.Node) -> float:
    from torch.utils.flop_counter import flop_registry

    target = node.target
    packet = getattr(target, "overloadpacket", None)
    fn = flop_registry.get(packet) or flop_registry.get(target)
    args, kwargs = pytree.tree_map(_val, (node.args, node.kwargs))
    if fn is not None:
        try:
            return float(fn(*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:  # noqa: BLE001  (a formula that does not fit these args: count no flops)
            return 0.0
    name = getattr(packet, "__name__", str(target))
    if "scaled_dot_product" in name and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
        # CPU flash attention is not in flop_registry: QK^T and PV, 2 flops per MAC; backward ~2.5x.
        q, k = args[0], args[1]
        b, h, lq, e = q.shape
        f = 4.0 * b * h * lq * k.shape[-2] * e
        return f * 2.5 if "backward" in name else f
    return 0.0


# ---------------------------------------------------------------------- calibration


def _median_time(fn: Any, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def calibrate_compute() -> tuple[float, float, float]:
    """(flops/s, bytes/s, op overhead s) of this process's one thread."""
    a, b = torch.randn(256, 1024), torch.randn(1024, 256)
    flops = 2 * 256 * 1024 * 256 / _median_time(lambda: torch.mm(a, b), 7)
    # Into a preallocated output: a fresh 16 MiB result would be timed with its page faults.
    x, y, z = torch.randn(1 << 22), torch.randn(1 << 22), torch.empty(1 << 22)
    bw = 3 * x.numel() * 4 / _median_time(lambda: torch.add(x, y, out=z), 7)
    s, t = torch.randn(4), torch.randn(4)
    add = torch.ops.aten.add.Tensor

    def many() -> None:
        for _ in range(200):
            add(s, t)

    overhead = _median_time(many, 5) / 200
    return flops, bw, overhead


def calibrate_comm(group_name: str, world_size: int, sizes: tuple[int, int] = (1 << 12, 1 << 22)) -> dict:
    """Per collective kind, (latency s, bytes/s) fitted to two sizes. Every rank must call it."""
    out: dict[str, tuple[float, float]] = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        ts = []
        for nbytes in sizes:
            n = nbytes // 4
            if kind == "all_reduce":
                x = torch.randn(n)
                run = lambda x=x: _c10d.wait_tensor(_c10d.all_reduce(x, "avg", group_name))  # noqa: E731
            elif kind == "all_gather":
                x = torch.randn(n // world_size)
                run = lambda x=x: _c10d.wait_tensor(  # noqa: E731
                    _c10d.all_gather_into_tensor(x, world_size, group_name)
                )
            else:
                x = torch.randn(n)
                run = lambda x=x: _c10d.wait_tensor(  # noqa: E731
                    _c10d.reduce_scatter_tensor(x, "avg", world_size, group_name)
                )
            ts.append(_median_time(run, 5))
        (s0, s1), (t0, t1) = sizes, ts
        bw = (s1 - s0) / max(t1 - t0, 1e-9)
        out[kind] = (max(t0 - s0 / bw, 0.0), bw)
    return out


# ---------------------------------------------------------------------- simulation


@dataclasses.dataclass(frozen=True)
class Prediction:
    collectives: int
    comm_bytes: int
    compute_ms: float  # compute thread busy time (launches included)
    comm_ms: float  # communication channel busy time
    exposed_comm_ms: float  # compute thread blocked in waits
    step_ms: float  # compute + exposed
    peak_mem_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predict(gm: fx.GraphModule, cost: CostModel) -> Prediction:
    """Simulate one step of ``gm`` under ``cost`` (see the module docstring)."""
    t = comm_free = compute = comm = exposed = 0.0
    done: dict[fx.Node, float] = {}
    n_coll = n_bytes = 0
    for node in gm.graph.nodes:
        if _is_collective(node):
            c = cost.compute_s(node)
            t += c
            compute += c
            dur = cost.collective_s(node)
            start = max(t, comm_free)
            comm_free = done[node] = start + dur
            comm += dur
            n_coll += 1
            n_bytes += _collective_bytes(node)
        elif C.is_wait(node):
            coll = _collective_of(node)
            end = done.get(coll, 0.0) if coll is not None else 0.0
            if end > t:
                exposed += end - t
                t = end
        else:
            c = cost.compute_s(node)
            t += c
            compute += c
    try:
        peak: int | None = estimate_peak_memory(gm).peak_bytes
    except Exception:  # noqa: BLE001  (nodes without meta["val"]: report no memory, keep the timing)
        peak = None
    return Prediction(n_coll, n_bytes, compute * 1e3, comm * 1e3, exposed * 1e3, t * 1e3, peak)


def inductor_schedule(
    partitioned: fx.GraphModule, cost: CostModel, *, collective_bucketing: bool = True
) -> fx.GraphModule:
    """``schedule_overlap_bucketing`` on a copy of ``partitioned``, estimating with ``cost``.

    Arguments: the function's defaults (which pre-bucket FSDP collectives), plus
    ``collective_bucketing`` (its overlap-preserving bucketing, on by default here) and
    analytical estimators overridden by our cost model. Inductor's own roofline
    (``estimate_roofline_runtime_ms``) asks triton for GPU bandwidth even when a custom
    estimate is given, so it is replaced by our cost model for the duration of the call.
    """
    from unittest import mock

    from torch._inductor.fx_passes import overlap_scheduling

    def estimate_ms(node: fx.Node, override_size: int | None) -> float | None:
        if _is_collective(node):
            return cost.collective_s(node, override_size) * 1e3
        if node.op == "call_function":
            return cost.compute_s(node) * 1e3
        return None

    with mock.patch.object(
        overlap_scheduling, "estimate_roofline_runtime_ms", lambda node: cost.compute_s(node) * 1e3
    ):
        return overlap_scheduling.schedule_overlap_bucketing(
            copy_graph_module(partitioned),
            collective_bucketing=collective_bucketing,
            custom_runtime_estimation=estimate_ms,
            collective_estimator="analytical",
            compute_estimator="analytical",
        )


def compare(graphs: dict[str, fx.GraphModule], cost: CostModel) -> dict[str, Any]:
    """Predictions for ``partitioned``, spmd ``final`` and inductor's schedule of ``partitioned``."""
    out: dict[str, Any] = {"cost_model": cost.to_dict()}
    out["spmd_partitioned"] = predict(graphs["partitioned"], cost).to_dict()
    out["spmd_final"] = predict(graphs["final"], cost).to_dict()
    # With bucketing first; if inductor fails on our graph, once more without it (and say so).
    failures = []
    for bucketing in (True, False):
        t0 = time.perf_counter()
        try:
            scheduled = inductor_schedule(graphs["partitioned"], cost, collective_bucketing=bucketing)
        except Exception as exc:  # noqa: BLE001  (private API: report, never crash the benchmark)
            failures.append(f"collective_bucketing={bucketing}: {type(exc).__name__}: {_first_line(exc)}")
            continue
        out["inductor"] = predict(scheduled, cost).to_dict()
        out["inductor"].update(schedule_s=time.perf_counter() - t0, collective_bucketing=bucketing)
        if failures:
            out["inductor"]["failed_first"] = failures
        return out
    out["inductor"] = {"error": "unavailable: " + "; ".join(failures)}
    return out


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else ""
