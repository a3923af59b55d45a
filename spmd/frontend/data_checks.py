"""Python branches on the step's data become checks on every call.

``if labels.max() >= vocab: raise ...`` or ``if mask.any(): ...`` in a train step asks a tensor
for its value, and a graph traced once on fake tensors has none. When the tensor follows from
the step's tensor arguments alone (its ancestors in the graph being traced are those inputs and
at most ``_MAX_NODES`` functional, non-random ops: a check on the batch, not on activations or
parameters), the trace evaluates it on the first call's real inputs and continues on the side
eager takes with them. The condition is kept as a small graph of its own
(:class:`DataChecks`): every later call evaluates it on that call's inputs *before* the step
runs, and where a batch would take the other side, every rank raises
:class:`~spmd.errors.DataCheckError` naming the line (the ranks agree through one all-reduce of
a flag per check, so none goes on into the step's collectives alone). It is never silently
wrong; the cost is those few ops, and at more than one rank that small all-reduce, per call.

A value read from anything else (the loss, an activation, a parameter) keeps today's refusal
(:class:`~spmd.errors.DataDependentControlFlowError`). Only ``bool(tensor)`` (``if``, ``and``,
``not``, ``assert``) is followed; ``.item()``, ``int(t)`` and ``float(t)`` still refuse: their
value flows on into the graph, where one value would be baked in for every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot

from passes import torch_compat
from passes.torch_compat import FakeTensor, OpOverload, unset_fake_temporarily
from spmd.errors import DataCheckError
from spmd.frontend.captured import is_internal_file

log = logging.getLogger("spmd")

# A condition computed from more nodes than this is not a check on the batch; leave it refused.
_MAX_NODES = 64


@dataclasses.dataclass
class DataChecks:
    """The conditions a trace read from its first call's inputs, as a graph over those inputs."""

    gm: fx.GraphModule  # placeholders: the step's tensor arguments at ``positions``; outputs: the conditions
    positions: list[int]
    expected: list[bool]
    where: list[str]  # per condition: "file:line ('source')"

    def verify(self, tensors: list[torch.Tensor]) -> None:
        """Raise :class:`DataCheckError` on every rank when this call's inputs would take another
        side of a branch than the traced one, on any rank."""
        with torch.no_grad():
            values = self.gm(*[tensors[i] for i in self.positions])
        bad = [bool(v) != e for v, e in zip(values, self.expected)]
        counts, world = [int(b) for b in bad], 1
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            device = values[0].device if values and values[0].device.type != "cpu" else torch.device("cpu")
            if dist.get_backend() == "nccl" and device.type == "cpu":
                device = torch.device("cuda", torch.cuda.current_device())
            flags = torch.tensor(counts, dtype=torch.int32, device=device)
            dist.all_reduce(flags)  # every rank learns of every rank's mismatch: all raise, none hangs
            counts = flags.tolist()
        failing = [i for i, n in enumerate(counts) if n]
        if not failing:
            return

        def differs(i: int) -> str:
            if world == 1:
                return f"this batch makes it {not self.expected[i]}"
            return f"it differs on {counts[i]} of {world} ranks (this one: {'yes' if bad[i] else 'no'})"

        lines = "; ".join(
            f"{self.where[i]} was {self.expected[i]} on the batch the step was traced with, and {differs(i)}"
            for i in failing
        )
        raise DataCheckError(
            "spmd.compile: this batch would take another side of a Python branch on the step's data than "
            f"the graph traced on the first call: {lines}. The step was not run (no parameter changed). "
            "If the branch raises in eager (a check on the labels), fix the batch; if both sides are "
            "legitimate, compute both with tensor ops (torch.where) or move the branch out of the step."
        )


def data_checks_collective(checks: DataChecks | None) -> list[tuple[Any, str]]:
    """The all-reduce :meth:`DataChecks.verify` issues before the step, for the ranks' agreement
    (:func:`spmd.parallel.agreement.check_rank_agreement`): ranks whose first batches took other
    sides may have read other conditions, and their checks' all-reduces would not match."""
    if checks is None:
        return []
    n = len(checks.expected)
    return [(("data_checks", "all_reduce", n), f"the all-reduce of {n} data check flag(s) before the step")]


def _evaluate(t: FakeTensor, inputs: dict[int, torch.Tensor]) -> tuple[torch.Tensor, list[fx.Node]] | None:
    """The real value of ``t`` from the real step inputs (``inputs``: placeholder position -> real
    tensor), and the nodes that compute it in order; None when it depends on anything else."""
    mode = get_proxy_mode()
    if mode is None:
        return None
    proxy = get_proxy_slot(t, mode.tracer, None, lambda p: p.proxy)
    if proxy is None:
        return None
    placeholders = {n: i for i, n in enumerate(n for n in proxy.node.graph.nodes if n.op == "placeholder")}
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> bool:
        if node in seen:
            return True
        seen.add(node)
        if node.op == "placeholder":
            real = inputs.get(placeholders.get(node, -1))
            fake = node.meta.get("val")
            # The real batch must be what the trace sees (not a shard of a global DTensor input).
            if real is None or not isinstance(fake, torch.Tensor) or real.shape != fake.shape:
                return False
            order.append(node)
            return True
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload):
            return False
        if torch.Tag.nondeterministic_seeded in target.tags or torch_compat.op_schema(target).is_mutable:
            return False
        if not all(visit(arg) for arg in node.all_input_nodes):
            return False
        order.append(node)
        return len(order) <= _MAX_NODES

    if not visit(proxy.node):
        return None
    env: dict[fx.Node, Any] = {}
    with disable_proxy_modes_tracing(), unset_fake_temporarily(), torch.no_grad():
        try:
            for node in order:
                if node.op == "placeholder":
                    env[node] = inputs[placeholders[node]]
                    continue
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception as exc:  # noqa: BLE001 - stay refused
            log.debug("spmd: cannot evaluate %s on the real inputs: %r", proxy.node, exc)
            return None
    value = env[proxy.node]
    return (value, order) if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def _user_line() -> str:
    """The innermost caller outside torch, spmd and the standard library: "file:line ('source')"."""
    frame = sys._getframe(2)
    while frame is not None and is_internal_file(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown line>"
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({line!r})"


@dataclasses.dataclass
class _Recorded:
    node: fx.Node
    order: list[fx.Node]
    expected: bool
    where: str


@contextlib.contextmanager
def data_branches(inputs: dict[int, torch.Tensor]) -> Iterator[list[_Recorded]]:
    """During a trace, answer ``bool(fake)`` from the real step inputs where it follows from them
    alone (``inputs``: placeholder position -> the real tensor); yields the list of conditions read,
    for :func:`build_checks`."""
    recorded: list[_Recorded] = []
    base = torch_compat.TensorBase.__bool__
    had_own = "__bool__" in torch.Tensor.__dict__
    own = torch.Tensor.__dict__.get("__bool__")

    def __bool__(self: torch.Tensor) -> bool:
        if isinstance(self, FakeTensor):
            found = _evaluate(self, inputs)
            if found is not None:
                value, order = found
                result = bool(value)
                recorded.append(_Recorded(order[-1], order, result, _user_line()))
                log.info(
                    "spmd: %s is %s on the first call's data: traced that side", recorded[-1].where, result
                )
                return result
        return own(self) if own is not None else base(self)

    torch.Tensor.__bool__ = __bool__  # type: ignore[method-assign,assignment]
    try:
        yield recorded
    finally:
        if had_own:
            torch.Tensor.__bool__ = own  # type: ignore[method-assign,assignment]
        else:
            del torch.Tensor.__bool__


def build_checks(recorded: list[_Recorded], first_input: int) -> DataChecks | None:
    """The recorded conditions as one graph over the step's tensor arguments (placeholder
    positions from ``first_input`` on are the arguments, in order). Call before dead code is
    eliminated from the traced graph: the conditions have no users there."""
    if not recorded:
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    all_placeholders = {
        n: i for i, n in enumerate(n for n in recorded[0].node.graph.nodes if n.op == "placeholder")
    }
    used = sorted({all_placeholders[n] for r in recorded for n in r.order if n.op == "placeholder"})
    for pos in used:
        node = next(n for n, i in all_placeholders.items() if i == pos)
        env[node] = graph.placeholder(f"input_{pos - first_input}")
    for r in recorded:
        for node in r.order:
            if node not in env:
                env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[r.node] for r in recorded))
    return DataChecks(
        gm=fx.GraphModule(torch.nn.Module(), graph, class_name="DataChecks"),
        positions=[pos - first_input for pos in used],
        expected=[r.expected for r in recorded],
        where=[r.where for r in recorded],
    )


__all__ = ["DataChecks", "build_checks", "data_branches", "data_checks_collective"]
