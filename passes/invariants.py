"""The graph invariants every pass keeps, checked; and the collective fingerprint.

``check_invariants(gm)`` raises :class:`InvariantViolation` listing every broken
rule with the node it found it on. The rules (``passes/README.md`` says why each
matters):

- ``one-wait-per-output``: a collective has exactly one ``wait_tensor`` per output
  (coalesced: each output taken by exactly one ``getitem``, waited once).
- ``only-wait-reads``: nothing but its wait (and, coalesced, its ``getitem``\\ s)
  reads a collective's result; everything else reads the wait.
- ``wait-after-collective``: a wait waits on a collective that comes before it.
- ``val``: every placeholder and call_function node has ``node.meta["val"]``
  (ops that return nothing, such as ``_foreach_add_``, are exempt); for
  collectives and waits the value agrees with the op (an all-gather's output is
  ``group_size`` times its input on dim 0, a wait returns what it waits on).
- ``role-phase``: those nodes carry ``passes.meta`` ROLE, PHASE and MICROBATCH with a
  :class:`~passes.meta.Role`, a :class:`~passes.meta.Phase` and an int >= 0.
- ``lint``: ``graph.lint()`` passes.
- ``flat-buffer``: a unit's ``all_gather_copy_in`` packs shards no larger than their chunks into
  ``sum(chunks)`` elements; its ``all_gather_copy_out`` reads ``world`` such blocks.
- ``carried``: the gathers :func:`passes.cross_step.carry_first_gathers` carries to the next
  call are well formed (see :func:`passes.cross_step.check_carried`); a carried output is the one
  collective without a wait in its graph, a carried placeholder the one wait source that is not
  a collective.
- ``optimizer-split``: the calls :func:`passes.optimizer_overlap.overlap_optimizer` split from one
  fused optimizer call update every parameter exactly once, with the same per-parameter and
  shared arguments as before, each after all of its inputs; the ``_foreach_*`` calls split from
  one foreach op (:mod:`passes.update_schedule`) compute each of its list elements exactly once,
  with the same per-element and shared arguments.
- ``reused-buffer``: an op :func:`passes.reuse.reuse_dead_buffers` made write into an input
  (``out=``) writes into one fresh buffer of its own shape, dtype and layout that nothing
  reads after it (see :func:`passes.reuse.check_reuse`).
- ``reshard``: where a parameter is resharded after forward (its placeholder carries
  ``passes.meta.RESHARD``), no backward op reads what a forward all-gather of it gathered
  (the wait, or a view, unpacking or copy of it made in forward: ``PASS_THROUGH_OPS``);
  backward reads its own gather (see :func:`check_reshard`).
- ``collective-buffer``: no buffer an issued collective reads or writes (its inputs, its
  outputs, through any alias) is written in place -- by an in-place op, another in-place
  collective (``all_reduce_``) or an ``out=`` op of :func:`passes.reuse.reuse_dead_buffers` --
  or freed between the collective and its (last) wait; a carried collective
  (:mod:`passes.cross_step`) is in flight to the end of the graph. Freed: the eager runtime
  drops the graph's last reference to a value after its last use
  (:func:`passes.memory.buffer_liveness`), which frees the buffer unless the process group
  holds it until the wait or copied it at the issue (:data:`INPUT_HELD`). The process
  group's background thread reads and writes these buffers while the step runs on: a
  write races it (wrong values), a freed buffer is a use-after-free (heap corruption).
  See :func:`check_collective_buffers`.

``fingerprint(gm)`` is the sequence of collectives as every rank will issue them;
ranks compare theirs to catch a divergent graph before it hangs in a collective.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from passes import collectives as C
from passes import shm_ops, torch_compat
from passes.cross_step import CARRIED, check_carried
from passes.flat_ops import COPY_IN, COPY_OUT
from passes.graph_utils import PASS_THROUGH_OPS, mutated_nodes
from passes.memory import buffer_liveness
from passes.meta import MICROBATCH, PHASE, RESHARD, ROLE, Phase, Role, module_of
from passes.optimizer_overlap import check_optimizer_split
from passes.reuse import REUSED, check_reuse
from passes.torch_compat import OpOverload

# How many violations one error message lists before it summarises the rest.
_MAX_LISTED = 20


@dataclasses.dataclass(frozen=True)
class Violation:
    rule: str
    node: str  # node name ("" for the whole graph)
    message: str


class InvariantViolation(AssertionError):
    """A graph breaks one or more of the invariants in ``passes/README.md``."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        lines = [f"[{v.rule}] {v.message}" for v in violations[:_MAX_LISTED]]
        if len(violations) > _MAX_LISTED:
            lines.append(f"... and {len(violations) - _MAX_LISTED} more")
        super().__init__(f"{len(violations)} graph invariant violation(s):\n  " + "\n  ".join(lines))

    @property
    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}


def describe(node: fx.Node) -> str:
    """One line for error messages: what the node is, its shape and module path."""
    where = f"module {module_of(node)!r}" if module_of(node) else "root module"
    if C.is_collective(node):
        ins = ", ".join(_shape_str(i) for i in C.inputs_of(node))
        extra = f" {C.reduce_op_of(node)}" if C.reduce_op_of(node) else ""
        kind = C.kind_of(node).value + (" coalesced" if C.is_coalesced(node) else "")
        return f"{kind}{extra} of [{ins}] on group {C.group_of(node)!r}, {where} ({node.name})"
    if node.op == "call_function":
        what = getattr(node.target, "__name__", str(node.target))
        if isinstance(node.target, OpOverload):
            what = str(node.target)
        return f"{what} -> {_shape_str(node)}, {where} ({node.name})"
    return f"{node.op} {_shape_str(node)}, {where} ({node.name})"


def _shape_str(node: object) -> str:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"
    if isinstance(val, list | tuple):
        return "(" + ", ".join(f"{list(v.shape)}" for v in val if isinstance(v, torch.Tensor)) + ")"
    return "?"


# ----------------------------------------------------------------------------- the checker


def check_invariants(gm: fx.GraphModule) -> None:
    """Raise :class:`InvariantViolation` if ``gm`` breaks any graph invariant."""
    found: list[Violation] = []
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises RuntimeError/AssertionError with its own text
        found.append(Violation("lint", "", f"graph.lint() failed: {exc}"))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        found.extend(_check_meta(node))
        if C.is_collective(node):
            if CARRIED not in node.meta:  # waited by the next call: check_carried below
                found.extend(_check_collective(node, order))
            else:
                found.extend(_check_collective_val(node))
        elif C.is_wait(node):
            src = node.args[0]
            if not (isinstance(src, fx.Node) and src.op == "placeholder" and CARRIED in src.meta):
                found.extend(_check_wait(node, order))
        elif node.op == "call_function" and node.target in (COPY_IN, COPY_OUT):
            found.extend(_check_flat(node))
    found.extend(Violation("carried", name, msg) for name, msg in check_carried(gm))
    found.extend(Violation("optimizer-split", name, msg) for name, msg in check_optimizer_split(gm))
    found.extend(Violation("reused-buffer", name, msg) for name, msg in check_reuse(gm))
    found.extend(Violation("reshard", name, msg) for name, msg in check_reshard(gm))
    found.extend(Violation("collective-buffer", name, msg) for name, msg in check_collective_buffers(gm))
    if found:
        raise InvariantViolation(found)


# Collectives whose input buffer stays alive until the wait although the graph drops its last
# reference at the issue: the process group's work object holds the input (``all_reduce_``,
# the all-gathers, ``all_to_all_single``), or the op copied it when issued (the functional
# ``all_reduce``, ``reduce_scatter_tensor``, ``broadcast`` send a clone). Measured on gloo,
# torch 2.13.0 (``benchmarks/diagnostics/collective_refs.py``: the input's reference count after the issue,
# and a correct result after the input is dropped and the heap churned while the peer joins
# late); ``tests/dist/test_collective_refs.py`` keeps it true on the installed torch.
INPUT_HELD = frozenset(
    {
        C._c10d.all_reduce.default,
        C._c10d.all_reduce_.default,
        C._c10d.all_reduce_coalesced.default,
        C._c10d.all_reduce_coalesced_.default,
        C._c10d.all_gather_into_tensor.default,
        C._c10d.all_gather_into_tensor_coalesced.default,
        C._c10d.reduce_scatter_tensor.default,
        C._c10d.reduce_scatter_tensor_coalesced.default,
        C._c10d.broadcast.default,
        C._c10d.all_to_all_single.default,
        # Shared memory (passes.shm_ops): the op has read its input before it returns.
        *shm_ops.SHM_OPS,
    }
)


def check_collective_buffers(
    gm: fx.GraphModule, *, input_held: frozenset[object] = INPUT_HELD
) -> list[tuple[str, str]]:
    """(node, message) for every buffer of an issued collective written or freed before its wait.

    A collective is in flight from its node to its last wait (to the end of the graph for a
    carried one). Its buffers are those of its inputs and of its result (an in-place
    ``all_reduce_``'s result is its input's), with every alias (views, ``out=`` results).
    Inside that window no node may write one of them in place (``mutated_nodes``: in-place
    ops, in-place collectives, ``out=`` ops), and the graph may drop its last reference to an
    input's buffer only where the process group holds or copied it (``input_held``, the
    collective ops measured so; :data:`INPUT_HELD`). Placeholders and returned values are
    never freed by the runtime."""
    colls = C.collectives(gm.graph)
    if not colls:
        return []
    lv = buffer_liveness(gm, hold_collective_inputs=False)  # the runtime's drops, not the memory held
    index = {n: i for i, n in enumerate(lv.nodes)}
    writers: list[tuple[int, fx.Node, fx.Node, set[int]]] = []  # (at, writer, written arg, buffers)
    for n in lv.nodes:
        for arg in mutated_nodes(n):
            bufs = {b for b in lv.bufs_of.get(arg, []) if b is not None}
            if bufs:
                writers.append((index[n], n, arg, bufs))
    # ``writers`` is in graph order: each collective looks only at the writers inside its window
    # (a bisection), not at every writer of the graph.
    writer_at = [w[0] for w in writers]
    found: list[tuple[str, str]] = []
    for coll in colls:
        waits = C.waits_of(coll)
        if CARRIED in coll.meta:
            stop, until = len(lv.nodes), "the end of the step (it is waited by the next call)"
        elif waits:
            last = max(waits, key=index.__getitem__)
            stop, until = index[last], f"its wait {last.name}"
        else:
            continue  # one-wait-per-output reports it
        start = index[coll]
        ins = {b for x in C.inputs_of(coll) for b in lv.bufs_of.get(x, []) if b is not None}
        flight = ins | {b for b in lv.bufs_of.get(coll, []) if b is not None}
        lo, hi = bisect.bisect_right(writer_at, start), bisect.bisect_left(writer_at, stop)
        for _, writer, arg, bufs in writers[lo:hi]:
            if not bufs & flight:
                continue
            if REUSED in writer.meta:
                how = f"reuse_dead_buffers made {writer.name} write its result into {arg.name}"
            elif C.is_collective(writer):
                how = f"the in-place collective {describe(writer)} writes {arg.name}"
            else:
                how = f"{describe(writer)} writes {arg.name} in place"
            found.append(
                (
                    writer.name,
                    f"{how}, a buffer that {describe(coll)} still reads or writes until {until}: "
                    "the process group's thread races the write (move the write after the wait, "
                    "or give it another buffer)",
                )
            )
        if coll.target in input_held:
            continue
        for x in C.inputs_of(coll):
            for b in lv.bufs_of.get(x, []):
                if b is None or b in lv.pinned or lv.last_use.get(b, stop) >= stop:
                    continue
                dropped = lv.nodes[lv.last_use[b]]
                found.append(
                    (
                        coll.name,
                        f"the eager runtime frees {x.name} after {dropped.name}, but {describe(coll)} "
                        f"still reads it until {until} and the process group does not hold it "
                        "(not in passes.invariants.INPUT_HELD): keep a reader of it after the wait",
                    )
                )
    return found


def _check_flat(node: fx.Node) -> list[Violation]:
    """A unit's flat buffer agrees with its pieces: copy-in writes ``sum(chunks)`` elements and
    no shard is larger than its chunk; copy-out reads ``world`` blocks of ``sum(chunks)`` and no
    output needs more than ``world`` chunks."""
    out = []
    val = node.meta.get("val")
    if node.target is COPY_IN:
        shards, chunks = node.args[0], node.args[1]
        sizes = [s.meta["val"].numel() for s in shards]  # type: ignore[union-attr]
        bad = isinstance(val, torch.Tensor) and val.numel() != sum(chunks)  # type: ignore[arg-type]
        if bad or len(sizes) != len(chunks) or any(n > c for n, c in zip(sizes, chunks)):  # type: ignore[arg-type]
            out.append(
                Violation("flat-buffer", node.name, f"{describe(node)}: shards {sizes} vs chunks {chunks}")
            )
    else:
        src, world, chunks = node.args[0], node.args[1], node.args[2]
        gathered = src.meta["val"].numel()  # type: ignore[union-attr]
        outs = [v.numel() for v in val] if isinstance(val, list | tuple) else []
        if gathered != world * sum(chunks) or any(n > world * c for n, c in zip(outs, chunks)):  # type: ignore[operator,arg-type]
            out.append(
                Violation(
                    "flat-buffer", node.name, f"{describe(node)}: {gathered} gathered, {world} x {chunks}"
                )
            )
    return out


def _returns_nothing(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, OpOverload) and len(torch_compat.op_schema(target).returns) == 0


def _check_meta(node: fx.Node) -> list[Violation]:
    if node.op not in ("placeholder", "call_function"):
        return []
    out = []
    if "val" not in node.meta and not _returns_nothing(node):
        out.append(Violation("val", node.name, f"{describe(node)} has no meta['val']"))
    role, phase = node.meta.get(ROLE), node.meta.get(PHASE)
    if not isinstance(role, Role):
        out.append(
            Violation("role-phase", node.name, f"{describe(node)} has ROLE {role!r}, not a passes.meta.Role")
        )
    if not isinstance(phase, Phase):
        out.append(
            Violation(
                "role-phase", node.name, f"{describe(node)} has PHASE {phase!r}, not a passes.meta.Phase"
            )
        )
    micro = node.meta.get(MICROBATCH)
    if not isinstance(micro, int) or micro < 0:
        out.append(
            Violation("role-phase", node.name, f"{describe(node)} has MICROBATCH {micro!r}, not an int >= 0")
        )
    return out


def _n_outputs(coll: fx.Node) -> int:
    return len(C.inputs_of(coll)) if C.is_coalesced(coll) else 1


def _check_collective(coll: fx.Node, order: dict[fx.Node, int]) -> list[Violation]:
    out: list[Violation] = []

    def bad(rule: str, msg: str, node: fx.Node = coll) -> None:
        out.append(Violation(rule, node.name, f"{describe(coll)}: {msg}"))

    if not C.is_coalesced(coll):
        waits = [u for u in coll.users if C.is_wait(u)]
        others = [u for u in coll.users if not C.is_wait(u)]
        if len(waits) != 1:
            bad("one-wait-per-output", f"has {len(waits)} waits, expected 1")
        for u in others:
            bad("only-wait-reads", f"result read by {u.name} ({u.target}) instead of through its wait", u)
    else:
        by_index: dict[int, list[fx.Node]] = {}
        for u in coll.users:
            if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
                by_index.setdefault(u.args[1], []).append(u)
            else:
                bad("only-wait-reads", f"result read by {u.name} ({u.target}), not by a getitem", u)
        for i in range(_n_outputs(coll)):
            items = by_index.get(i, [])
            if len(items) != 1:
                bad("one-wait-per-output", f"output {i} is taken by {len(items)} getitems, expected 1")
                continue
            item = items[0]
            waits = [u for u in item.users if C.is_wait(u)]
            if len(waits) != 1:
                bad("one-wait-per-output", f"output {i} ({item.name}) has {len(waits)} waits, expected 1")
            for u in item.users:
                if not C.is_wait(u):
                    bad("only-wait-reads", f"output {i} read by {u.name} ({u.target}) instead of its wait", u)
    out.extend(_check_collective_val(coll))
    return out


def _check_wait(wait: fx.Node, order: dict[fx.Node, int]) -> list[Violation]:
    src = wait.args[0]
    coll = src.args[0] if isinstance(src, fx.Node) and src.target is operator.getitem else src
    if not (isinstance(src, fx.Node) and isinstance(coll, fx.Node) and C.is_collective(coll)):
        return [
            Violation(
                "wait-after-collective", wait.name, f"{describe(wait)} waits on {src}, not a collective"
            )
        ]
    out = []
    if order[coll] >= order[wait] or order[src] >= order[wait]:
        out.append(
            Violation("wait-after-collective", wait.name, f"{describe(wait)} comes before {describe(coll)}")
        )
    wv, sv = wait.meta.get("val"), src.meta.get("val")
    if isinstance(wv, torch.Tensor) and isinstance(sv, torch.Tensor) and not _same_type(wv, sv):
        out.append(
            Violation(
                "val",
                wait.name,
                f"{describe(wait)} returns {_shape_str(wait)} but waits on {_shape_str(src)}",
            )
        )
    return out


def _same_type(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _expected_shape(coll: fx.Node, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    kind, w = C.kind_of(coll), C.group_size_of(coll)
    if kind in (C.Kind.ALL_REDUCE, C.Kind.BROADCAST, C.Kind.ALL_TO_ALL):
        return shape
    if not shape or w is None:
        return None
    if kind is C.Kind.ALL_GATHER:
        return (shape[0] * w, *shape[1:])
    return (shape[0] // w, *shape[1:])  # reduce-scatter


def _check_collective_val(coll: fx.Node) -> list[Violation]:
    val = coll.meta.get("val")
    outs = list(val) if isinstance(val, list | tuple) else [val]
    ins = [i.meta.get("val") if isinstance(i, fx.Node) else None for i in C.inputs_of(coll)]
    if len(outs) != len(ins):
        return [
            Violation("val", coll.name, f"{describe(coll)}: {len(outs)} output values for {len(ins)} inputs")
        ]
    out = []
    for i, (o, x) in enumerate(zip(outs, ins)):
        if not (isinstance(o, torch.Tensor) and isinstance(x, torch.Tensor)):
            continue
        want = _expected_shape(coll, tuple(x.shape))
        if (want is not None and tuple(o.shape) != want) or o.dtype != x.dtype:
            out.append(
                Violation(
                    "val",
                    coll.name,
                    f"{describe(coll)}: output {i} is {str(o.dtype)}{list(o.shape)}, expected "
                    f"{str(x.dtype)}{list(want) if want is not None else '?'}",
                )
            )
    return out


# ----------------------------------------------------------------------------- reshard


def check_reshard(gm: fx.GraphModule) -> list[tuple[str, str]]:
    r"""``(node name, message)`` for every backward op that reads a forward all-gather's result
    where that gather serves a parameter resharded after forward (``passes.meta.RESHARD``).

    With ``reshard_after_forward=True`` the memory model is FSDP's FULL_SHARD: a gathered
    parameter lives from its gather to its unit's last forward use, and backward gathers
    it again. A backward reader of the forward copy keeps the whole gathered buffer alive
    across forward and backward -- numerically right, invisible to any parity test, but
    the memory the user asked to save is spent. Activation checkpointing's recomputation
    in backward is the case that once did this (its ops were labelled forward).

    What forward gathered is the gather's wait and what forward derives from it by
    :data:`~passes.graph_utils.PASS_THROUGH_OPS` (un-padding slices, a bucket's
    ``copy_out`` and its ``getitem``\ s, views, transposes, casts of the gathered values).
    A gather serves a resharded parameter if its input is computed from such a placeholder and
    not from the step's data (a tensor-parallel gather of activations reads both).
    """
    resharded: set[fx.Node] = set()  # placeholders flagged, and every node computed from one
    data: set[fx.Node] = set()  # the batch's placeholders, and every node computed from one
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.meta.get(RESHARD):
                resharded.add(n)
            if n.meta.get(ROLE) is Role.INPUT:
                data.add(n)
        else:
            if any(i in resharded for i in n.all_input_nodes):
                resharded.add(n)
            if any(i in data for i in n.all_input_nodes):
                data.add(n)
    if not resharded:
        return []
    out = []
    for coll in C.collectives(gm.graph):
        if C.kind_of(coll) is not C.Kind.ALL_GATHER or coll.meta.get(PHASE) is not Phase.FORWARD:
            continue
        if not any(i in resharded for i in coll.all_input_nodes) or any(
            i in data for i in coll.all_input_nodes
        ):
            continue
        todo = list(C.waits_of(coll))
        gathered: set[fx.Node] = set()
        while todo:
            n = todo.pop()
            if n in gathered:
                continue
            gathered.add(n)
            for u in n.users:
                if u.meta.get(PHASE) is Phase.BACKWARD:
                    out.append(
                        (
                            u.name,
                            f"{describe(u)} runs in backward and reads {n.name}, gathered in forward by "
                            f"{describe(coll)}, while its parameters are resharded after forward: the "
                            "gathered copy would live from forward to backward; backward must read a "
                            "gather of its own",
                        )
                    )
                elif u.op == "call_function" and u.target in PASS_THROUGH_OPS:
                    todo.append(u)
    return out


# ----------------------------------------------------------------------------- fingerprint


def fingerprint(gm: fx.GraphModule, group_key: Callable[[str], object] | None = None) -> list[tuple]:
    """The collectives in issue order, as plain comparable tuples.

    Each entry is ``(index, kind, input shapes, input dtypes, group, reduce op, group size)``
    (``kind`` ends in ``"_coalesced"`` for coalesced ops; reduce op and group size are
    None where they do not apply). Two ranks whose fingerprints differ would hang or
    exchange mismatched buffers; gather and compare them before the first run.

    ``group`` is the group name, or ``group_key(name)``: ranks in different subgroups of one
    mesh dimension (the shard groups of a 2-D mesh) name their groups differently, so
    comparing across them needs a rank-independent key (e.g. the group's shape).
    """
    out = []
    for i, coll in enumerate(C.collectives(gm.graph)):
        vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in C.inputs_of(coll)]
        shapes = tuple(tuple(_dim(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in vals)
        dtypes = tuple(str(v.dtype) if isinstance(v, torch.Tensor) else None for v in vals)
        kind = C.kind_of(coll).value + ("_coalesced" if C.is_coalesced(coll) else "")
        group = C.group_of(coll) if group_key is None else group_key(C.group_of(coll))
        out.append((i, kind, shapes, dtypes, group, C.reduce_op_of(coll), C.group_size_of(coll)))
    return out


def _dim(size: object) -> int | str:
    # A symbolic size is compared by its expression: equal expressions on every rank are fine.
    return size if isinstance(size, int) else str(size)
