"""Parameters into the compute: all-gathers of shards, backward re-gathers, replicated copies.

Under fully_shard / hybrid_shard every parameter placeholder holds this rank's dim-0 shard.
An all-gather (of the shard padded to equal size) restores the full parameter just before its
first forward use, once per micro-batch; with ``reshard_after_forward`` backward gathers it
again (and recomputes the cheap parameter-only ops forward derived from it, such as a
transpose, so nothing gathered in forward lives into backward; the parameter placeholder is
marked ``passes.meta.RESHARD`` and ``passes.invariants.check_reshard`` holds the partitioner to
it). Ops that activation checkpointing recomputes in backward are backward ops (the tracer
labels them so) and read the backward gather. With mixed precision the
tracer's compute cast moves before the gather: each rank casts its fp32 shard and the gather
sends ``param_dtype``. A channels_last shard is gathered in memory order
(:mod:`spmd.parallel.layout`); an offloaded one is copied host-to-device first
(:mod:`spmd.parallel.offload`).

Replicated parameters are not gathered: their compute casts move to their first reader, and
an offloaded replicated (0-d) parameter is copied to the device once.

Each gather sits just before its first reader; prefetching them earlier is
:mod:`passes.prefetch`'s job, later in the pipeline.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import collectives as C
from passes.graph_utils import mutated_nodes, storage_of
from passes.meta import CAST_OF, MICROBATCH, MODULE, PHASE, RESHARD, Phase, Role, copy_meta
from passes.torch_compat import OpOverload
from spmd.errors import ConfigError
from spmd.parallel import layout
from spmd.parallel.partition_state import PartitionState

aten = torch.ops.aten


def refuse_compute_writes(ps: PartitionState) -> None:
    """Raise if forward or backward writes to a sharded parameter in place.

    ``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in its weight during
    forward. Every rank computes on a gathered copy of a sharded parameter, so such a write
    would be lost (the shard keeps the old rows) and the model would silently drift from DDP's;
    a replicated parameter is the real tensor, and the write stays. Found by the foreign-model
    sweep (tests/dist/test_sweep.py).
    """
    # By storage: the write may go through a view (F.embedding renormalises weight.detach()).
    sharded = {st: name for name in ps.layouts if (st := storage_of(ps.by_name[name])) is not None}
    for n in ps.graph.nodes:
        if n.meta.get(PHASE) is Phase.OPTIMIZER:
            continue
        for m in mutated_nodes(n):
            name = sharded.get(storage_of(m))  # type: ignore[arg-type]
            if name is None:
                continue
            module = n.meta.get(MODULE) or name.rsplit(".", 1)[0]
            raise ConfigError(
                f"spmd: {n.target} in module {module!r} writes to parameter {name!r} in place during "
                f"{n.meta.get(PHASE, Phase.FORWARD).name.lower()} (nn.Embedding(max_norm=...) does). "
                f"Under {ps.dp.parallel_style} each rank computes on a gathered copy, so the write would "
                f"be lost. Fix: keep that module replicated, DataParallel({ps.dp.parallel_style!r}, "
                f"module_styles={{{module!r}: 'replicate'}}), or move the write out of the step."
            )


def emit_gather(
    ps: PartitionState, p: fx.Node, name: str, like: fx.Node, dtype: torch.dtype | None = None
) -> fx.Node:
    """shard -> (cast to ``dtype``) -> (pad) -> all_gather (shard group) -> wait -> (slice):
    the full parameter."""
    lay, group = ps.layouts[name], ps.comms[name].shard
    assert group is not None
    x = p
    if dtype is not None:  # mixed precision: cast the shard, gather in the compute dtype
        x = ps.to_dtype(x, dtype, like)
        x.meta[CAST_OF] = name
    if name in ps.offloaded:  # the shard lives on the CPU: host-to-device next
        x = ps.to_device(x, ps.offloaded[name], like)
    perm = ps.perms.get(name)
    if perm is not None:  # gather in memory order (a view of a channels_last shard)
        x = ps.call(aten.permute.default, (x, perm), like)
    if lay.padded:
        pad_rows = lay.chunk - lay.local_rows
        ndim = len(ps.params[name].shape)
        x = ps.call(aten.constant_pad_nd.default, (x, [0, 0] * (ndim - 1) + [0, pad_rows]), like)
    coll = ps.call(C._c10d.all_gather_into_tensor.default, (x, group.size, group.name), like)
    full = ps.call(C.WAIT, (coll,), like)
    if lay.padded:
        full = ps.call(aten.slice.Tensor, (full, 0, 0, lay.rows), like, role=Role.ACTIVATION)
    if perm is not None:  # back to logical order: the parameter's own strides
        full = ps.call(aten.permute.default, (full, layout.inverse(perm)), like, role=Role.ACTIVATION)
    return full


def gather_param(ps: PartitionState, name: str) -> None:
    """Gather the parameter for each micro-batch's forward and backward readers.

    The shard's direct readers get the fp32 parameter; with mixed precision, the readers
    of the tracer's compute cast get the parameter gathered in the cast's dtype (the cast
    goes away). A step that accumulates gradients over k micro-batches gathers per
    micro-batch, as FSDP does, so no more than one micro-batch's gathered parameters
    live at once.
    """
    p = ps.by_name[name]
    p.meta[RESHARD] = bool(ps.dp.reshard_after_forward)
    cast = ps.casts.get(name)
    sources: list[tuple[fx.Node, torch.dtype | None]] = [(p, None)]
    if cast is not None:
        sources.append((cast, cast.meta["val"].dtype))
    for src, dtype in sources:
        by_micro: dict[int, list[fx.Node]] = {}
        for u in src.users:
            if u.meta.get(PHASE) is not Phase.OPTIMIZER and u is not cast:
                by_micro.setdefault(u.meta.get(MICROBATCH, 0), []).append(u)
        for micro in sorted(by_micro):
            _gather_for(ps, p, src, name, dtype, by_micro[micro])
    if cast is not None and not cast.users:
        ps.graph.erase_node(cast)


def _gather_for(
    ps: PartitionState, p: fx.Node, src: fx.Node, name: str, dtype: torch.dtype | None, users: list[fx.Node]
) -> None:
    """Point ``users`` (readers of ``src``) at a gather of shard ``p`` (cast to ``dtype``)."""
    fwd = [u for u in users if u.meta.get(PHASE) is Phase.FORWARD]
    bwd = [u for u in users if u.meta.get(PHASE) is Phase.BACKWARD]
    reshard = ps.dp.reshard_after_forward and fwd
    first_fwd_users = fwd if reshard else users
    with ps.graph.inserting_before(ps.first(first_fwd_users)):
        full = emit_gather(ps, p, name, ps.first(first_fwd_users), dtype)
    for u in first_fwd_users:
        u.replace_input_with(src, full)
    if not reshard:
        return
    # Backward needs the parameter again: gather it a second time and recompute the
    # parameter-only forward ops (views, casts) that backward reads, from the new copy.
    derived = _derived_only_from(full)
    is_bwd = lambda u: u.meta.get(PHASE) is Phase.BACKWARD  # noqa: E731
    # The derived nodes backward reads, plus the derived nodes those are computed from.
    needed = {d for d in derived if any(is_bwd(u) for u in d.users)}
    for d in reversed(derived):
        if d in needed:
            needed.update(i for i in d.all_input_nodes if i in derived)
    anchors = bwd + [u for d in needed for u in d.users if is_bwd(u)]
    if not anchors:
        return
    first_bwd = ps.first(anchors)
    remap: dict[fx.Node, fx.Node] = {}
    with ps.graph.inserting_before(first_bwd):
        remap[full] = emit_gather(ps, p, name, first_bwd, dtype)
        for d in derived:  # `derived` is in graph order
            if d in needed:
                remap[d] = ps.graph.node_copy(d, lambda n: remap.get(n, n))
                copy_meta(remap[d], first_bwd, role=Role.ACTIVATION)
    for u in bwd:
        u.replace_input_with(src, remap[full])
    for d in needed:
        for u in list(d.users):
            if is_bwd(u) and u is not remap.get(u):
                u.replace_input_with(d, remap[d])


def place_replicated_casts(ps: PartitionState) -> None:
    """Move the compute casts of replicated parameters to just before their first reader.

    The tracer casts every parameter up front; each copy need only live from its first use.
    """
    for name, cast in ps.casts.items():
        if name in ps.layouts or not cast.users:
            continue
        ps.first(list(cast.users)).prepend(cast)


def copy_in_replicated(ps: PartitionState, name: str) -> None:
    """An offloaded parameter that is not sharded (0-d): copy it to the device once,
    before its first forward/backward use."""
    p = ps.by_name[name]
    users = [u for u in p.users if u.meta.get(PHASE) is not Phase.OPTIMIZER]
    if not users:
        return
    first = ps.first(users)
    with ps.graph.inserting_before(first):
        on_device = ps.to_device(p, ps.offloaded[name], first)
    for u in users:
        u.replace_input_with(p, on_device)


def _derived_only_from(root: fx.Node) -> list[fx.Node]:
    """Forward nodes computed from ``root`` alone (plus constants): cheap to recompute in backward."""
    out: list[fx.Node] = []
    ok = {root}
    todo = list(root.users)
    while todo:
        n = todo.pop(0)
        if n in ok or n.op != "call_function" or n.meta.get(PHASE) is not Phase.FORWARD:
            continue
        if not all(i in ok for i in n.all_input_nodes):
            continue
        if isinstance(n.target, OpOverload) and (
            torch.Tag.nondeterministic_seeded in n.target.tags or mutated_nodes(n)
        ):
            continue
        ok.add(n)
        out.append(n)
        todo.extend(n.users)
    return out
