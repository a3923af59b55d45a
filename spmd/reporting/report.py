"""``StepReport``: what one compiled step communicates and holds, per rank, read off its graph.

Everything here is static: it is computed from a graph stage (normally ``final``)
and its ``node.meta`` (``val`` sizes, roles, phases), never by running the step.
Per-rank numbers are rank 0's; with uneven ``Shard(0)`` splits rank 0 holds the
largest shard (``ceil(rows / W)`` rows), so they are the maximum over ranks.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
import torch.fx as fx

from passes import collectives as C
from passes.memory import estimate_peak_memory
from passes.meta import CHUNKED_LOSS, GRAD_OF, ROLE, TP_CHOICE, Role
from passes.remat import summarize
from spmd.backend.runtime import INDUCTOR_STAGE
from spmd.backend.step_aside import report_fields

_MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class CollectiveStats:
    """The collectives of one kind in the step."""

    count: int
    bytes: int  # per rank, per step: the larger side of each (see passes.collectives.bytes_of)


@dataclasses.dataclass
class StepReport:
    """What one rank's compiled train step communicates and holds.

    All sizes are bytes per rank per step. ``collectives`` counts the collectives of
    the reported graph stage (after bucketing, a bucket is one collective).
    """

    world_size: int
    parallel_style: str  # "replicate", "fully_shard", ... (the parallel mode's own words)
    collectives: dict[str, CollectiveStats]  # kind ("all_reduce", "all_gather", ...) -> stats
    param_bytes: int  # parameters this rank holds (its shards under fully_shard)
    grad_bytes: int  # gradients as the optimizer reads them (shards under fully_shard)
    optim_state_bytes: int  # optimizer state this rank holds (exp_avg, exp_avg_sq, step, ...)
    buffer_bytes: int  # module buffers (BatchNorm statistics)
    input_bytes: int  # this rank's batch (and other tensor arguments)
    peak_memory_bytes: int  # predicted peak of live tensors during the step (passes.memory)
    peak_node: str  # the node running at the predicted peak
    peak_by_phase: dict[str, int]  # phase -> predicted peak while that phase runs
    num_nodes: int
    num_params: int  # parameter tensors (graph inputs of role param)
    num_grads: int  # gradients the graph produces
    stage: str = "final"  # the graph stage reported on
    # Which graph the report (its predicted peak above all) is read from, in words
    # (:func:`peak_source`): with backend="inductor", spmd's graph before inductor, or the eager
    # backend's graph where the measurement kept it.
    peak_from: str = ""
    trace_s: float | None = None  # make_fx time of the first call
    compile_s: float | None = None  # whole first-call compile (trace, partition, passes, lowering)
    backend: str = "eager"  # what runs the final graph: "eager" (op by op) or "inductor"
    lower_s: float | None = None  # the backend's compile time (inductor), part of compile_s
    lower_role: str | None = None  # shared compile (spmd.backend.compile_once): "alone", "leader", "follower"
    lower_wait_s: float | None = None  # a follower's wait for its leader's compile, part of lower_s
    # backend="inductor" (spmd.backend.step_aside): the option, which callable runs the step from
    # now on ("inductor" or "eager", the eager backend's graph of the same step; None while
    # measuring or for the eager backend), the medians and interquartile ranges it was chosen by
    # (ms per step, the largest over the ranks when the graph has collectives) and the timed steps
    # per callable so far.
    inductor_fallback: str | None = None  # "measure" or "never"
    kept: str | None = None
    measured_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    measured_iqr_ms: dict[str, float] = dataclasses.field(default_factory=dict)  # their spreads
    measured_steps: dict[str, int] = dataclasses.field(default_factory=dict)
    # Loss heads passes.chunked_loss rewrote, in words (tokens x vocab, chunks); empty if none.
    loss_heads: list[str] = dataclasses.field(default_factory=list)
    # Rematerialization (spmd.compile(remat=...); passes.remat), read off the traced graph after it:
    remat: str | float | None = None  # the policy
    activation_saved_bytes: int = 0  # forward values backward reads (what autograd keeps)
    activation_recomputed_bytes: int = 0  # forward values backward computes again instead
    recompute_flops: int = 0  # FLOPs of the recompute (torch.utils.flop_counter)
    step_flops: int = 0  # FLOPs of the step, recompute included
    # The same collectives by the mesh dimension they run over (:func:`dimension_of`: "tp",
    # "dp_shard", "dp_replicate", a flattened "dp_replicate_dp_shard", or "world" for a group of
    # every rank), then by kind: tensor parallelism's apart from the data dimensions'.
    collectives_by_dim: dict[str, dict[str, CollectiveStats]] = dataclasses.field(default_factory=dict)
    # Automatic tensor parallelism (spmd.parallel.auto_tp): one line per candidate class (a
    # repeated block's attention, MLP, the vocabulary-parallel embedding and head): which
    # parameters, how split, sharded or replicated and why (what it saves and the collectives it
    # adds, or where DTensor would redistribute). Empty otherwise.
    tp_choices: list[str] = dataclasses.field(default_factory=list)
    # How many of the collectives run through memory the ranks of this host share, in the caller's
    # thread (passes.shm_collectives; spmd.backend.shm), instead of gloo's sockets.
    shared_memory_collectives: int = 0

    @property
    def extra_flops_fraction(self) -> float:
        """Recompute FLOPs over the step's FLOPs without them."""
        base = self.step_flops - self.recompute_flops
        return self.recompute_flops / base if base else 0.0

    @property
    def comm_bytes(self) -> int:
        """Bytes of every collective of the step, per rank."""
        return sum(c.bytes for c in self.collectives.values())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["comm_bytes"] = self.comm_bytes
        d["extra_flops_fraction"] = self.extra_flops_fraction
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def __str__(self) -> str:
        rows: list[tuple[str, str]] = [
            ("world size", str(self.world_size)),
            ("parallel style", self.parallel_style),
            ("graph", f"{self.stage}: {self.num_nodes} nodes"),
        ]
        if self.trace_s is not None:
            rows.append(("trace / compile", f"{self.trace_s:.2f} s / {_secs(self.compile_s)}"))
        backend = self.backend
        if self.lower_s is not None:
            shared = ""
            if self.lower_role == "follower":
                shared = f", {self.lower_wait_s or 0.0:.2f} s of it waiting for another rank's compile"
            elif self.lower_role == "leader":
                shared = ", compiled for this host"
            backend = f"{self.backend} (lowered in {self.lower_s:.2f} s{shared})"
        elif self.backend != "eager":
            backend = f"{self.backend} (not lowered: spmd.simulate / spmd.plan read the graph before it)"
        rows.append(("backend", backend))
        if self.inductor_fallback is not None:
            rows.append(("kept", self._kept_words()))
        rows += [
            ("params", f"{_size(self.param_bytes)}  ({self.num_params} tensors)"),
            ("grads", f"{_size(self.grad_bytes)}  ({self.num_grads} tensors)"),
            ("optimizer state", _size(self.optim_state_bytes)),
            ("buffers", _size(self.buffer_bytes)),
            ("inputs", _size(self.input_bytes)),
            ("predicted peak", f"{_size(self.peak_memory_bytes)}  (at {self.peak_node or '-'})"),
        ]
        if self.backend != "eager" or self.stage != "final":
            rows.append(("  peak from", self.peak_from))
        rows += [(f"  peak in {phase}", _size(b)) for phase, b in self.peak_by_phase.items()]
        rows += [("chunked loss head", h) for h in self.loss_heads]
        rows += [
            ("remat", str(self.remat)),
            ("  activations saved", _size(self.activation_saved_bytes)),
            ("  recomputed", _size(self.activation_recomputed_bytes)),
            ("  FLOPs", f"{self.step_flops:.3e}, +{100 * self.extra_flops_fraction:.1f}% recompute"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"spmd step report (per rank, rank 0 of {self.world_size})"]
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        lines.append("  collectives:")
        if not self.collectives:
            lines.append("    none")
        else:
            kw = max(len(k) for k in self.collectives)
            lines.append(f"    {'kind':<{kw}}  {'count':>6}  {'bytes/rank':>12}")
            for kind, c in self.collectives.items():
                lines.append(f"    {kind:<{kw}}  {c.count:>6}  {_size(c.bytes):>12}")
            total = sum(c.count for c in self.collectives.values())
            lines.append(f"    {'total':<{kw}}  {total:>6}  {_size(self.comm_bytes):>12}")
            if self.shared_memory_collectives:
                shm = self.shared_memory_collectives
                lines.append(f"    {shm} of {total} through shared memory (one host)")
        if self.collectives_by_dim:
            lines.append("  collectives by mesh dimension:")
            rows2 = [
                (dim, kind, c) for dim, kinds in self.collectives_by_dim.items() for kind, c in kinds.items()
            ]
            dw = max(len("dimension"), *(len(d) for d, _, _ in rows2))
            kw = max(len("kind"), *(len(k) for _, k, _ in rows2))
            lines.append(f"    {'dimension':<{dw}}  {'kind':<{kw}}  {'count':>6}  {'bytes/rank':>12}")
            for dim, kind, c in rows2:
                lines.append(f"    {dim:<{dw}}  {kind:<{kw}}  {c.count:>6}  {_size(c.bytes):>12}")
        if self.tp_choices:
            lines.append("  tensor-parallel placements (chosen by spmd):")
            lines += [f"    {c}" for c in self.tp_choices]
        return "\n".join(lines)

    def comm_bytes_by_dim(self) -> dict[str, int]:
        """Bytes of the step's collectives per rank, by mesh dimension."""
        return {d: sum(c.bytes for c in kinds.values()) for d, kinds in self.collectives_by_dim.items()}

    def _kept_words(self) -> str:
        if self.inductor_fallback == "never":
            return "inductor (inductor_fallback='never')"
        steps = "/".join(str(n) for n in self.measured_steps.values())
        if self.kept is None:
            return f"measuring (timed steps inductor/eager so far: {steps})"
        ms, q = self.measured_ms, self.measured_iqr_ms
        return (
            f"{self.kept} (median step {ms.get('inductor', 0.0):.2f} ms inductor, {ms.get('eager', 0.0):.2f} "
            f"ms the eager backend's graph, interquartile ranges {q.get('inductor', 0.0):.2f} / "
            f"{q.get('eager', 0.0):.2f} ms, {steps} timed steps)"
        )


# The graph a report's peak is predicted from (StepReport.peak_from), by what runs the step.
PEAK_FROM_EAGER = "the final graph, which the eager backend runs op by op"
PEAK_FROM_INDUCTOR = (
    "spmd's final graph, before inductor: inductor fuses its ops and plans its own buffers, so the "
    "peak of the code it runs is not predicted (docs/inductor.md)"
)
PEAK_FROM_EAGER_KEPT = (
    "the eager backend's graph of the step (final), which runs: the measurement kept it over inductor's code"
)
PEAK_FROM_INDUCTOR_DROPPED = (
    f"the inductor pipeline's graph ({INDUCTOR_STAGE}), which inductor compiled: the measurement kept "
    "the eager backend's graph (final) over it, so it does not run"
)


def peak_source(backend: str, stage: str, *, eager_kept: bool = False) -> str:
    """What :attr:`StepReport.peak_from` says for a report of ``stage`` of a step run by
    ``backend``; ``eager_kept``: an inductor step whose measurement kept the eager backend's
    graph, and the report is of that graph."""
    if stage == INDUCTOR_STAGE:
        return PEAK_FROM_INDUCTOR_DROPPED
    if eager_kept:
        return PEAK_FROM_EAGER_KEPT
    if stage != "final":
        return f"the graph after {stage!r}, an intermediate stage (not the graph that runs)"
    return PEAK_FROM_EAGER if backend == "eager" else PEAK_FROM_INDUCTOR


def dimension_of(group_name: str) -> str:
    """The mesh dimension a collective's process group spans, by the group's description
    (``DeviceMesh`` names each dimension's groups ``mesh_<dim name>``): ``"tp"``, ``"dp_shard"``,
    ``"dp_replicate"``, a flattened ``"dp_replicate_dp_shard"``; ``"world"`` for a group of every
    rank; the group's name where it is not known in this process."""
    import torch.distributed as dist

    try:
        pg = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
        size, desc = pg.size(), str(getattr(pg, "group_desc", "") or "")
        world = dist.get_world_size()
    except Exception:  # noqa: BLE001 - no process group world, or a name from another one
        return group_name
    if size == world or desc in ("default_pg", "mesh_default"):
        return "world"
    return desc.removeprefix("mesh_") if desc.startswith("mesh_") else group_name


def _size(n: int) -> str:
    if n >= _MiB:
        return f"{n / _MiB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


def _nbytes(node: fx.Node) -> int:
    """Bytes of the tensor(s) a node holds, by its ``meta["val"]`` (local shapes)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, list | tuple) else [val]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def build_report(
    gm: fx.GraphModule,
    *,
    world_size: int,
    parallel_style: str,
    stage: str = "final",
    trace_s: float | None = None,
    compile_s: float | None = None,
    backend: str = "eager",
    lower_s: float | None = None,
    lower_role: str | None = None,
    lower_wait_s: float | None = None,
    inductor_fallback: str | None = None,
    kept: str | None = None,
    measured_ms: dict[str, float] | None = None,
    measured_iqr_ms: dict[str, float] | None = None,
    measured_steps: dict[str, int] | None = None,
    traced: fx.GraphModule | None = None,
    remat: str | float | None = None,
    peak_from: str | None = None,
) -> StepReport:
    """The report of one graph stage of a compiled step (see :class:`StepReport`).

    ``traced``: the traced graph after rematerialization (single-device semantics), for the
    activation and FLOP numbers; ``remat``: the policy it was built with; ``peak_from``: which
    graph ``gm`` is, in words (None: :func:`peak_source` of ``backend`` and ``stage``)."""
    by_role: dict[Role, int] = {}
    tp_choices: dict[str, None] = {}
    num_params = 0
    grads: dict[str, int] = {}
    for n in gm.graph.nodes:
        role = n.meta.get(ROLE)
        if n.op == "placeholder" and role is not None:
            by_role[role] = by_role.get(role, 0) + _nbytes(n)
            num_params += role is Role.PARAM
            if n.meta.get(TP_CHOICE):
                tp_choices.setdefault(n.meta[TP_CHOICE])
        elif role is Role.GRAD:
            # One per parameter; keyed by name so no stage can count a gradient twice.
            grads[n.meta.get(GRAD_OF, n.name)] = _nbytes(n)
    colls: dict[str, CollectiveStats] = {}
    by_dim: dict[str, dict[str, CollectiveStats]] = {}
    dims: dict[str, str] = {}  # group name -> dimension
    for n in C.collectives(gm.graph):
        kind, nbytes = C.kind_of(n).value, C.bytes_of(n)
        old = colls.get(kind, CollectiveStats(0, 0))
        colls[kind] = CollectiveStats(old.count + 1, old.bytes + nbytes)
        group = C.group_of(n)
        dim = dims.setdefault(group, dimension_of(group))
        per = by_dim.setdefault(dim, {})
        old = per.get(kind, CollectiveStats(0, 0))
        per[kind] = CollectiveStats(old.count + 1, old.bytes + nbytes)
    mem = estimate_peak_memory(gm)
    act = summarize(traced) if traced is not None else None
    return StepReport(
        world_size=world_size,
        parallel_style=parallel_style,
        collectives=colls,
        collectives_by_dim=by_dim,
        tp_choices=list(tp_choices),
        shared_memory_collectives=sum(C.is_shared_memory(n) for n in C.collectives(gm.graph)),
        param_bytes=by_role.get(Role.PARAM, 0),
        grad_bytes=sum(grads.values()),
        optim_state_bytes=by_role.get(Role.OPTIM_STATE, 0),
        buffer_bytes=by_role.get(Role.BUFFER, 0),
        input_bytes=by_role.get(Role.INPUT, 0),
        peak_memory_bytes=mem.peak_bytes,
        peak_node=mem.peak_node,
        peak_by_phase={k: v.peak_bytes for k, v in mem.by_phase.items()},
        num_nodes=len(gm.graph.nodes),
        num_params=num_params,
        num_grads=len(grads),
        stage=stage,
        peak_from=peak_source(backend, stage) if peak_from is None else peak_from,
        trace_s=trace_s,
        compile_s=compile_s,
        backend=backend,
        lower_s=lower_s,
        lower_role=lower_role,
        lower_wait_s=lower_wait_s,
        inductor_fallback=inductor_fallback,
        kept=kept,
        measured_ms=dict(measured_ms or {}),
        measured_iqr_ms=dict(measured_iqr_ms or {}),
        measured_steps=dict(measured_steps or {}),
        loss_heads=[n.meta[CHUNKED_LOSS] for n in gm.graph.nodes if n.meta.get(CHUNKED_LOSS)],
        remat=remat,
        activation_saved_bytes=act.saved_bytes if act else 0,
        activation_recomputed_bytes=act.recomputed_bytes if act else 0,
        recompute_flops=act.recompute_flops if act else 0,
        step_flops=act.step_flops if act else 0,
    )


def describe_mode(parallel_mode: Any) -> tuple[str, int]:
    """(style words, world size) of a parallel mode, for the report; call while its group exists."""
    from spmd.parallel import sharding

    style = str(getattr(parallel_mode, "parallel_style", type(parallel_mode).__name__))
    if style == "fully_shard" and getattr(parallel_mode, "reshard_after_forward", True) is False:
        style += " (reshard_after_forward=False)"
    mp = getattr(parallel_mode, "mixed_precision", None)
    if mp is not None:
        dtypes = {
            "param": mp.param_dtype,
            "reduce": mp.gradient_reduce_dtype,
            "buffer": mp.buffer_dtype,
            "output": getattr(mp, "output_dtype", None),
        }
        style += ", mixed precision " + " ".join(
            f"{k}={str(v).removeprefix('torch.')}" for k, v in dtypes.items() if v is not None
        )
    mesh = getattr(parallel_mode, "mesh", None)
    world = mesh.size() if mesh is not None and hasattr(mesh, "size") else sharding.world_info()[1]
    return style, world


def entry_report(entry: Any, stage: str) -> StepReport:
    """The report of a compiled step's cache entry (``spmd.entry.Entry``) at ``stage``.
    ``final`` is the graph that runs the step: for an inductor step whose measurement kept the
    eager backend's graph, that graph (its pipeline reuses buffers and reduces in place: another
    peak than the inductor pipeline's graph, then the stage :data:`INDUCTOR_STAGE`)."""
    traced_stage = "rematerialize" if "rematerialize" in entry.graphs else "traced"
    eager_kept = stage == "final" and INDUCTOR_STAGE in entry.graphs
    return build_report(
        entry.graphs[stage],
        traced=entry.graphs[traced_stage],
        remat=entry.remat,
        world_size=entry.world_size,
        parallel_style=entry.parallel_style,
        stage=stage,
        peak_from=peak_source(entry.backend, stage, eager_kept=eager_kept),
        trace_s=entry.trace_s,
        compile_s=entry.compile_s,
        backend=entry.backend,
        lower_s=entry.lower_s,
        lower_role=entry.lower_role,
        lower_wait_s=entry.lower_wait_s,
        inductor_fallback=entry.inductor_fallback,
        **report_fields(entry.exe.aside, entry.inductor_fallback),
    )
