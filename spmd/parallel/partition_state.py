"""The state one partitioning of a traced step works on, and its emitting helpers.

:class:`PartitionState` is read once from the graph and the model's distributed state
(DTensor placements): the placeholders by state name, each parameter's communication plan
(:func:`spmd.parallel.plan.comm_plan`), the layouts of the sharded ones, their memory-order
permutations (:mod:`spmd.parallel.layout`), the groups, the mixed-precision compute casts and
the offloaded parameters. The passes of the partitioner (:mod:`spmd.parallel.buffers`,
:mod:`spmd.parallel.gathers`, :mod:`spmd.parallel.reductions`,
:mod:`spmd.parallel.sharded_optim`) are functions of it, run in order by
:mod:`spmd.parallel.data_parallel`; :func:`refresh_vals` runs last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes.meta import CAST_OF, PLACEMENT, STATE_NAME, Role, copy_meta
from spmd.errors import TraceError
from spmd.frontend.kernel_layouts import KernelLayoutFakeMode
from spmd.parallel import layout, plan, sharding

if TYPE_CHECKING:
    from spmd.frontend.step_inputs import LiftedState, StepArgs
    from spmd.parallel.data_parallel import DataParallel

aten = torch.ops.aten


class PartitionState:
    """One partitioning of ``gm``: what each parameter's plan asks, and node emitters."""

    def __init__(self, gm: fx.GraphModule, state: LiftedState, args: StepArgs, mesh: Any, dp: DataParallel):
        self.gm, self.graph = gm, gm.graph
        self.dp = dp
        # Buffers are broadcast over every rank of the mesh.
        self.group = plan.whole_group(mesh).group_name
        self.state, self.args = state, args
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.by_name = {n.meta[STATE_NAME]: n for n in self.placeholders}
        self.params = dict(state.params)
        # parameter fqn -> what the graph does with it, read from its state
        self.comms = {name: plan.comm_plan(p, mesh) for name, p in state.params}
        # parameter fqn -> layout, for the sharded ones
        self.layouts = {name: c.layout for name, c in self.comms.items() if c.layout is not None}
        # sharded parameter fqn -> its memory order, where that is not the logical one
        # (channels_last): collectives run in memory order (see spmd.parallel.layout)
        self.perms = {
            name: perm
            for name in self.layouts
            if (perm := layout.memory_order(self.by_name[name].meta["val"])) is not None
        }
        self.ignored_buffers = plan.ignored_buffers(args.module, dp.ignored_modules)
        # Partial norms of sharded gradients are summed over the shard group (the replicas agree).
        self.shard_group = next((c.shard.name for c in self.comms.values() if c.shard), self.group)
        for name, p in state.params:
            self.by_name[name].meta[PLACEMENT] = plan.describe(p, self.comms[name])
        mp = dp.mixed_precision
        self.reduce_dtype = mp.gradient_reduce_dtype if mp is not None else None
        # parameter fqn -> the tracer's compute cast of it (mixed precision)
        self.casts = {
            n.meta[CAST_OF]: n
            for n in self.graph.nodes
            if n.op == "call_function" and n.meta.get(CAST_OF) in self.params
        }
        # parameter fqn -> the device it computes on, for parameters whose local tensor lives
        # elsewhere (CPU offload): the trace saw them on the device, the state holds them on the CPU.
        self.offloaded: dict[str, torch.device] = {}
        for name, p in state.params:
            val = self.by_name[name].meta.get("val")
            if isinstance(val, torch.Tensor) and sharding.local(p).device.type != val.device.type:
                self.offloaded[name] = val.device
        self.non_blocking = dp.offload_policy is not None and dp.offload_policy.pin_memory

    def first(self, nodes: list[fx.Node]) -> fx.Node:
        """The earliest of ``nodes`` in graph order (fx keeps an order key on every node: no scan)."""
        return min(nodes)

    def call(
        self,
        target: Any,
        args: tuple[Any, ...],
        like: fx.Node,
        role: Role = Role.COMM,
        kwargs: dict[str, Any] | None = None,
    ) -> fx.Node:
        """A new ``call_function`` node at the insertion point, with ``like``'s meta and ``role``."""
        n = self.graph.call_function(target, args, kwargs)
        copy_meta(n, like, role=role)
        return n

    def to_dtype(self, x: fx.Node, dtype: torch.dtype, like: fx.Node, role: Role = Role.COMM) -> fx.Node:
        """A copy of ``x`` cast to ``dtype``."""
        return self.call(aten._to_copy.default, (x,), like, role=role, kwargs={"dtype": dtype})

    def to_device(self, x: fx.Node, device: torch.device, like: fx.Node, role: Role = Role.COMM) -> fx.Node:
        """A copy of ``x`` on ``device``: host-to-device (non-blocking from pinned memory) or
        device-to-host (blocking: the CPU reads it next; see spmd.parallel.offload)."""
        non_blocking = self.non_blocking and device.type != "cpu"
        kwargs = {"device": device, "non_blocking": non_blocking}
        return self.call(aten._to_copy.default, (x,), like, role=role, kwargs=kwargs)


def refresh_vals(ps: PartitionState) -> None:
    """Recompute ``meta['val']`` for the local shapes (keeps the val invariant true)."""
    # detach: an ignored parameter is a plain leaf that requires grad; the graph updates it in place.
    real = [sharding.local(t).detach() for t in ps.state.tensors(ps.args.optimizer)] + ps.args.tensors
    mode = KernelLayoutFakeMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t) for t in real]
    try:
        FakeTensorProp(ps.gm, mode).propagate_dont_convert_inputs(*fakes)
    except Exception as exc:  # noqa: BLE001
        raise TraceError(
            f"spmd {ps.dp.parallel_style}: the partitioned graph does not type-check on the local "
            f"shapes: {exc}. Some op of the step is not shape-agnostic on shards; try "
            "DataParallel('replicate')."
        ) from exc
