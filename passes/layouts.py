"""Make a traced graph hold whatever memory layout its kernels really return.

A graph traced under fake tensors bakes in layout decisions taken on the *fake*
strides: ``linear`` records ``aten.view`` because its input looked viewable, an
autograd formula's ``.contiguous()`` vanishes because its input looked contiguous,
``as_strided`` records absolute strides. Some kernels return a different layout on
the real device than their meta function promises (on this CPU build:
``native_batch_norm`` on a transposed input, ``native_batch_norm_backward``), and the
difference travels on through layout-preserving ops. Replayed as is, the graph then
crashes (``view size is not compatible with input tensor's size and stride``) or,
worse, computes wrong values (a kernel that assumes the contiguity its trace saw,
e.g. ``native_group_norm_backward``; ``as_strided`` reading the wrong elements).

:func:`fix_layouts` runs the graph once on the real inputs, node by node, and
compares every tensor a node reads with the layout the trace recorded for it
(``node.meta["val"]``). Where they differ and the reader depends on layout, it
inserts ``spmd::restride(x, size, stride, storage_offset)`` before the reader: a copy
of ``x`` into the traced layout, which is what eager computed with (its
``.contiguous()`` / ``reshape`` copy). It copies the real value the same way and runs
on, so the checking run *is* the first real run and its outputs are the step's
results. Readers that are correct on any layout (pointwise ops, reductions, matmuls,
views that always succeed, copies, collectives' waits) get nothing, so they keep
computing on the layout eager used; so do random fills (``bernoulli_``, ``rand_like``,
...), whose layout decides which element gets which draw: on the real layout dropout's
mask is eager's, element for element; an ``aten.view`` gets a fix-up only when the view
of the real tensor would fail. Where layouts agree nothing is added: a graph without
mismatches is returned untouched.

Each fix-up node carries ``meta[LAYOUT_FIX]`` (what it fixed, in words) and the
role/phase/module of its reader. Run it on the final graph, after every other pass,
on the first call with real inputs (it executes the graph, collectives included, so
every rank must call it at the same point, as for any run). An argument the reader
writes in place is read and written through its own copy, and ``aten.copy_(arg, copy)``
after the reader puts the written values back.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from passes import torch_compat
from passes.meta import LAYOUT_FIX, copy_meta, module_of
from passes.torch_compat import OpOverload

log = logging.getLogger("spmd.passes")

aten = torch.ops.aten


@torch.library.custom_op("spmd::restride", mutates_args=())
def restride(
    x: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int
) -> torch.Tensor:
    """A copy of ``x`` with exactly this size, stride and storage offset (in a fresh storage)."""
    extent = storage_offset + sum((n - 1) * s for n, s in zip(size, stride) if n > 0) + 1
    if any(n == 0 for n in size):
        extent = storage_offset
    buf = x.new_empty(max(extent, 0))
    out = buf.as_strided(size, stride, storage_offset)
    out.copy_(x)
    return out


@restride.register_fake
def _(x: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int) -> torch.Tensor:
    return x.new_empty_strided(size, stride)


RESTRIDE = torch.ops.spmd.restride.default

# The attribute :func:`fix_layouts` sets on an exception raised while running a node: that node.
FAILING_NODE = "spmd_failing_node"

# Readers whose result is right on any input layout. Everything else is treated as
# layout-sensitive and gets its read-only inputs in the traced layout.
_VIEWS_ALWAYS_VALID = {
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.alias.default,
    aten.detach.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.narrow.default,
    aten.diagonal.default,
}
_INSENSITIVE = _VIEWS_ALWAYS_VALID | {
    aten.clone.default,
    aten.copy_.default,
    aten.copy.default,
    aten._to_copy.default,
    aten.contiguous.default,
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.default,
    aten.mean.dim,
    aten.amax.default,
    aten.amin.default,
    aten.var.correction,
    aten.var_mean.correction,
    aten.prod.default,
    aten.prod.dim_int,
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.cat.default,
    aten.stack.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.where.self,
    aten.sym_size.int,
    aten.sym_stride.int,
    aten.sym_numel.default,
}
# Kernels measured correct on any input layout here, whose eager autograd formulas pass
# their inputs on as they are: a copy into the traced layout would only change the order
# of their reductions, and so the last bits, against eager (native_batch_norm_backward
# does, on the transposed grad its forward's real layout leads to).
_ANY_LAYOUT_KERNELS = {
    aten.native_batch_norm.default,
    aten.native_batch_norm_backward.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit_no_training.default,
    aten.convolution.default,
    aten.convolution_backward.default,
    aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default,
    aten._softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
}
_INSENSITIVE |= _ANY_LAYOUT_KERNELS
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}

# Random ops that fill their result element by element in memory order: correct on any
# layout, and the layout decides which element gets which draw. Eager calls them on the
# layout the real kernels returned (dropout: ``empty_like(x).bernoulli_(1 - p)`` on the
# real ``x``), so they run on the real layout too: a copy into the traced layout would
# put eager's draws on other elements (another dropout mask than eager's under the same
# seed). Their results keep that layout; later readers get fix-ups as usual.
_RANDOM_FILLS = frozenset(
    {
        "aten::bernoulli",
        "aten::bernoulli_",
        "aten::rand_like",
        "aten::randn_like",
        "aten::randint_like",
        "aten::uniform",
        "aten::uniform_",
        "aten::normal",
        "aten::normal_",
        "aten::exponential",
        "aten::exponential_",
        "aten::geometric",
        "aten::geometric_",
        "aten::log_normal",
        "aten::log_normal_",
        "aten::cauchy",
        "aten::cauchy_",
        "aten::random_",
        "aten::native_dropout",
        "aten::poisson",
    }
)


def _insensitive(target: Any) -> bool:
    if not isinstance(target, OpOverload):
        return True  # operator.getitem and other Python callables read no layout
    if target in _INSENSITIVE:
        return True
    name = torch_compat.op_schema(target).name
    if name.startswith("_c10d_functional::wait_tensor") or name in ("spmd::tag_grad", "spmd::restride"):
        return True
    if name in _RANDOM_FILLS:
        return True
    return torch.Tag.pointwise in target.tags


def _written_args(target: Any, node: fx.Node) -> set[fx.Node]:
    """The argument nodes ``node`` writes in place."""
    if not isinstance(target, OpOverload):
        return set()
    out: set[fx.Node] = set()
    schema = torch_compat.op_schema(target).arguments
    values = list(node.args) + [node.kwargs.get(a.name) for a in schema[len(node.args) :]]
    for arg, value in zip(schema, values):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out |= set(_nodes_in(value))
    return out


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []

    def visit(n: fx.Node) -> fx.Node:
        found.append(n)
        return n

    fx.node.map_arg(value, visit)
    return found


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], Any]:
    """Strides that matter (dims of size 1 have no meaningful stride), and the offset."""
    return tuple(s if n != 1 else 0 for n, s in zip(t.shape, t.stride())), t.storage_offset()


def _mismatch(real: Any, traced: Any, *, offset: bool) -> bool:
    if not isinstance(real, torch.Tensor) or not isinstance(traced, torch.Tensor):
        return False
    if real.shape != traced.shape or real.numel() == 0 or real.layout != torch.strided:
        return False
    (rs, ro), (ts, to) = _layout(real), _layout(traced)
    return rs != ts or (offset and ro != to)


def where(node: fx.Node) -> str:
    """The module path and the model's source line that produced ``node``, when recorded."""
    parts = [module_of(node)] if module_of(node) else []
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines()]
    frames = [
        (ln, lines[i + 1] if i + 1 < len(lines) else "")
        for i, ln in enumerate(lines)
        if ln.startswith("File ")
    ]
    # The innermost frame outside torch itself: the user's line, not nn.functional's.
    user = [f for f in frames if "/torch/" not in f[0]] or frames
    if user:
        m = re.match(r'File "([^"]+)", line (\d+)', user[-1][0])
        where = f"{m.group(1)}:{m.group(2)}" if m else user[-1][0]
        parts.append(f"{where}: {user[-1][1]}" if user[-1][1] else where)
    return "; ".join(parts) or "unknown origin"


class _Checker(fx.Interpreter):
    """Runs the graph for real and inserts a fix-up where a reader needs the traced layout."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.extra_traceback = False  # raise the graph's errors as the compiled graph would
        self.fixes: list[fx.Node] = []
        # producer node -> its latest fix-up, shared with later readers when nothing in
        # between writes in place (the producer may alias a tensor that is written)
        self.shared: dict[fx.Node, fx.Node] = {}
        # (argument, its copy) written in place by the node being run: copied back after it
        self.copy_back: list[tuple[fx.Node, fx.Node]] = []

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function":
            self._check_reader(n)
        try:
            out = super().run_node(n)
        except Exception as exc:
            # The caller maps errors to nodes (e.g. a failed collective); generated code
            # shows it in the traceback, an interpreter does not.
            if not hasattr(exc, FAILING_NODE):
                setattr(exc, FAILING_NODE, n)
            raise
        self._copy_back(n)
        return out

    def _copy_back(self, reader: fx.Node) -> None:
        """After ``reader`` wrote into copies: ``copy_(arg, copy)`` for each, run here (the
        interpreter skips nodes already in its environment; it has already planned to
        free ``arg`` after ``reader``)."""
        last = reader
        for arg, fix in self.copy_back:
            with reader.graph.inserting_after(last):
                back = reader.graph.call_function(aten.copy_.default, (arg, fix))
            copy_meta(back, reader)
            back.meta["val"] = arg.meta["val"]
            back.meta[LAYOUT_FIX] = (
                f"{arg.name}: written through {fix.name}, copied back after {reader.target}"
            )
            self.fixes.append(back)
            self.env[back] = self.env[arg].copy_(self.env[fix])
            last = back
        self.copy_back.clear()

    def _check_reader(self, n: fx.Node) -> None:
        target = n.target
        if _insensitive(target):
            return
        written = _written_args(target, n)
        as_strided = target in (aten.as_strided.default, aten.as_strided_copy.default)
        for arg in dict.fromkeys(_nodes_in((n.args, n.kwargs))):
            real: Any = self.env.get(arg)
            traced: Any = arg.meta.get("val")
            if not _mismatch(real, traced, offset=as_strided):
                continue
            if target in _VIEWS and _view_ok(real, n):
                continue
            self._fix(n, arg, real, traced, written=arg in written)

    def _fix(
        self, reader: fx.Node, arg: fx.Node, real: torch.Tensor, traced: torch.Tensor, *, written: bool
    ) -> None:
        """Make ``reader`` read ``arg`` through a copy in the traced layout. An argument the
        reader writes in place gets its own copy, copied back into ``arg`` after the reader."""
        size, stride, offset = list(traced.shape), list(traced.stride()), traced.storage_offset()
        fix = None if written else self.shared.get(arg)
        if fix is None or fix.args[1:] != (size, stride, offset) or _write_between(fix, reader):
            graph = reader.graph
            with graph.inserting_before(reader):
                fix = graph.call_function(RESTRIDE, (arg, size, stride, offset))
            copy_meta(fix, reader)
            fix.meta["val"] = traced
            fix.meta[LAYOUT_FIX] = (
                f"{arg.name}: stride {tuple(real.stride())} -> {tuple(stride)} for {reader.target}"
            )
            if "stack_trace" in reader.meta:
                fix.meta["stack_trace"] = reader.meta["stack_trace"]
            self.fixes.append(fix)
            if written:
                self.copy_back.append((arg, fix))
            else:
                self.shared[arg] = fix
            if reader.target in (aten.as_strided.default, aten.as_strided_copy.default):
                # Unlike every other fix-up this one can change values against eager, whose
                # as_strided reads whatever layout the kernel returned; the graph's backward
                # was traced for the traced layout, so only that one is self-consistent.
                log.warning(
                    "spmd: as_strided (%s) reads %s, whose real layout (stride %s) differs from the "
                    "traced one (stride %s); the compiled step reads it in the traced layout, in "
                    "forward and backward alike. If the model calls .contiguous() before as_strided "
                    "this is that copy (the trace dropped it as a no-op) and results equal eager's; "
                    "if not, eager reads the kernel's layout and results differ: add .contiguous().",
                    where(reader),
                    arg.name,
                    tuple(real.stride()),
                    tuple(stride),
                )
            log.info(
                "spmd: layout fix-up before %s (%s): %s has stride %s at run time, the trace assumed %s",
                reader.target,
                where(reader),
                arg.name,
                tuple(real.stride()),
                tuple(stride),
            )
        reader.replace_input_with(arg, fix)
        self.env[fix] = RESTRIDE(real, size, stride, offset)


def _view_ok(real: torch.Tensor, node: fx.Node) -> bool:
    shape: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("size")
    try:
        real.view(shape)
    except RuntimeError:
        return False
    return True


def _write_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether a node after ``first`` and before ``last`` writes any tensor in place."""
    node = first.next
    while node is not last and node.op != "output":
        if _written_args(node.target, node):
            return True
        node = node.next
    return False


def fix_layouts(gm: fx.GraphModule, inputs: Sequence[Any]) -> tuple[fx.GraphModule, Any, list[fx.Node]]:
    """Run ``gm`` on ``inputs``, fixing layout mismatches in place as they are met.

    Returns ``(gm, outputs, fixes)``: the same GraphModule (recompiled when fix-ups were
    inserted), the outputs of this run (computed with the fix-ups, so correct), and the
    inserted fix-up nodes (empty when every layout agreed; then ``gm`` is untouched).
    Run it with gradients off, as the graph is run. If the run raises, the fix-ups met so
    far stay (recompiled) and a second call checks the rest.
    """
    checker = _Checker(gm)
    try:
        outputs = checker.run(*inputs)
    finally:
        if checker.fixes:
            gm.graph.lint()
            gm.recompile()
    return gm, outputs, checker.fixes


__all__ = ["FAILING_NODE", "LAYOUT_FIX", "RESTRIDE", "fix_layouts", "restride"]
