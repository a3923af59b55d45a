"""The ordered pass list, with the reason for each position."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.async_tp import pipeline_tp_collectives
from passes.bucketing import bucket_collectives
from passes.chunked_loss import chunk_loss_heads
from passes.cleanup import drop_identity_views, strip_grad_tags
from passes.cross_step import carry_first_gathers
from passes.dedup import dedup_collectives
from passes.driver import NamedPass, run_passes
from passes.gloo_collectives import reduce_scatter_as_all_to_all
from passes.inplace import inplace_all_reduce
from passes.invariants import check_invariants
from passes.last_unit import keep_last_unit_gathered
from passes.optimizer_overlap import overlap_optimizer
from passes.prefetch import default_unit_of, prefetch_all_gathers
from passes.remat import check_policy, rematerialize
from passes.reuse import reuse_dead_buffers
from passes.scheduling import limit_inflight, sink_waits
from passes.shm_collectives import shared_memory_collectives
from passes.torch_compat import resolve_process_group as _resolve_process_group
from passes.units import assign_units
from spmd.errors import ConfigError, PassError
from spmd.parallel import DataParallel, ParallelMode

log = logging.getLogger("spmd")


@dataclasses.dataclass
class Pipeline:
    passes: list[NamedPass]

    def run(
        self,
        gm: fx.GraphModule,
        *,
        disabled: Iterable[str] = (),
        check: bool = False,
        record: Callable[[str, fx.GraphModule], None] | None = None,
    ) -> fx.GraphModule:
        names = {p.name for p in self.passes}
        unknown = sorted(set(disabled) - names)
        if unknown:
            raise PassError(
                f"spmd: disabled_passes names unknown passes {unknown}; the passes are {sorted(names)}."
            )
        from passes.driver import PassFailure

        try:
            return run_passes(
                gm, self.passes, disabled=disabled, check=_checker() if check else None, record=record
            )
        except PassFailure as exc:
            raise PassError(str(exc)) from exc


def _checker() -> Callable[[fx.GraphModule, str], None]:
    def check(gm: fx.GraphModule, name: str) -> None:
        check_invariants(gm)

    return check


def check_remat(remat: object) -> str | float | None:
    """The ``remat=`` option of ``spmd.compile``, validated (ConfigError naming the valid values)."""
    try:
        return check_policy(remat)
    except ValueError as exc:
        raise ConfigError(f"spmd.compile: {exc}") from None


def build_trace_pipeline(*, remat: str | float | None = None) -> Pipeline:
    """The passes over the traced graph (single-device semantics, phases in meta), run before the
    parallel mode's partitioner. Empty unless ``remat`` asks for recompute."""
    passes: list[NamedPass] = []
    if check_remat(remat) not in (None, 1.0):
        passes.append(
            NamedPass(
                name="rematerialize",
                fn=functools.partial(rematerialize, policy=remat),
                reason="before the partitioner: a recomputed matmul is a backward reader of its parameter, "
                "so fully_shard (reshard_after_forward) gathers it in backward; and the graph still has "
                "single-device semantics (no collective to keep in order)",
            )
        )
    return Pipeline(passes)


def build_pipeline(
    parallel_mode: ParallelMode,
    *,
    cross_step_prefetch: bool = False,
    reuse_buffers: bool = False,
    inplace_collectives: bool = True,
    gloo_collectives: bool = False,
    serial_collectives: bool = False,
    accelerator: bool = False,
    shm_groups: dict[str, int] | None = None,
    identity_views: bool = False,
) -> Pipeline:
    """The built-in passes, in order, configured from the parallel mode's knobs.

    ``cross_step_prefetch`` appends ``carry_first_gathers`` and ``reuse_buffers`` appends
    ``reuse_dead_buffers`` (the caller decides where they apply: the eager backend only,
    see ``spmd.api``). ``inplace_collectives`` includes ``inplace_all_reduce``: eager only, as
    inductor's functionalization rejects the in-place ``all_reduce_`` (and inductor reinplaces
    the functional all-reduce itself). ``gloo_collectives`` includes ``reduce_scatter_as_all_to_all``:
    for gloo process groups only (gloo reduce-scatters by all-reducing the whole input; an
    all-to-all and a local sum send less, with the same bits at 2 ranks). ``serial_collectives``
    caps ``limit_inflight`` at one collective in flight: for gloo groups that run collectives
    on more than one thread (:func:`gloo_concurrent`). ``accelerator``: the step is lowered for a
    GPU (``async_tp="auto"`` chunks the tensor-parallel collectives there only). ``shm_groups``
    (name -> size of the groups with shared memory on every rank, ``spmd.backend.shm``) includes
    ``shared_memory_collectives``. ``identity_views`` puts ``drop_identity_views`` first: for the
    eager backend, which calls every op from Python (inductor's code makes no call for a view)."""
    options = parallel_mode.pass_options()
    # The parallel mode's knobs, by the names each pass takes them under (absent: the pass's default).
    names = {"bucket_cap_mb": "bucket_cap_mb", "bucket_mode": "mode", "bucket_unit_of": "unit_of"}
    bucketing = {kw: options[name] for name, kw in names.items() if name in options}
    prefetch = {k: options[k] for k in ("forward_prefetch", "backward_prefetch", "unit_of") if k in options}
    inflight: dict[str, Any] = {k: options[k] for k in ("max_inflight_bytes",) if k in options}
    if serial_collectives:
        inflight["max_inflight_collectives"] = 1
    units = {
        "unit_of": options.get("base_unit_of", default_unit_of),
        "min_unit_bytes": options.get("min_unit_bytes", 0),
    }
    passes = [
        NamedPass(
            name="dedup_collectives",
            fn=dedup_collectives,
            reason="first, on the partitioner's collectives: a duplicate left in a bucket is sent twice",
        ),
        NamedPass(
            name="assign_units",
            fn=functools.partial(assign_units, **units),
            reason="after dedup (sizes of what is really sent); prefetch and bucketing read the units",
        ),
        NamedPass(
            name="keep_last_unit_gathered",
            fn=keep_last_unit_gathered,
            reason="after assign_units (finds the unit forward needs last); before prefetch, which then "
            "issues the next unit's backward gathers at the start of backward",
        ),
        NamedPass(
            name="prefetch_all_gathers",
            fn=functools.partial(prefetch_all_gathers, **prefetch),
            reason="before bucketing: it makes each unit's gathers adjacent, so bucketing merges them",
        ),
        NamedPass(
            name="bucket_collectives",
            fn=functools.partial(bucket_collectives, **bucketing),
            reason="after dedup and prefetch; before the passes that place waits, which should see buckets",
        ),
        NamedPass(
            name="pipeline_tp_collectives",
            fn=functools.partial(pipeline_tp_collectives, **_tp_chunks(options, accelerator)),  # type: ignore[arg-type]
            reason="after bucketing, which would merge the chunks' adjacent collectives back into one; "
            "before sink_waits, which places each chunk's wait at its first reader",
        ),
        NamedPass(
            name="sink_waits",
            fn=sink_waits,
            reason="after bucketing (new waits); widens every collective's overlap window",
        ),
        NamedPass(
            name="limit_inflight",
            fn=functools.partial(limit_inflight, **inflight),
            reason="after sink_waits, which maximised in-flight bytes: pulls waits back within the budget "
            "(and, on a gloo group with several threads, to one collective at a time)",
        ),
        NamedPass(
            name="overlap_optimizer",
            fn=overlap_optimizer,
            reason="after the waits are placed (it reads them, moves none): splits the fused optimizer "
            "update so each bucket's update overlaps the reductions still in flight",
        ),
        NamedPass(
            name="strip_grad_tags",
            fn=strip_grad_tags,
            reason="last: the partitioner and the passes before it find gradients by their tags",
        ),
    ]
    if inplace_collectives:
        at = next(i for i, p in enumerate(passes) if p.name == "bucket_collectives") + 1
        passes.insert(
            at,
            NamedPass(
                name="inplace_all_reduce",
                fn=inplace_all_reduce,
                reason="after bucketing (a bucket's packed buffer dies at its all-reduce); before the passes "
                "that read storages: an all-reduce of a dead buffer reduces it in place, one allocation less",
            ),
        )
    before_overlap = next(i for i, p in enumerate(passes) if p.name == "overlap_optimizer")
    late = []  # inserted before overlap_optimizer, in this order
    if shm_groups:
        late.append(
            NamedPass(
                name="shared_memory_collectives",
                fn=functools.partial(shared_memory_collectives, groups=shm_groups),
                reason="after every pass that places or merges collectives (it changes how they run, not "
                "where); before reduce_scatter_as_all_to_all, which would rewrite a reduce-scatter that "
                "shared memory runs as itself",
            )
        )
    if gloo_collectives:
        late.append(
            NamedPass(
                name="reduce_scatter_as_all_to_all",
                fn=reduce_scatter_as_all_to_all,
                reason="after every pass that reads reduce-scatters as such (units, bucketing, wait "
                "placement): it replaces them; before overlap_optimizer, which records each update's "
                "gradient node (the rewrite replaces a wait that may be one), and reuse_dead_buffers",
            )
        )
    passes[before_overlap:before_overlap] = late
    if identity_views:
        passes.insert(
            0,
            NamedPass(
                name="drop_identity_views",
                fn=drop_identity_views,
                reason="first: every later pass sees fewer nodes, and the passes that record the nodes a "
                "call reads by name (overlap_optimizer, the foreach split) record the ones that stay",
            ),
        )
    if reuse_buffers:
        passes.append(
            NamedPass(
                name="reuse_dead_buffers",
                fn=reuse_dead_buffers,
                reason="after every pass that moves nodes: a later move could put a reader of a taken "
                "buffer after the op that now writes it",
            )
        )
    if cross_step_prefetch:
        passes.append(
            NamedPass(
                name="carry_first_gathers",
                fn=carry_first_gathers,
                reason="after every other pass: they expect each collective's wait in the same graph, "
                "and the carried gather must follow the step's last collective and parameter write",
            )
        )
    return Pipeline(passes)


def _tp_chunks(options: dict[str, Any], accelerator: bool) -> dict[str, int]:
    """``pipeline_tp_collectives``' options for ``async_tp``: ``"auto"`` chunks on a GPU only,
    and only collectives of at least 16 MiB a chunk (at NVLink's few microseconds a ring step,
    smaller ones lose more to latency than they hide); asked for, every matching collective."""
    a = options.get("async_tp", False)
    if a == "auto":
        return {"chunks": 4 if accelerator else 0, "min_chunk_bytes": 16 * 2**20}
    return {"chunks": 4 if a is True else int(a), "min_chunk_bytes": 0}


def backend_pipeline(
    parallel_mode: ParallelMode,
    gm: fx.GraphModule,
    *,
    backend: str,
    cross_step_prefetch: bool = False,
    accelerator: bool | None = None,
    shm_groups: dict[str, int] | None = None,
) -> Pipeline:
    """The pass pipeline of the partitioned graph ``gm`` for ``backend``.

    The eager backend gets the eager-only passes: in-place collectives (inductor functionalizes
    the graph and rejects the in-place ``all_reduce_``, and reinplaces the functional all-reduce
    itself), buffer reuse (inductor reuses buffers itself) and, if asked, cross-step prefetch
    (a backend compiles the graph as a whole, and inductor does not take an unwaited collective
    as an input or output). Both get gloo's rewrites where every group is gloo: inductor lowers
    all_to_all_single as an extern call, and its order is checked like every collective's.
    Where a group is gloo with more than one thread (:func:`gloo_concurrent`), one collective is
    in flight at a time, and cross-step prefetch (a gather in flight across calls) is off.
    ``accelerator``: the device the step is lowered for (None: where its collectives' tensors are).
    ``shm_groups``: the groups whose collectives may run through shared memory (name -> size;
    ``spmd.backend.shm.candidate_groups``), for the eager backend only."""
    eager = backend == "eager"
    if accelerator is None:
        accelerator = any(
            getattr(c.meta.get("val"), "device", torch.device("cpu")).type != "cpu"
            for c in C.collectives(gm.graph)
        )
    shm = (shm_groups or {}) if eager else {}
    serial = gloo_concurrent(gm)
    if serial and cross_step_prefetch:
        log.warning(
            "spmd: cross_step_prefetch is off on a gloo group with several worker threads, where one "
            "collective is in flight at a time (docs/troubleshooting.md); make the group under "
            "spmd.gloo_threads(1)"
        )
    return build_pipeline(
        parallel_mode,
        cross_step_prefetch=cross_step_prefetch and eager and not serial,
        reuse_buffers=eager,
        inplace_collectives=eager,
        gloo_collectives=all_gloo(gm),
        serial_collectives=serial,
        accelerator=accelerator,
        shm_groups=shm,
        identity_views=eager,
    )


def chunk_loss(
    gm: fx.GraphModule,
    option: bool | int | str,
    parallel_mode: ParallelMode,
    *,
    accelerator: bool | None = None,
) -> bool:
    """``passes.chunked_loss.chunk_loss_heads`` on the traced graph, per the ``chunked_loss``
    option of ``spmd.compile`` (in place); whether a head was rewritten. ``accelerator``: the
    device the step is lowered for, when it is not where it was traced (None: the head weight's
    device decides; ``spmd.plan``/``spmd.simulate`` pass their profile's).

    Not in :func:`build_pipeline`'s list, which runs on the partitioned graph: it runs before the
    partitioner, so the partitioner sees the head's weight read by a backward node (fully_shard
    gathers it for backward), keeps the gradient tags on what reads grad_W, and the casts of
    mixed precision are what the node reads. DataParallel modes only: DTensorExpandMode would
    need a sharding rule for the custom op."""
    if option is False or not isinstance(parallel_mode, DataParallel):
        return False
    kwargs: dict[str, int] = {}
    if option is not True and option != "auto":
        kwargs["chunk_tokens"] = int(option)
    if option != "auto":
        kwargs["min_logits_bytes"] = 0  # forced on: whatever the size
    before = len(gm.graph.nodes)
    chunk_loss_heads(gm, **kwargs, accelerator=accelerator)
    return len(gm.graph.nodes) != before


def all_gloo(gm: fx.GraphModule) -> bool:
    """Whether the graph has collectives and every one runs on a gloo process group (and
    ``SPMD_GLOO_ALL_TO_ALL=0`` does not switch gloo's rewrites off)."""
    if os.environ.get("SPMD_GLOO_ALL_TO_ALL", "1") == "0":
        return False
    names = {C.group_of(c) for c in C.collectives(gm.graph)}
    if not names or not dist.is_initialized():
        return False
    try:
        groups = [_resolve_process_group(n) for n in names]  # type: ignore[arg-type]
        return all(str(dist.get_backend(g)) == "gloo" for g in groups)
    except (RuntimeError, ValueError, KeyError):
        return False


def gloo_concurrent(gm: fx.GraphModule) -> bool:
    """Whether a collective of ``gm`` runs on a gloo process group with more than one worker
    thread (``torch.distributed.init_process_group("gloo")`` makes two), where two collectives
    in flight run at once -- and on torch 2.13's gloo, two at once can corrupt the heap: a
    rank aborts with "malloc(): unaligned tcache chunk detected" or computes on in silence
    (reproduced without spmd: ``benchmarks/diagnostics/gloo_concurrent_collectives.py``;
    docs/troubleshooting.md).
    spmd then keeps one collective in flight at a time. A group made under
    ``spmd.gloo_threads(1)`` runs its collectives one after another itself and keeps the
    overlap between collectives; so do the groups spmd makes for its own meshes where the
    default group has several threads (``spmd.parallel.gloo_group``): this applies to a mesh
    the user passes in."""
    if not dist.is_initialized():
        return False
    for name in {C.group_of(c) for c in C.collectives(gm.graph)}:
        try:
            group = _resolve_process_group(name)  # type: ignore[arg-type]
            if str(dist.get_backend(group)) != "gloo":
                continue
            threads = torch_compat.gloo_threads(group)
        except (RuntimeError, ValueError, KeyError, AttributeError):
            continue
        if threads > 1:
            _warn_serial_once(name, threads)
            return True
    return False


_WARNED: set[str] = set()


def _warn_serial_once(group: str, threads: int) -> None:
    if group in _WARNED:
        return
    _WARNED.add(group)
    log.warning(
        "spmd: process group %r is gloo with %d worker threads: two collectives in flight would run at "
        "once, and torch's gloo can corrupt the heap then (a rank aborts with 'malloc(): unaligned tcache "
        "chunk detected'; docs/troubleshooting.md). spmd keeps one collective in flight at a time on it. "
        "It is the group of a mesh given to the parallel mode (spmd's own meshes get one-thread groups): "
        'make that mesh\'s groups under `with spmd.gloo_threads(1):` (or `init_process_group("gloo", ...)` '
        "under it), or pass no mesh, to keep collectives overlapped with each other safely.",
        group,
        threads,
    )
