"""Static peak-memory estimate of one run of a graph: liveness over ``node.meta["val"]``.

The graph is walked in execution order, as the generated Python runs it (fx frees a
value right after its last use). A node that makes a fresh tensor allocates its
bytes; the allocation lives until the last use of the node or of any alias of it,
and is freed just after that use. Placeholders (model and optimizer state, the
batch) are live for the whole step; so is whatever the graph returns.

What allocates nothing:

- views and other aliases: an op whose schema says its result aliases an argument
  (``view``, ``t``, ``slice``, ``split``, in-place ``add_`` returning ``self``), or
  whose result's fake storage is the storage of one of its inputs (``_unsafe_view``);
- ``operator.getitem`` of a multi-output node (it picks one of that node's buffers);
- ``wait_tensor``: it returns its collective's buffer. (Its fake kernel makes a new
  tensor, so storage identity alone would count the buffer twice.)
- in-place ops that return nothing (``_foreach_add_``, ``_fused_adamw_``).

Collectives allocate their output (the functional ops do), and hold their inputs until their
wait: c10d's work object keeps the tensors it sends until it completes, so an input whose last
reader is the collective is freed after the wait (``MemTracker`` sees them live there: the
flat-gradient input of a reduce-scatter, the copy-in buffer of an all-gather). Temporaries inside one
kernel are not seen, as ``torch.distributed._tools.mem_tracker.MemTracker`` does not
see them either, except where a node declares them (``passes.meta.WORKSPACE``: a chunked
loss head's per-chunk buffers, made by a Python kernel): they count as live while that
node runs. Allocator caching and fragmentation are not modelled.

Why not ``torch._inductor.fx_passes.memory_estimator``: its ``build_memory_profile``
ignores CPU tensors (a fixed device filter), it tells aliasing by storage identity
only (so every ``wait_tensor`` is a fresh allocation), and it attributes nothing to
nodes. Its ``GraphAliasTracker`` is the model for the storage-identity rule here.

A pure analysis: never changes the graph. Run it on any stage whose ``meta["val"]``
is true (every stage of a compiled step is).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from passes import collectives as C
from passes import torch_compat
from passes.meta import PHASE, WORKSPACE
from passes.torch_compat import OpOverload, pytree

__all__ = [
    "Liveness",
    "MemoryEstimate",
    "PhaseMemory",
    "buffer_liveness",
    "estimate_peak_memory",
    "tensor_bytes",
]


@dataclasses.dataclass(frozen=True)
class PhaseMemory:
    """The highest live memory while the nodes of one phase run."""

    peak_bytes: int
    peak_node: str  # the node running at that moment
    allocated_bytes: int  # fresh allocations made by this phase's nodes (freed or not)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Result of :func:`estimate_peak_memory`; all numbers in bytes, for one rank."""

    peak_bytes: int
    peak_node: str  # the node whose outputs are being allocated at the peak ("" if none)
    baseline_bytes: int  # the placeholders (state + batch): live for the whole step
    by_phase: dict[str, PhaseMemory]  # phase value ("forward", ...) -> its peak
    profile: list[tuple[str, int]]  # (node, live bytes while it runs), in execution order

    @property
    def transient_bytes(self) -> int:
        """What the step needs above its inputs at the peak."""
        return self.peak_bytes - self.baseline_bytes


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (its whole storage: a view of a big tensor counts it all)."""
    try:
        return int(t.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):  # storage-less tensors
        return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> StorageWeakRef | None:
    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def _tensors(val: Any) -> list[torch.Tensor | None]:
    """The tensor leaves of a ``meta["val"]``, in order (None for non-tensor leaves)."""
    return [x if isinstance(x, torch.Tensor) else None for x in pytree.tree_leaves(val)]


def _schema_aliased_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes the op's schema says its result aliases (``view``, ``add_``, ``split``)."""
    target = node.target
    if not isinstance(target, OpOverload):
        return []
    schema = torch_compat.op_schema(target)
    ret_infos = [r.alias_info for r in schema.returns if r.alias_info is not None]
    if not ret_infos:
        return []
    ret_sets = {s for info in ret_infos for s in info.before_set | info.after_set}
    out: list[fx.Node] = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None:
            continue
        # A list return (``Tensor(a)[]``) carries its alias set on the element type: empty here.
        if ret_sets and not (a.alias_info.before_set & ret_sets):
            continue
        val = node.kwargs.get(a.name) if a.kwarg_only or i >= len(node.args) else node.args[i]
        out.extend(n for n in pytree.tree_leaves(val) if isinstance(n, fx.Node))
    return out


def _alias_sources(node: fx.Node, n_leaves: int, bufs_of: dict[fx.Node, list[int | None]]) -> list[int]:
    """The buffers ``node``'s result aliases by rule (wait, getitem, schema); [] for none."""
    if node.op != "call_function":
        return []
    if C.is_wait(node) or node.target is operator.getitem:
        src = node.args[0]
        src_bufs = [b for b in bufs_of.get(src, [])] if isinstance(src, fx.Node) else []
        idx = node.args[1] if node.target is operator.getitem else None
        if isinstance(idx, int) and idx < len(src_bufs) and n_leaves == 1:
            src_bufs = [src_bufs[idx]]
        return [b for b in src_bufs if b is not None]
    return [b for a in _schema_aliased_args(node) for b in bufs_of.get(a, []) if b is not None]


@dataclasses.dataclass
class Liveness:
    """The buffers of one run of a graph (see the module docstring for the rules).

    A buffer is one allocation; ``bufs_of[node]`` names the buffer behind each tensor
    leaf of the node's value (views share their base's), ``fresh_of[node]`` the buffers
    the node allocates, ``last_use[b]`` the index in ``nodes`` of the last node that
    reads ``b`` through any alias (it is freed just after). ``pinned`` buffers
    (placeholders, what the graph returns) live for the whole step."""

    nodes: list[fx.Node]  # every node but the output, in execution order
    size: list[int]  # buffer -> bytes
    pinned: set[int]
    bufs_of: dict[fx.Node, list[int | None]]
    fresh_of: dict[fx.Node, list[int]]
    last_use: dict[int, int]


def buffer_liveness(gm: fx.GraphModule, *, hold_collective_inputs: bool = True) -> Liveness:
    """Which buffer each node's value lives in, and when each buffer dies.

    ``hold_collective_inputs``: a collective's inputs live until its wait (the memory the
    process holds). ``False`` gives the graph's own drop schedule instead -- when the runtime
    drops its last reference, whatever the process group keeps -- which the collective-buffer
    invariant (``passes.invariants.check_collective_buffers``) judges against ``INPUT_HELD``."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    size: list[int] = []  # buffer id -> bytes
    pinned: set[int] = set()  # buffers never freed within the step
    bufs_of: dict[fx.Node, list[int | None]] = {}  # node -> a buffer per tensor leaf of its val
    fresh_of: dict[fx.Node, list[int]] = {}  # node -> the buffers it allocates
    by_storage: dict[StorageWeakRef, int] = {}  # fake storage -> buffer

    for node in nodes:
        leaves = _tensors(node.meta.get("val"))
        aliased = _alias_sources(node, len(leaves), bufs_of)
        input_bufs = {b for i in node.all_input_nodes for b in bufs_of.get(i, []) if b is not None}
        out: list[int | None] = []
        fresh: list[int] = []
        for k, t in enumerate(leaves):
            if t is None:
                out.append(None)
                continue
            st = _storage(t)
            known = by_storage.get(st) if st is not None else None
            if aliased:
                b = aliased[k] if len(aliased) == len(leaves) else aliased[0]
            elif known is not None and (known in input_bufs or known in fresh):
                b = known  # a view the schema does not declare, or two results on one storage
            else:
                size.append(tensor_bytes(t))
                b = len(size) - 1
                fresh.append(b)
                if node.op in ("placeholder", "get_attr"):
                    pinned.add(b)
            if st is not None:
                by_storage.setdefault(st, b)
            out.append(b)
        bufs_of[node] = out
        fresh_of[node] = fresh

    # A buffer is freed after the last node that reads it through any alias (fx's generated
    # code drops each value after its last use; a multi-output value lives until its last getitem).
    # A collective in flight holds its inputs until its wait: c10d's work object keeps the
    # tensors it sends (gloo reads them on its own thread; NCCL stashes them for the allocator's
    # safety) and the functional collective keeps the work until ``wait_tensor``. So an input
    # whose last reader is the collective is freed after the wait, not after the issue. A
    # shared-memory collective (passes.shm_ops) has read its inputs when it returns: not held.
    position = {n: at for at, n in enumerate(nodes)}
    held_until: dict[fx.Node, int] = {}
    for node in nodes if hold_collective_inputs else ():
        if C.is_collective(node) and not C.is_shared_memory(node):
            waits = [position[w] for w in C.waits_of(node) if w in position]
            if waits:
                held_until[node] = max(waits)
    last_use: dict[int, int] = {}
    for at, node in enumerate(nodes):
        for b in fresh_of[node]:
            last_use[b] = at
        end = held_until.get(node, at)
        for i in node.all_input_nodes:
            last_use.update((b, max(end, last_use.get(b, at))) for b in bufs_of[i] if b is not None)
    if output is not None:
        pinned.update(b for i in output.all_input_nodes for b in bufs_of[i] if b is not None)
    return Liveness(nodes, size, pinned, bufs_of, fresh_of, last_use)


def estimate_peak_memory(gm: fx.GraphModule) -> MemoryEstimate:
    """Peak live bytes of one run of ``gm`` (see the module docstring for the rules)."""
    lv = buffer_liveness(gm)
    nodes, size, fresh_of = lv.nodes, lv.size, lv.fresh_of
    frees_at: dict[int, int] = {}
    for b, at in lv.last_use.items():
        if b not in lv.pinned:
            frees_at[at] = frees_at.get(at, 0) + size[b]

    baseline = sum(size[b] for n in nodes if n.op in ("placeholder", "get_attr") for b in fresh_of[n])
    live = peak = baseline
    peak_node = ""
    phases: dict[str, list[Any]] = {}  # phase -> [peak, node, allocated]
    profile: list[tuple[str, int]] = []
    for at, node in enumerate(nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        alloc = sum(size[b] for b in fresh_of[node])
        live += alloc
        running = live + int(node.meta.get(WORKSPACE, 0))  # the kernel's declared temporaries
        profile.append((node.name, running))
        if running > peak:
            peak, peak_node = running, node.name
        phase = node.meta.get(PHASE)
        if phase is not None:
            rec = phases.setdefault(getattr(phase, "value", str(phase)), [running, node.name, 0])
            if running > rec[0]:
                rec[0], rec[1] = running, node.name
            rec[2] += alloc
        live -= frees_at.get(at, 0)
    return MemoryEstimate(
        peak_bytes=peak,
        peak_node=peak_node,
        baseline_bytes=baseline,
        by_phase={
            k: PhaseMemory(peak_bytes=p, peak_node=n, allocated_bytes=a) for k, (p, n, a) in phases.items()
        },
        profile=profile,
    )
