"""Write an op's result into an input that dies at that op (ATen ``out=``), as inductor reuses buffers.

The eager backend runs the graph op by op and frees each value after its last use, so
an op such as ``_log_softmax_backward_data(grad, out)`` holds its two inputs and its
fresh result at once -- three logits-sized buffers at the loss of a language model,
the peak of the whole step. Where an input of the same size, dtype and layout dies at
that op, :func:`reuse_dead_buffers` rewrites the op to its ``out=`` variant writing
into that input: one allocation fewer, and the input's buffer lives on as the result.

Why it is legal: the rewrite is limited to the ops in :data:`REUSABLE`, whose
``out=`` kernel is the functional op's kernel and computes the same bits when ``out``
is one of its inputs (each element is read before it is written, row by row:
``tests/unit/passes/test_reuse.py`` compares the bits with the functional op on random,
odd-sized and non-contiguous inputs). The buffer taken must be dead after the op:
nothing after it reads the buffer through any alias, it is no placeholder and not
returned, and it was allocated by an ATen op of the graph (not a collective, whose
output a wait hands over, nor a custom op, whose aliasing the trace may not show).
Result and buffer must have the same shape, dtype, strides and a storage of exactly
the result's bytes, contiguous, so the ``out=`` kernel never resizes or restrides it.
Nor may it belong to a collective in flight at the op (issued before it, waited after):
the graph's last reader of a collective's input can come before the wait, but the process
group still reads it (``collective-buffer`` in :mod:`passes.invariants`).
Liveness is :func:`passes.memory.buffer_liveness` (fake storages and op schemas).

Where it must run: last among the passes that move nodes (a later reorder could put a
reader of the taken buffer after the op). Eager backend only: a compiler does its
own buffer reuse (inductor) and would have to functionalize the writes back. No
collective is moved or changed. A graph with nothing to rewrite is returned untouched.
Checked by ``reused-buffer`` in :func:`passes.invariants.check_invariants`
(:func:`check_reuse`).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.memory import Liveness, buffer_liveness, tensor_bytes
from passes.torch_compat import OpOverload

log = logging.getLogger("spmd.passes")

aten = torch.ops.aten

# node.meta key on a rewritten node: the name of the input whose buffer it writes.
REUSED = "spmd_reused_buffer"

# functional op -> (its out= overload, the argument positions whose buffer the result may take).
# Each entry is proven bit for bit, with ``out`` aliasing each listed argument, in test_reuse.py.
REUSABLE: dict[OpOverload, tuple[OpOverload, tuple[int, ...]]] = {
    aten._log_softmax.default: (aten._log_softmax.out, (0,)),
    aten._log_softmax_backward_data.default: (aten._log_softmax_backward_data.out, (0, 1)),
    aten._softmax.default: (aten._softmax.out, (0,)),
    aten._softmax_backward_data.default: (aten._softmax_backward_data.out, (0, 1)),
    aten.gelu_backward.default: (aten.gelu_backward.grad_input, (0, 1)),
    aten.add.Tensor: (aten.add.out, (0, 1)),
    aten.mul.Tensor: (aten.mul.out, (0, 1)),
}


def _out_name(op: OpOverload) -> str:
    """The keyword-only argument an ``out=`` overload writes (``out``, ``grad_input``)."""
    return next(
        a.name
        for a in torch_compat.op_schema(op).arguments
        if a.kwarg_only and a.alias_info and a.alias_info.is_write
    )


def _full(t: object, like: torch.Tensor) -> bool:
    """``t`` has ``like``'s shape, dtype, device and contiguous strides, and owns its whole storage."""
    return (
        isinstance(t, torch.Tensor)
        and t.shape == like.shape
        and t.dtype == like.dtype
        and t.device == like.device
        and t.stride() == like.stride()
        and t.is_contiguous()
        and t.storage_offset() == 0
        and tensor_bytes(t) == t.numel() * t.element_size()
    )


def _allocator_ok(node: fx.Node) -> bool:
    """A buffer made by this node is a plain fresh tensor at run time too."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, OpOverload)
        and target.namespace in ("aten", "prims")
        and not C.is_collective(node)
        and not C.is_wait(node)
    )


def _in_flight(lv: Liveness, index: dict[fx.Node, int]) -> list[tuple[int, int, set[int]]]:
    """(issue index, last wait index, buffers) of each collective: what it reads and writes
    between its issue and its wait. A collective without a wait in this graph (a carried
    gather) is in flight to the end."""
    out = []
    for coll in lv.nodes:
        if not C.is_collective(coll):
            continue
        waits = C.waits_of(coll)
        stop = max(index[w] for w in waits) if waits else len(lv.nodes)
        bufs = {b for x in [*C.inputs_of(coll), coll] for b in lv.bufs_of.get(x, []) if b is not None}
        out.append((index[coll], stop, bufs))
    return out


def reuse_dead_buffers(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ops of :data:`REUSABLE` to write into an input that dies at them (module docstring)."""
    lv = buffer_liveness(gm)
    index = {n: i for i, n in enumerate(lv.nodes)}
    flights = _in_flight(lv, index)
    producer = {b: n for n, bs in lv.fresh_of.items() for b in bs}
    rep: dict[int, int] = {}  # a result's buffer -> the input buffer it now lives in

    def find(b: int) -> int:
        while b in rep:
            b = rep[b]
        return b

    rewritten = 0
    saved = 0
    for node in lv.nodes:
        entry = REUSABLE.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
        val = node.meta.get("val")
        if entry is None or not isinstance(val, torch.Tensor) or len(lv.fresh_of[node]) != 1:
            continue
        if not _full(val, val):
            continue
        at = index[node]
        arg_bufs = [find(b) for i in node.all_input_nodes for b in lv.bufs_of[i] if b is not None]
        for pos in entry[1]:
            arg = node.args[pos] if pos < len(node.args) else None
            if not isinstance(arg, fx.Node) or not _full(arg.meta.get("val"), val):
                continue
            bufs = lv.bufs_of[arg]
            if len(bufs) != 1 or bufs[0] is None:
                continue
            b = find(bufs[0])
            if (
                b in lv.pinned
                or lv.last_use.get(b) != at
                or arg_bufs.count(b) != 1
                or lv.size[b] != tensor_bytes(val)
                or not _allocator_ok(producer[b])
                or any(start < at < stop and b in {find(x) for x in bufs} for start, stop, bufs in flights)
            ):
                continue
            out_op = entry[0]
            node.target = out_op
            node.kwargs = {**node.kwargs, _out_name(out_op): arg}
            node.meta["val"] = arg.meta["val"]
            node.meta[REUSED] = arg.name
            (fresh,) = lv.fresh_of[node]
            rep[fresh] = b
            lv.last_use[b] = lv.last_use.get(fresh, at)
            if fresh in lv.pinned:
                lv.pinned.add(b)
            rewritten += 1
            saved += lv.size[b]
            break
    if not rewritten:
        return gm
    log.debug("reuse_dead_buffers: %d ops write into a dead input (%.1f MiB)", rewritten, saved / 2**20)
    gm.graph.lint()
    gm.recompile()
    return gm


def _alias_closure(lv: Liveness, b: int, before: int, index: dict[fx.Node, int]) -> set[fx.Node]:
    """The nodes before index ``before`` whose value lives in buffer ``b``."""
    return {n for n in lv.nodes if index[n] < before and b in lv.bufs_of[n]}


def check_reuse(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(node, message) for every rewritten op whose taken buffer is read after it, or does not fit.

    The buffer an op of this pass writes must be dead after it: no later node reads any
    alias of it made before the op (they read the op's result instead)."""
    marked = [n for n in gm.graph.nodes if REUSED in n.meta]
    if not marked:
        return []
    lv = buffer_liveness(gm)
    index = {n: i for i, n in enumerate(lv.nodes)}
    found: list[tuple[str, str]] = []
    for node in marked:
        out_name = _out_name(node.target) if isinstance(node.target, OpOverload) else ""
        arg = node.kwargs.get(out_name)
        if not isinstance(arg, fx.Node):
            found.append(
                (node.name, f"{node.name} is marked as writing a dead input but has no out= argument")
            )
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not _full(arg.meta.get("val"), val):
            found.append((node.name, f"{node.name} writes into {arg.name}, whose shape/dtype/layout differ"))
        bufs = [b for b in lv.bufs_of.get(arg, []) if b is not None]
        if len(bufs) != 1 or bufs[0] in {
            b for n in lv.nodes if n.op == "placeholder" for b in lv.fresh_of[n]
        }:
            found.append((node.name, f"{node.name} writes into {arg.name}, which is not one fresh buffer"))
            continue
        old = _alias_closure(lv, bufs[0], index[node], index)
        late = [u for a in old for u in a.users if u.op != "output" and index[u] > index[node]]
        late += [a for a in old if any(u.op == "output" for u in a.users)]
        if late:
            found.append(
                (
                    node.name,
                    f"{node.name} writes into {arg.name}, but {sorted(u.name for u in late)} read that "
                    "buffer after it (reuse_dead_buffers must run after every pass that moves nodes)",
                )
            )
    return found
