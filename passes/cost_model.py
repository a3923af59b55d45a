"""Predicted time of one run of a graph on a device: a roofline per op, collectives on a
second stream, and the critical path through the graph's waits.

A pure analysis of a final graph (every node's ``meta["val"]`` true): it never changes
the graph and never imports ``spmd``. The device is data (:class:`DeviceProfile`), the
process groups are data (:class:`GroupInfo` by group name), so the same function prices a
graph on an H100 cluster or on this machine's CPU and gloo.

The model, per node in program order:

- **Free**: placeholders, outputs, ``getitem`` and ops whose schema says the result
  aliases an argument without writing it (``view``, ``t``, ``slice``, ``split``, ...): no
  device time; a view still pays its call on the host (:func:`free_time`: its own measured
  point where the profile has one, else ``view_overhead_s``), and every collective and wait
  pays ``op_overhead_s`` (the launch, on the compute stream). The GPU profiles set them to 0.
- **Compute** (every other op): where the profile has a measured curve for the op (or its class,
  :func:`op_class`) and the op computes in fp32, the curve's time at the op's FLOPs (matmul,
  attention) or bytes (the rest); else ``max(FLOPs / (peak FLOP/s of its dtype x efficiency of
  its class), bytes moved / (memory bandwidth x efficiency)) + op overhead`` (the arguments
  it reads, those it writes and the outputs it allocates: an ``out=`` buffer is written, not
  read, an in-place argument read and written once each), where a causal attention op runs only
  the unmasked share of its FLOPs (:func:`causal_share`; a measured curve keeps torch's count,
  which it was measured by). Plus, where the profile measured them, the first touch of each
  large fresh output (``fresh_alloc_curve``: page faults of a newly mapped buffer), and for an
  op that loops over its tensors (the all-gather copy-in/out and the aligned fused optimizer of
  a fully_shard step, a fused optimizer, a foreach op) its measured call and per-tensor costs
  (``call_costs``; padded pieces apart, and the copies of the aligned optimizer's padded shards
  by their bytes) in place of the curve's fixed part; else the per-tensor cost of an optimizer
  op's tensor lists, and what a call of its length pays in a step after ops of other kinds
  (``mixed_call_curve``; where not measured, its fixed part x ``mixed_call_factor``). FLOPs come from
  ``torch.utils.flop_counter``'s formulas (the ones ``FlopCounterMode`` uses: matmuls,
  convolutions, attention), applied to the node's ``meta["val"]`` shapes; an op with no
  formula (elementwise, reductions, the fused optimizer) is priced by its bytes. Bytes are
  the tensors it reads and writes: its tensor inputs and outputs, less an ``out=`` buffer
  (written, not read), plus a tensor written in place that the op does not return.
- **Collective**: issued when the program reaches it (the host issues in program order;
  on CUDA the communication stream first waits for the compute issued before it) and its
  process group's communication stream is free: one stream per group, as NCCL runs each
  communicator on its own stream and gloo each group on its own threads, so a tensor-parallel
  collective on the node's links does not queue behind a data-parallel one on the network
  (what they share, SMs or host cores, is not modelled beyond ``comm_compute_overlap``).
  It takes ``steps x latency + bytes x factor / bandwidth``, the ring algorithm: all-gather,
  reduce-scatter and all-to-all move ``(W-1)/W`` of the unsharded bytes in ``W-1`` steps, an
  all-reduce ``2(W-1)/W`` in ``2(W-1)`` steps, a broadcast the bytes once. Bandwidth and
  latency are the intra-node ones when the group lies within one node, the inter-node ones
  when it spans nodes.
  On a device where communication takes the compute's resources (a CPU: gloo's threads),
  the fraction ``1 - comm_compute_overlap`` of its time is charged to the compute stream too,
  and each collective charges it ``collective_host_s`` (issue, wait, wake-up; measured).
  A shared-memory collective (``passes.shm_collectives``) runs on the compute stream instead:
  its launch and two copies of its bytes (:func:`shared_memory_time`), finished when it returns.
- **Wait**: the compute stream stalls until its collective completes; the stall is
  *exposed communication*.

The step ends when every stream is idle. So a gather issued a unit ahead (prefetch)
hides behind the compute before its wait, and one issued just before its first use is
exposed in full.

What it leaves out: kernel-level overlap costs on GPUs (a collective slowing the compute it
overlaps, by memory bandwidth or SMs), caching-allocator and host (Python) overhead beyond the
measured per-call costs, efficiency by shape on GPUs (one efficiency per op class), tree
all-reduce algorithms,
topology beyond "one node / more", and fusion (each op reads and writes memory, as an eager
step does).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from passes import collectives as C
from passes.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from passes.op_accounting import (  # noqa: F401 (re-exported: the cost model's public names)
    _ATTENTION,
    _DTYPE_KEY,
    _OPTIMIZER,
    _aliases_an_input,
    _arg,
    _bytes,
    _cpu_attention_flops,
    _dtype_key,
    _flops,
    _fresh_bytes,
    _is_free,
    _moved_bytes,
    _nbytes,
    _returned,
    _storage_key,
    _tensors,
    _val,
    _written,
    _written_args,
    call_tensors,
    causal_share,
    interpolate,
    node_bytes,
    node_flops,
    op_class,
    ragged_copy_bytes,
    ragged_pieces,
)

__all__ = [
    "CostEstimate",
    "DeviceProfile",
    "GroupInfo",
    "collective_time",
    "call_tensors",
    "estimate_step_time",
    "free_time",
    "interpolate",
    "causal_share",
    "node_bytes",
    "node_flops",
    "op_class",
    "ragged_copy_bytes",
    "ragged_pieces",
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
    # torch's device type the profile describes ("cuda" for the GPU profiles, "cpu" for a
    # calibrated CPU): a step planned or simulated for it is lowered with that device's rules (the
    # chunked loss head's chunk floor, passes.linear_cross_entropy.default_chunk), though the
    # lowering itself traces on the CPU. A profile json without it is a CPU's.
    device_type: str = "cpu"
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
    # Fraction of peak reached per op class (:func:`op_class`: "matmul", "attention",
    # "memory", "optimizer"): "memory" scales the bandwidth of every op, the others the FLOP/s
    # of their class. A class not listed uses compute_efficiency / memory_efficiency.
    op_efficiency: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # Measured time of one call by size, for fp32 ops on this device (``spmd.calibrate``):
    # key -> [[size, seconds], ...] ascending. The key is an op's overload packet
    # ("aten.gelu"), else its class ("matmul", "attention", "memory", "optimizer"); the size is
    # the op's FLOPs for "matmul"/"attention" curves (and the attention ops), else its bytes.
    # Log-log interpolation between points, the first point's time below it, the last point's
    # throughput above it. A curve's time includes the call (dispatch, a fresh output), so an
    # op priced by one does not pay ``op_overhead_s`` again.
    op_curves: Mapping[str, Sequence[Sequence[float]]] = dataclasses.field(default_factory=dict)
    # Time of first touching a freshly allocated output by its bytes (page faults of a large
    # allocation the allocator maps anew each step), [[bytes, seconds], ...]; added to the op.
    fresh_alloc_curve: Sequence[Sequence[float]] = ()
    view_overhead_s: float | None = None  # a view op's dispatch (None: op_overhead_s)
    # Per tensor of a list argument of a foreach or fused optimizer op (its loop over tensors).
    per_tensor_s: float = 0.0
    # Compute-stream time a collective costs the host beyond the launch: issue, the wait, the
    # wake-up of a blocked thread (measured interleaved with compute; 0 on GPU profiles).
    collective_host_s: float = 0.0
    # A collective through shared memory (passes.shm_collectives), measured by spmd.calibrate on
    # this host's ranks: the fixed cost of a call (the op, its counters, the peer's arrival) and,
    # per kind, the ``bytes_of`` bytes a second beyond it. Without them: the launch and two copies
    # at memory bandwidth (:func:`shared_memory_time`).
    shm_call_s: float = 0.0
    shm_bandwidth_by_kind: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # Ops whose time is a loop over their tensors (Python per tensor, or a dispatch per tensor)
    # rather than their bytes, measured per op: overload packet ("spmd.all_gather_copy_in",
    # "aten._foreach_add_") -> {"call": s, "per_tensor": s, "ragged_call": s, "per_ragged": s}.
    # Such an op takes the call, per_tensor x :func:`call_tensors`, and where some of its pieces
    # are padded (:func:`ragged_pieces`) ragged_call + per_ragged x their number, on top of the
    # bandwidth part of its bytes (its curve's time above the curve's first point).
    call_costs: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    # The fixed (per-call) part of each op's time in a step over the same op measured on its own:
    # a step's ops of different kinds run one after another, each with the host's caches and
    # predictors cold for it (measured: a graph mixing tiny ops against each alone; 1.0 on GPUs,
    # where the launch is asynchronous). Scales a curve's first point, a view's call, op_overhead_s
    # of an op priced by the roofline, and the call of ``call_costs``.
    mixed_call_factor: float = 1.0
    # The same for a whole call, by its length: [[seconds a call takes alone, seconds more it
    # takes in a step], ...] ascending (measured: graphs mixing ops of nine kinds at several operand
    # sizes against each kind alone). Where given, a compute op priced by a curve or the roofline
    # takes the extra at its time (log-log between points, the first point's extra below it, the
    # last point's above it) in place of its fixed part x ``mixed_call_factor``; views and
    # ``call_costs`` keep the factor. Empty: the factor alone (and on GPUs).
    mixed_call_curve: Sequence[Sequence[float]] = ()
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def accelerator(self) -> bool:
        """Whether the profile is an accelerator's (any device type but the CPU's)."""
        return self.device_type not in ("cpu", "meta")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["peak_flops"] = dict(self.peak_flops)
        d["bandwidth_by_kind"] = dict(self.bandwidth_by_kind)
        d["shm_bandwidth_by_kind"] = dict(self.shm_bandwidth_by_kind)
        d["op_efficiency"] = dict(self.op_efficiency)
        d["op_curves"] = {k: [list(p) for p in v] for k, v in self.op_curves.items()}
        d["fresh_alloc_curve"] = [list(p) for p in self.fresh_alloc_curve]
        d["mixed_call_curve"] = [list(p) for p in self.mixed_call_curve]
        d["call_costs"] = {k: dict(v) for k, v in self.call_costs.items()}
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

    step_s: float  # every stream idle
    compute_s: float  # sum of compute op times (the compute stream's busy time)
    comm_s: float  # sum of collective times (the communication streams' busy time)
    exposed_comm_s: float  # compute-stream stalls at waits
    flops: float  # FLOPs of the ops with a formula
    comm_by_kind: dict[str, float]  # collective kind -> seconds
    slowest: list[tuple[str, float]]  # the most expensive compute nodes, (name, seconds)
    exposed_by_group: dict[str, float] = dataclasses.field(default_factory=dict)  # group -> stalls

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def free_time(node: fx.Node, profile: DeviceProfile) -> float:
    """Host time of a free op (no kernel): its measured call and per-output cost where the profile
    has them (``call_costs``: a split into many views), else its own measured call (a one-point
    curve under its overload packet, ``aten.t``), else ``view_overhead_s`` (else
    ``op_overhead_s``); nothing for a ``getitem``, a placeholder or the output."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    packet = getattr(node.target, "overloadpacket", None)
    calls = profile.call_costs.get(str(packet)) if packet is not None else None
    if calls:  # a view per output (split_with_sizes, unbind): its measured call and per-output cost
        values = fx.node.map_aggregate((node.args, node.kwargs), _val)
        return calls.get("call", 0.0) * profile.mixed_call_factor + calls.get(
            "per_tensor", 0.0
        ) * call_tensors(values, node.meta.get("val"))
    curve = profile.op_curves.get(str(packet)) if packet is not None else None
    if curve:
        return float(curve[0][1]) * profile.mixed_call_factor
    view = profile.op_overhead_s if profile.view_overhead_s is None else profile.view_overhead_s
    return view * profile.mixed_call_factor


def compute_time(node: fx.Node, profile: DeviceProfile) -> tuple[float, float]:
    """(seconds, FLOPs) of one compute op on ``profile``: a measured curve for its op (or its
    class) where the profile has one and the op computes in fp32, else the roofline plus the op
    overhead; plus the per-tensor cost of a list argument and the first touch of fresh outputs."""
    # The arguments' values once for the three (a map over every argument: most of the time here).
    values = fx.node.map_aggregate((node.args, node.kwargs), _val)
    flops = _flops(node, values)
    dtype = _dtype_key(node, values)
    cls = op_class(node)
    nbytes = _bytes(node, values)
    packet = getattr(node.target, "overloadpacket", None)
    curve = None
    if profile.op_curves and dtype == "fp32":
        curve = profile.op_curves.get(str(packet)) if packet is not None else None
        if curve is None:
            curve = profile.op_curves.get(cls)
    if curve:
        by_flops = cls in ("matmul", "attention")
        t = interpolate(curve, flops if by_flops else nbytes)
        call = curve[0][1]  # the curve's fixed part: a call on almost no data
        if node.target is LINEAR_CROSS_ENTROPY:  # its matmuls by the curve, its logits' passes by bytes
            t += _memory_time(chunked_head_traffic(values), profile)
    else:
        peak = profile.peak_flops.get(dtype) or profile.peak_flops["fp32"]
        f_eff = profile.op_efficiency.get(cls, profile.compute_efficiency)
        m_eff = profile.op_efficiency.get("memory", profile.memory_efficiency)
        # A causal kernel skips the masked blocks: it runs the causal share of torch's count
        # (the FLOPs a published attention efficiency is measured on). Curves keep the count
        # they were measured by.
        call = profile.op_overhead_s
        if node.target is LINEAR_CROSS_ENTROPY:
            t = chunked_head_time(values, peak * f_eff, profile.memory_bandwidth * m_eff, call)
        else:
            run = flops * causal_share(node, values) if cls == "attention" else flops
            moved = _moved_bytes(node, values)
            t = max(run / (peak * f_eff), moved / (profile.memory_bandwidth * m_eff))
        t += call
    calls = profile.call_costs.get(str(packet)) if packet is not None else None
    mixed = profile.mixed_call_factor
    if calls:
        # A loop over tensors: its measured call and per-tensor costs replace the curve's fixed part.
        t = max(t - call, 0.0) + calls.get("call", 0.0) * mixed
        t += calls.get("per_tensor", 0.0) * call_tensors(values, node.meta.get("val"))
        ragged = ragged_pieces(node.target, values[0])
        if ragged:
            t += calls.get("ragged_call", 0.0) + calls.get("per_ragged", 0.0) * ragged
            copied = ragged_copy_bytes(node.target, values[0])
            if copied:  # at the rate of a copy: the "memory" curve above its fixed part, or the roofline
                t += _memory_time(copied, profile)
    elif profile.mixed_call_curve:
        # The whole call as a step runs it, after ops of other kinds: the extra at its length.
        last = profile.mixed_call_curve[-1][0]
        t += interpolate(profile.mixed_call_curve, min(t, last))
        if profile.per_tensor_s and cls == "optimizer":
            t += profile.per_tensor_s * call_tensors(values, None)
    else:
        t += (mixed - 1.0) * call  # the call's fixed part as a step runs it
        if profile.per_tensor_s and cls == "optimizer":
            t += profile.per_tensor_s * call_tensors(values, None)
    if profile.fresh_alloc_curve:
        t += sum(
            interpolate(profile.fresh_alloc_curve, b)
            for b in _fresh_bytes(node)
            if b >= profile.fresh_alloc_curve[0][0]
        )
    return t, flops


def chunked_head_time(values: Any, flops_s: float, bytes_s: float, launch_s: float) -> float:
    """Seconds of ``spmd::linear_cross_entropy`` (passes.linear_cross_entropy) on a roofline
    device, chunk by chunk: it is not one kernel but, per chunk of ``rows`` tokens, three matmuls
    -- the logits ``xc @ W.T`` and ``grad_x`` rows ``g @ W`` each read the whole head ``W`` [V, D],
    and ``grad_W.addmm_(g.T, xc)`` reads and writes the whole ``grad_W`` (float32 under 16-bit
    weights) -- and the traffic over the chunk's [rows, V] logits (:func:`chunked_head_traffic`).
    Each matmul takes the longer of its FLOPs and its bytes; the logits' passes take their bytes.
    With few rows per chunk the matmuls are bound by re-reading ``W`` and ``grad_W`` once per
    chunk: measured on an H100 (benchmarks/bench/cuda_check.py llama, 2 blocks of the Llama 3.1 8B's
    shapes, 8,192 tokens, 2026-11-25), 256-row chunks (the default rule) made the step 25 ms
    slower than one chunk, 1,024-row chunks 2.5 ms, 2,048 0.7 ms."""
    (x, w, _target, _grad, chunk, *_rest), _ = values
    n, d = x.shape
    v = w.shape[0]
    rows = max(1, min(int(chunk), n))
    chunks = -(-n // rows)
    wbytes = v * d * w.element_size()
    acc = v * d * _head_acc_item(w)  # grad_W's accumulator

    def mm(m: int, nbytes: float) -> float:
        return max(2 * m * v * d / flops_s, nbytes / bytes_s)

    total = 0.0
    for start in range(0, n, rows):
        m = min(rows, n - start)
        act = m * d * x.element_size()
        accumulate = acc if chunks == 1 else 2 * acc  # one chunk writes grad_W once
        total += mm(m, wbytes + act) + mm(m, wbytes + act) + mm(m, accumulate + act)
        total += 8 * launch_s
    if chunks > 1 and acc != wbytes:
        total += (acc + wbytes) / bytes_s + launch_s  # the accumulator rounded to W's dtype once
    return total + chunked_head_traffic(values) / bytes_s


def _memory_time(nbytes: float, profile: DeviceProfile) -> float:
    """Seconds of moving ``nbytes`` through memory: the "memory" curve above its fixed part where
    the profile has one, else the roofline's bandwidth."""
    mem = profile.op_curves.get("memory")
    if mem:
        return interpolate(mem, nbytes) - float(mem[0][1])
    bw = profile.memory_bandwidth * profile.op_efficiency.get("memory", profile.memory_efficiency)
    return nbytes / bw


def _head_acc_item(w: torch.Tensor) -> int:
    return 4 if w.dtype in (torch.bfloat16, torch.float16) else w.element_size()


def chunked_head_traffic(values: Any) -> float:
    """Bytes ``spmd::linear_cross_entropy`` moves over its [N, V] logits, all chunks together (the
    loop of passes.linear_cross_entropy, per element of the logits): the logits matmul writes
    them (the activations' dtype), a cast to ``logits_dtype`` reads and writes them, the
    log-softmax reads them twice (max, sum of exp) and writes its output, ``nll_loss_backward``
    writes the gradient, the log-softmax backward reads it and the log-softmax and writes it
    (in place), a cast back to the activations' dtype reads and writes it, and the ``grad_x`` and
    ``grad_W`` matmuls each read it (``grad_W``'s, chunked under 16-bit weights, through a float32
    copy). 40 bytes an element in float32, 54 for chunked bf16 activations with float32 logits:
    113 GB a step at the Llama 3.1 8B's 16,384 tokens x 128,256 vocabulary (the pricing before
    counted 36 of the 54)."""
    (x, w, _target, _grad, chunk, *rest), _ = values
    n = x.shape[0]
    v = w.shape[0]
    xb = x.element_size()
    logits_dtype = rest[2] if len(rest) > 2 and rest[2] is not None else None
    lb = torch.empty((), dtype=logits_dtype).element_size() if logits_dtype is not None else xb
    chunked = int(chunk) < n
    per = xb  # the logits, written by the mm
    per += (xb + lb) if logits_dtype is not None else 0  # the cast (a copy even to the same dtype)
    per += 3 * lb  # log-softmax: max and sum passes, the output written
    per += lb  # nll_loss_backward: the gradient written
    per += 3 * lb  # log-softmax backward: the gradient and the log-softmax read, the gradient written
    per += (lb + xb) if lb != xb else 0  # the gradient cast back to the activations' dtype
    per += xb  # grad_x = g @ W reads it
    acc = _head_acc_item(w)
    per += xb + 2 * acc if chunked and acc != xb else xb  # grad_W: g.T (through a float32 copy) @ x
    return float(per * n * v)


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


def shared_memory_time(node: fx.Node, profile: DeviceProfile) -> float:
    """Seconds of a shared-memory collective (``passes.shm_collectives``) beyond its launch: where
    the profile measured its kind, its call and its bytes at the measured rate; else its copies:
    each rank writes what it sends into its slot and reads what it receives out of its peers', two
    copies of about the collective's bytes (``bytes_of``), each reading and writing them."""
    kind = C.kind_of(node).value
    bw = profile.shm_bandwidth_by_kind.get(kind)
    if bw:
        return profile.shm_call_s + C.bytes_of(node) / bw
    return _memory_time(2 * 2 * C.bytes_of(node), profile)


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
    comm_free: dict[str, float] = {}  # process group -> when its communication stream is next free
    done: dict[fx.Node, float] = {}  # collective -> completion time
    compute_s = comm_s = exposed = flops = 0.0
    by_kind: dict[str, float] = {}
    exposed_by_group: dict[str, float] = {}
    costs: list[tuple[float, str]] = []
    launch = profile.op_overhead_s
    for n in gm.graph.nodes:
        if C.is_collective(n) and C.is_shared_memory(n):
            # Run by the caller through memory the ranks share (passes.shm_collectives): finished
            # when it returns, on the compute stream; its waits cost their launch only.
            kind = C.kind_of(n).value
            t = launch + shared_memory_time(n, profile)
            compute_t += t
            compute_s += t
            comm_s += t
            by_kind[kind] = by_kind.get(kind, 0.0) + t
            done[n] = compute_t
        elif C.is_collective(n):
            kind = C.kind_of(n).value
            group = C.group_of(n)
            t = collective_time(kind, C.bytes_of(n), info(group), profile)
            compute_t += launch + profile.collective_host_s
            compute_s += profile.collective_host_s
            start = max(compute_t, comm_free.get(group, 0.0))
            comm_free[group] = done[n] = start + t
            stolen = (1.0 - profile.comm_compute_overlap) * t
            compute_t += stolen
            compute_s += stolen
            comm_s += t
            by_kind[kind] = by_kind.get(kind, 0.0) + t
        elif C.is_wait(n):
            compute_t += launch
            coll = C.collective_of(n)
            finish = done[coll]
            if finish > compute_t:
                exposed += finish - compute_t
                group = C.group_of(coll)
                exposed_by_group[group] = exposed_by_group.get(group, 0.0) + finish - compute_t
                compute_t = finish
        elif _is_free(n):
            # No kernel, but an op call still pays the dispatch (a view on the host); getitem,
            # placeholders and the output pay nothing.
            view = free_time(n, profile)
            compute_t += view
            compute_s += view
        else:
            t, f = compute_time(n, profile)
            compute_t += t
            compute_s += t
            flops += f
            costs.append((t, n.name))
    costs.sort(reverse=True)
    return CostEstimate(
        step_s=max([compute_t, *comm_free.values()]),
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=exposed,
        flops=flops,
        comm_by_kind=by_kind,
        slowest=[(name, t) for t, name in costs[:top]],
        exposed_by_group=exposed_by_group,
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
