"""Predicted time of one run of a graph on a device: a roofline per op, collectives on a
second stream, and the critical path through the graph's waits.

A pure analysis of a final graph (every node's ``meta["val"]`` true): it never changes
the graph and never imports ``spmd``. The device is data (:class:`DeviceProfile`), the
process groups are data (:class:`GroupInfo` by group name), so the same function prices a
graph on an H100 cluster or on this machine's CPU and gloo.

The model, per node in program order:

- **Free**: placeholders, outputs, ``getitem`` and ops whose schema says the result
  aliases an argument without writing it (``view``, ``t``, ``slice``, ``split``, ...): no
  device time; a view still pays ``op_overhead_s`` (its dispatch), as does every
  collective and wait (the launch, on the compute stream). The GPU profiles set it to 0.
- **Compute** (every other op): ``max(FLOPs / (peak FLOP/s of its dtype x efficiency),
  bytes / (memory bandwidth x efficiency)) + op overhead``. FLOPs come from
  ``torch.utils.flop_counter``'s formulas (the ones ``FlopCounterMode`` uses: matmuls,
  convolutions, attention), applied to the node's ``meta["val"]`` shapes; an op with no
  formula (elementwise, reductions, the fused optimizer) is priced by its bytes. Bytes are
  its tensor inputs plus its outputs, plus once more each argument it writes in place.
- **Collective**: issued when the program reaches it (the host issues in program order;
  on CUDA the communication stream first waits for the compute issued before it) and the
  communication stream is free; it takes ``steps x latency + bytes x factor / bandwidth``,
  the ring algorithm: all-gather, reduce-scatter and all-to-all move ``(W-1)/W`` of the
  unsharded bytes in ``W-1`` steps, an all-reduce ``2(W-1)/W`` in ``2(W-1)`` steps, a
  broadcast the bytes once. Bandwidth and latency are the intra-node ones when the group
  lies within one node, the inter-node ones when it spans nodes.
  On a device where communication takes the compute's resources (a CPU: gloo's threads),
  the fraction ``1 - comm_compute_overlap`` of its time is charged to the compute stream too.
- **Wait**: the compute stream stalls until its collective completes; the stall is
  *exposed communication*.

The step ends when both streams are idle. So a gather issued a unit ahead (prefetch)
hides behind the compute before its wait, and one issued just before its first use is
exposed in full.

What it leaves out: kernel-level overlap costs (a collective slowing the compute it
overlaps, by memory bandwidth or SMs), caching-allocator and host (Python) overhead
beyond ``op_overhead_s``, tree all-reduce algorithms, topology beyond "one node / more",
and fusion (each op reads and writes memory, as an eager step does).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from passes import collectives as C

__all__ = [
    "CostEstimate",
    "DeviceProfile",
    "GroupInfo",
    "collective_time",
    "estimate_step_time",
    "node_bytes",
    "node_flops",
    "ring_bus_factor",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One device kind and its interconnect; every number names its source in ``sources``."""

    name: str
    # Peak dense FLOP/s per compute dtype ("bf16", "fp16", "fp32", "fp64"); a dtype not
    # listed falls back to "fp32".
    peak_flops: Mapping[str, float]
    memory_bandwidth: float  # bytes/s of device memory (HBM, or DRAM for a CPU)
    intra_node_bandwidth: float  # bus bandwidth (bytes/s per rank) of a collective within one node
    inter_node_bandwidth: float  # the same for a collective whose group spans nodes
    intra_node_latency_s: float  # seconds per ring step within a node
    inter_node_latency_s: float  # seconds per ring step across nodes
    gpus_per_node: int  # ranks per node
    # Fraction of peak FLOP/s reached by the compute ops (MFU-like; 1.0 = the roofline).
    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0  # fraction of memory_bandwidth reached by memory-bound ops
    op_overhead_s: float = 0.0  # fixed time per compute op (dispatch / kernel launch)
    # Fraction of a collective's time the compute can run alongside it: 1.0 where communication
    # has its own engine (assumed for NCCL on GPUs), less on a CPU where gloo's threads take
    # the cores compute runs on (measured by spmd.calibrate). The rest is charged to compute.
    comm_compute_overlap: float = 1.0
    # Bus bandwidth per collective kind ("all_reduce", ...) where measured; overrides the
    # intra-node bandwidth for that kind (gloo's algorithms differ by kind).
    bandwidth_by_kind: Mapping[str, float] = dataclasses.field(default_factory=dict)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["peak_flops"] = dict(self.peak_flops)
        d["bandwidth_by_kind"] = dict(self.bandwidth_by_kind)
        d["sources"] = dict(self.sources)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceProfile:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """A process group as the cost model needs it."""

    size: int  # ranks in the group
    spans_nodes: bool  # whether its ranks lie on more than one node


@dataclasses.dataclass
class CostEstimate:
    """Predicted time of one run of the graph (seconds) and where it goes."""

    step_s: float  # both streams idle
    compute_s: float  # sum of compute op times (the compute stream's busy time)
    comm_s: float  # sum of collective times (the communication stream's busy time)
    exposed_comm_s: float  # compute-stream stalls at waits
    flops: float  # FLOPs of the ops with a formula
    comm_by_kind: dict[str, float]  # collective kind -> seconds
    slowest: list[tuple[str, float]]  # the most expensive compute nodes, (name, seconds)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_DTYPE_KEY = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
}


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_free(node: fx.Node) -> bool:
    """No kernel runs: structure, a multi-output pick, or a view (aliases without writing)."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        rets = [r.alias_info for r in target._schema.returns]
        if rets and all(a is not None and not a.is_write for a in rets):
            return True
    return False


def _written_args(node: fx.Node) -> list[Any]:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, a in enumerate(target._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.kwargs.get(a.name) if a.kwarg_only or i >= len(node.args) else node.args[i]
            out.append(v)
    return out


def _cpu_attention_flops(node: fx.Node, args: Any) -> float | None:
    """CPU flash attention, which ``flop_registry`` lacks: torch's own SDPA formulas
    (``sdpa_flop_count``: QK^T and PV, non-causal, as for the CUDA kernels)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v = args[:3]
        return float(fc.sdpa_flop_count(q.shape, k.shape, v.shape))
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        g, q, k, v = args[:4]
        return float(fc.sdpa_backward_flop_count(g.shape, q.shape, k.shape, v.shape))
    return None


def node_flops(node: fx.Node) -> float:
    """FLOPs of one op by ``torch.utils.flop_counter``'s formula for it (0 where it has none)."""
    return _flops(node, fx.node.map_aggregate((node.args, node.kwargs), _val))


def _flops(node: fx.Node, values: Any) -> float:
    """:func:`node_flops` given the node's arguments as values (``(args, kwargs)``)."""
    from torch.utils.flop_counter import flop_registry

    target = node.target
    packet = getattr(target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    args, kwargs = values
    try:
        if formula is None:
            return _cpu_attention_flops(node, args) or 0.0
        return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read these shapes: price by bytes
        return 0.0


def node_bytes(node: fx.Node) -> int:
    """Bytes an op moves: its tensor inputs and outputs, and its in-place writes once more."""
    return _bytes(node, fx.node.map_aggregate((node.args, node.kwargs), _val))


def _bytes(node: fx.Node, values: Any) -> int:
    """:func:`node_bytes` given the node's arguments as values."""
    total = sum(_nbytes(t) for t in _tensors(values))
    total += sum(_nbytes(t) for t in _tensors(node.meta.get("val")))
    written = fx.node.map_aggregate(tuple(_written_args(node)), _val)
    total += sum(_nbytes(t) for t in _tensors(written))
    return total


def _dtype_key(node: fx.Node, values: Any) -> str:
    for t in _tensors(values) + _tensors(node.meta.get("val")):
        if t.is_floating_point():
            return _DTYPE_KEY.get(t.dtype, "fp32")
    return "fp32"


def compute_time(node: fx.Node, profile: DeviceProfile) -> tuple[float, float]:
    """(seconds, FLOPs) of one compute op on ``profile``: the roofline plus the op overhead."""
    # The arguments' values once for the three (a map over every argument: most of the time here).
    values = fx.node.map_aggregate((node.args, node.kwargs), _val)
    flops = _flops(node, values)
    peak = profile.peak_flops.get(_dtype_key(node, values)) or profile.peak_flops["fp32"]
    t_flops = flops / (peak * profile.compute_efficiency)
    t_bytes = _bytes(node, values) / (profile.memory_bandwidth * profile.memory_efficiency)
    return max(t_flops, t_bytes) + profile.op_overhead_s, flops


def collective_time(kind: str, nbytes: float, group: GroupInfo, profile: DeviceProfile) -> float:
    """Seconds of one ring collective of ``nbytes`` (its larger side, as
    ``passes.collectives.bytes_of`` counts) over ``group`` on ``profile``."""
    w = group.size
    if w <= 1:
        return 0.0
    steps = 2 * (w - 1) if kind == C.Kind.ALL_REDUCE.value else w - 1
    factor = ring_bus_factor(kind, w)
    if group.spans_nodes:
        bw, lat = profile.inter_node_bandwidth, profile.inter_node_latency_s
    else:
        bw = profile.bandwidth_by_kind.get(kind, profile.intra_node_bandwidth)
        lat = profile.intra_node_latency_s
    return steps * lat + nbytes * factor / bw


def estimate_step_time(
    gm: fx.GraphModule,
    profile: DeviceProfile,
    groups: Mapping[str, GroupInfo] | Callable[[str], GroupInfo],
    *,
    top: int = 5,
) -> CostEstimate:
    """The predicted time of one run of ``gm`` on ``profile`` (see the module docstring).

    Args:
        groups: process-group name -> :class:`GroupInfo` (a mapping or a function); every
            group a collective of ``gm`` names must be known.
        top: how many of the slowest compute nodes to list.
    """
    info = groups if callable(groups) else groups.__getitem__
    compute_t = 0.0  # when the compute stream is next free
    comm_free = 0.0  # when the communication stream is next free
    done: dict[fx.Node, float] = {}  # collective -> completion time
    compute_s = comm_s = exposed = flops = 0.0
    by_kind: dict[str, float] = {}
    costs: list[tuple[float, str]] = []
    launch = profile.op_overhead_s
    for n in gm.graph.nodes:
        if C.is_collective(n):
            kind = C.kind_of(n).value
            t = collective_time(kind, C.bytes_of(n), info(C.group_of(n)), profile)
            compute_t += launch
            start = max(compute_t, comm_free)
            comm_free = done[n] = start + t
            stolen = (1.0 - profile.comm_compute_overlap) * t
            compute_t += stolen
            compute_s += stolen
            comm_s += t
            by_kind[kind] = by_kind.get(kind, 0.0) + t
        elif C.is_wait(n):
            compute_t += launch
            finish = done[C.collective_of(n)]
            if finish > compute_t:
                exposed += finish - compute_t
                compute_t = finish
        elif _is_free(n):
            # No kernel, but an op call still pays the dispatch (a view on the host); getitem,
            # placeholders and the output pay nothing.
            if n.op == "call_function" and n.target is not operator.getitem:
                compute_t += launch
                compute_s += launch
        else:
            t, f = compute_time(n, profile)
            compute_t += t
            compute_s += t
            flops += f
            costs.append((t, n.name))
    costs.sort(reverse=True)
    return CostEstimate(
        step_s=max(compute_t, comm_free),
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=exposed,
        flops=flops,
        comm_by_kind=by_kind,
        slowest=[(name, t) for t, name in costs[:top]],
    )


def ring_bus_factor(kind: str, world: int) -> float:
    """The ring algorithm's bytes-on-the-wire factor per rank for ``kind`` at ``world`` ranks."""
    if world <= 1:
        return 0.0
    if kind == C.Kind.ALL_REDUCE.value:
        return 2 * (world - 1) / world
    if kind == C.Kind.BROADCAST.value:
        return 1.0
    return (world - 1) / world
