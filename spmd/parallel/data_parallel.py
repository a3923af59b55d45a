"""``DataParallel``: replicate (DDP) and fully_shard (FSDP / ZeRO-3) as graph rewrites.

The traced graph computes one rank's step on its local batch with full-size
parameters. ``partition`` makes it the SPMD step:

* replicate: every gradient (a ``tag_grad`` node) becomes ``all_reduce(avg)``;
  its wait sits just before the gradient's first use, so reductions overlap the
  rest of backward. The optimizer runs on full, replicated tensors.
* fully_shard: every parameter placeholder holds this rank's dim-0 shard. An
  all-gather (of the shard padded to equal size) restores the full parameter just
  before its first forward use; with ``reshard_after_forward`` backward gathers it
  again (and recomputes the cheap parameter-only ops forward derived from it, such
  as a transpose, so nothing gathered in forward lives into backward). Every
  gradient is reduce-scattered (avg) to the local shard, and the optimizer, whose
  ops are elementwise, runs on shards. Norms over sharded gradients in the
  optimizer region (``clip_grad_norm_``) become global with an all-reduce of the
  partial sums.
* hybrid_shard: fully_shard within each group of the mesh's shard dimension; each
  gradient is reduce-scattered (avg) over the shard group, then all-reduced (avg) over
  the replicate group. Norms of sharded gradients sum over the shard group only.
* Ignored parameters (``ignored_modules`` / ``ignored_params``) stay plain, rank-local
  tensors: never gathered, their gradients never reduced; the optimizer updates them
  locally. ``module_styles`` gives a submodule's parameters another style (e.g. a
  replicated head in a fully_shard model): each parameter follows its own plan.
* Mixed precision (``mixed_precision=MixedPrecision(...)``): the tracer already made
  the compute casts (fp32 parameter -> ``param_dtype`` copy). Under fully_shard the
  cast moves before the all-gather: each rank casts its fp32 shard and the gather
  sends ``param_dtype`` (bit for bit what gathering and then casting gives, since a
  cast is elementwise; half the bytes for bf16), in forward and in the backward
  re-gather alike. Gradients are cast to the reduce dtype before their reduction
  (skipped where the gradient is autograd's upcast of a ``reduce_dtype`` gradient:
  the round trip is exact) and the reduced gradient is cast back to the parameter's
  dtype, so the optimizer reads and updates fp32 master weights.
* Memory formats: a channels_last parameter is gathered and its gradient reduce-scattered in
  memory order (:mod:`spmd.parallel.layout`), so the gathered parameter and the gradient shard
  keep the parameter's strides.
* CPU offload (``offload_policy``): a parameter whose local shard is on the CPU while the
  trace saw it on the device is copied host-to-device before each of its all-gathers, and
  its reduced gradient device-to-host after the reduce-scatter's wait, so the optimizer
  runs on the CPU (:mod:`spmd.parallel.offload`).
* Buffers mutated by the step (BatchNorm running stats) are broadcast from rank 0
  across the whole mesh before their first use, as DDP's ``broadcast_buffers`` does.

Each parameter's placement is decided in one place (:mod:`spmd.parallel.plan`) when the
model is distributed; what the graph does with it is read back from the model's state
(DTensor placements, or a plain tensor for an ignored parameter), so a second compiled
function on the same model (an eval step) follows whatever the first one set up.

This module holds the mode (configuration, distributing the state) and the partitioner's
driver, :func:`_partition`, which runs the pieces in order, each in its own module:

* :mod:`spmd.parallel.partition_state`: what the partitioning reads once (plans, layouts,
  memory-order permutations, groups, casts, offloaded parameters) and the node emitters;
* :mod:`spmd.parallel.buffers`: the broadcast of mutated buffers;
* :mod:`spmd.parallel.gathers`: all-gathers, backward re-gathers, replicated casts and copies;
* :mod:`spmd.parallel.reductions`: gradient all-reduces and reduce-scatters, with their casts;
* :mod:`spmd.parallel.sharded_optim`: the optimizer on shards (global norms, fused-kernel
  alignment, offloaded factories).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn

from passes.invariants import InvariantViolation, Violation, check_reshard
from passes.meta import STATE_NAME, TP_CHOICE
from spmd.errors import ConfigError
from spmd.frontend import optim as optim_utils
from spmd.parallel import (
    auto_tp,
    buffers,
    checkpoint_layout,
    dp_checks,
    gathers,
    plan,
    reductions,
    sharded_optim,
    sharding,
)
from spmd.parallel.auto_tp import AUTO
from spmd.parallel.base import ParallelMode
from spmd.parallel.mixed_precision import MixedPrecision
from spmd.parallel.offload import CPUOffloadPolicy
from spmd.parallel.partition_state import PartitionState, refresh_vals

if TYPE_CHECKING:
    from spmd.frontend.step_inputs import LiftedState, StepArgs
    from spmd.frontend.trace_hooks import ComputeCasts

log = logging.getLogger("spmd")

STYLES = dp_checks.STYLES

# model -> the mesh it was distributed on
_MESH_OF: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class DataParallel(ParallelMode):
    """Data parallelism over a mesh of all ranks.

    Args:
        parallel_style: ``"replicate"`` (DDP: gradients all-reduced, optimizer replicated),
            ``"fully_shard"`` (FSDP/ZeRO-3: parameters, gradients and optimizer state sharded on dim 0)
            or ``"hybrid_shard"`` (FSDP HYBRID_SHARD / HSDP: fully_shard within each shard group of a
            2-D mesh, gradients then all-reduced across the groups).
        input_batch_dim: the batch dimension of the step's tensor arguments (each rank passes its
            local batch, as with DDP).
        mesh: a 1-D ``DeviceMesh`` for replicate and fully_shard (default: all ranks of the default
            process group); a 2-D one (replicate x shard; dimensions found by the names
            ``"replicate"``/``"shard"``, else dim 0 replicates) for hybrid_shard (default: shard
            within a node of torchrun's ``LOCAL_WORLD_SIZE`` ranks, replicate across nodes).
        ignored_modules: modules (objects or fully qualified names) whose parameters stay plain,
            rank-local tensors: not sharded, not gathered, gradients not reduced; the optimizer
            updates them locally (FSDP's ``ignored_modules``; rank-local experts of a mixture of
            experts).
        ignored_params: the same for single parameters (objects or fully qualified names).
        module_styles: ``{module fqn: style}``: that module's parameters take this style instead
            of ``parallel_style`` (FSDP2: ``replicate(submodule)`` inside ``fully_shard(root)``).
            Styles: ``"replicate"``, and the 1-D sharding ``"fully_shard"`` (1-D meshes) or
            ``"hybrid_shard"`` (2-D meshes). The longest matching fqn wins.
        reshard_after_forward: fully_shard and hybrid_shard. True frees gathered parameters after forward and
            gathers them again for backward (FSDP FULL_SHARD); False keeps them (SHARD_GRAD_OP).
        broadcast_buffers: broadcast buffers the step mutates (BatchNorm statistics) from rank 0
            before use, like DDP's option of the same name.
        bucket_cap_mb: largest bucket in MiB when bucketing by size (DDP's ``bucket_cap_mb``).
        bucket_mode: ``"module"`` (one bucket per FSDP unit: a numbered block such as
            ``layers.3``, or a top-level module) or ``"size"`` (adjacent collectives up to
            ``bucket_cap_mb``). Default: module for fully_shard, size for replicate.
        forward_prefetch: all-gathers issued this many units ahead in forward (FSDP2
            ``set_modules_to_forward_prefetch``; 0 gathers each unit at its first use).
        backward_prefetch: the same in backward (FSDP ``BACKWARD_PRE`` with depth 1).
        max_inflight_bytes: most unsharded bytes in flight in collectives at once (FSDP's
            ``limit_all_gathers`` as a byte budget); ``"auto"`` = twice the largest
            collective, None = unlimited.
        sync_module_states: broadcast rank 0's parameters and buffers to every rank when the
            model is first distributed (FSDP's ``sync_module_states``; DDP always does it).
        min_unit_mb: neighbouring units smaller than this are merged into one communication
            unit (one gather, one reduce-scatter), so stacks of tiny blocks do not pay a
            collective's latency per block; a last group still below it (the head after the
            blocks) joins the group before it; larger blocks stay units of their own; 0 keeps
            every block its own unit.
        mixed_precision: a :class:`~spmd.MixedPrecision`: compute in ``param_dtype`` over fp32
            master weights (sharded under fully_shard; gathered in ``param_dtype``), reduce
            gradients in ``reduce_dtype``, optimizer in fp32 (FSDP2 ``mp_policy``).
        param_init_fn: for a model built on ``torch.device("meta")``: ``fn(module)`` is called
            on each module whose own parameters or buffers are on the meta device, after they
            are allocated (empty) on the mesh's device, and must initialise them (FSDP1's
            ``param_init_fn``). Default: the module's ``reset_parameters()``. Modules are
            materialised one at a time and sharded at once, so no rank holds the full model;
            see :func:`spmd.parallel.sharding.materialize_meta`.
        offload_policy: ``spmd.CPUOffloadPolicy(pin_memory=True)``: fully_shard only. When the
            model computes on an accelerator, parameter shards, gradient shards and optimizer
            state live on the CPU and the optimizer runs there; the graph copies each shard to
            the device before its all-gathers and each reduced gradient back after its
            reduce-scatter (FSDP2's ``offload_policy``; FSDP1's ``cpu_offload``). Ignored on a
            CPU model. See :mod:`spmd.parallel.offload`.
        tp_plan: tensor parallelism: ``{pattern: style or placement}`` in torchtitan's form, module
            name patterns to ``torch.distributed.tensor.parallel`` styles (``ColwiseParallel()``,
            ``RowwiseParallel()``, ``SequenceParallel()``...) or parameter name patterns to a
            ``Placement`` on the ``"tp"`` mesh dimension (see
            :func:`spmd.parallel.tensor_parallel.resolve_plan`). The style shards each data
            dimension's piece as it would without tensor parallelism (FSDP2 composed with
            ``parallelize_module``). Needs ``tp_size`` or a ``mesh`` with a ``"tp"`` dimension.
            ``None`` (the default) or ``"auto"`` with tensor-parallel ranks: spmd chooses the
            placements from the traced step (:mod:`spmd.parallel.auto_tp`);
            ``spmd.tp_plan_of(model)`` gives the choice as a plan to freeze and edit.
        tp_size: ranks per tensor-parallel group (consecutive ranks, e.g. the GPUs of a node).
            The default mesh is then ``(world // tp_size, tp_size)`` named ``("dp_shard", "tp")``
            (``"dp_replicate"`` for replicate); for hybrid_shard ``("dp_replicate", "dp_shard",
            "tp")`` with ``LOCAL_WORLD_SIZE // tp_size`` ranks sharding within a node.
        async_tp: overlap the tensor-parallel all-gather before a column-parallel matmul and the
            reduce-scatter after a row-parallel one with the matmul, by cutting the local batch
            into chunks (:mod:`passes.async_tp`). ``"auto"``: on (4 chunks) when the step is
            lowered for a GPU, off on a CPU; ``True``: 4 chunks; an int: that many; ``False``: off.
    """

    parallel_style: str = "replicate"
    _: dataclasses.KW_ONLY
    input_batch_dim: int = 0
    mesh: Any = None
    reshard_after_forward: bool = True
    broadcast_buffers: bool = True
    bucket_cap_mb: float = 25.0
    bucket_mode: str | None = None
    forward_prefetch: int = 1
    backward_prefetch: int = 1
    max_inflight_bytes: int | str | None = "auto"
    sync_module_states: bool = False
    min_unit_mb: float = 1.0
    mixed_precision: MixedPrecision | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    offload_policy: CPUOffloadPolicy | None = None
    ignored_modules: tuple[Any, ...] = ()
    ignored_params: tuple[Any, ...] = ()
    module_styles: Mapping[str, str] | None = None
    tp_plan: Mapping[str, Any] | None = None
    tp_size: int | None = None
    async_tp: bool | int | str = "auto"

    def __post_init__(self) -> None:
        dp_checks.check_options(self)

    def _tp(self) -> bool:
        """Whether this mode partitions a tensor-parallel dimension too."""
        return self.tp_plan is not None

    def _plan_for(self, module: nn.Module) -> Mapping[str, Any]:
        """The tensor-parallel plan of ``module``: the user's, or the automatic choice."""
        if self.tp_plan != AUTO:
            return self.tp_plan or {}
        return auto_tp.chosen_plan(module)

    def needs_trace_before_prepare(self, module: nn.Module) -> bool:
        if self.tp_plan != AUTO or auto_tp.chosen(module) is not None or self._single():
            return False
        auto_tp.check_traceable(module)
        return not all(isinstance(p, sharding.DTensor) for p in module.parameters())

    def choose_from_trace(
        self, module: nn.Module, gm: fx.GraphModule, profile: Any = None
    ) -> auto_tp.AutoPlan:
        mesh = self._mesh(module)
        plan.check_mesh(mesh, self.parallel_style)
        return auto_tp.choose(module, gm, mesh, profile)

    def choice_key(self) -> Hashable | None:
        # The choice reads the tp degree and the trace; the data dimensions do not enter it.
        if self.tp_plan != AUTO:
            return None
        mesh = self.mesh
        tp = mesh.size(plan.tp_dim(mesh)) if mesh is not None else self.tp_size
        return ("auto_tp", tp)

    def reuse_choice(self, module: nn.Module, choice: Any) -> None:
        plan.check_mesh(self._mesh(module), self.parallel_style)
        auto_tp.adopt(module, choice)

    def trace_casts(self) -> ComputeCasts | None:
        return self.mixed_precision.compute_casts() if self.mixed_precision is not None else None

    def accumulate_after_reduce(self) -> bool:
        # FSDP2's order for sharded styles, DDP's for replicate; eager's where nothing is reduced.
        single = self._single()
        return self.parallel_style != "replicate" and not single

    def partition_key(self) -> Hashable | None:
        # The partitioner never reads these (only pass_options does): modes differing only in
        # them partition the same trace into the same graph.
        neutral = dataclasses.replace(self, **{f: _DEFAULTS[f] for f in _PASS_ONLY_FIELDS})
        try:
            hash(neutral)
        except TypeError:  # an unhashable knob (a mesh, a list): no sharing
            return None
        return neutral

    def pass_options(self) -> dict[str, Any]:
        from passes.prefetch import default_unit_of
        from passes.units import unit_from_meta

        mode = self.bucket_mode or ("size" if self.parallel_style == plan.REPLICATE else "module")
        unit_of = unit_from_meta(default_unit_of)
        opts: dict[str, Any] = {
            "bucket_cap_mb": self.bucket_cap_mb,
            "bucket_mode": mode,
            "forward_prefetch": self.forward_prefetch,
            "backward_prefetch": self.backward_prefetch,
            "max_inflight_bytes": self.max_inflight_bytes,
            "base_unit_of": default_unit_of,
            "unit_of": unit_of,
            "min_unit_bytes": int(self.min_unit_mb * 2**20),
            "async_tp": self.async_tp,
        }
        if mode == "module":
            opts["bucket_unit_of"] = unit_of
        return opts

    # ------------------------------------------------------------------ state

    def _mesh(self, module: nn.Module) -> Any:
        if self.mesh is not None:
            return self.mesh
        if module in _MESH_OF:
            # The mesh the model was distributed on. Not ``p.device_mesh``: DTensor can hand a
            # parameter an earlier mesh that compares equal but holds other (maybe destroyed) groups.
            return _MESH_OF[module]
        for p in module.parameters():
            if isinstance(p, sharding.DTensor):
                return p.device_mesh
        p0 = next(module.parameters(), None)
        device_type = _init_device().type if p0 is None or p0.is_meta else p0.device.type
        if self.tp_size is not None and self.tp_size > 1:
            return sharding.default_mesh(device_type, *self._tp_mesh_shape())
        if self.parallel_style == plan.HYBRID_SHARD:
            return sharding.default_mesh(device_type, plan.hybrid_mesh_shape(sharding.world_info()[1]))
        return sharding.default_mesh(device_type)

    def _tp_mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The default mesh (shape, names) with ``tp_size`` consecutive ranks per tensor-parallel group."""
        world, tp = sharding.world_info()[1], self.tp_size or 1
        if world % tp:
            raise ConfigError(
                f"spmd.DataParallel: tp_size={tp} does not divide the world size {world}; give a tp_size "
                "that does (the data dimensions take the rest)."
            )
        if self.parallel_style == plan.HYBRID_SHARD:
            nodes, local = plan.hybrid_mesh_shape(world)
            if local % tp:
                raise ConfigError(
                    f"spmd.DataParallel('hybrid_shard'): tp_size={tp} does not divide the {local} ranks of a "
                    "node (LOCAL_WORLD_SIZE); pass a mesh with dimensions ('dp_replicate', 'dp_shard', 'tp')."
                )
            return (nodes, local // tp, tp), ("dp_replicate", "dp_shard", plan.TP)
        data = "dp_replicate" if self.parallel_style == plan.REPLICATE else "dp_shard"
        return (world // tp, tp), (data, plan.TP)

    def _single(self) -> bool:
        """World size 1 with nothing asked of a mesh: no collectives, plain tensors."""
        return sharding.world_info()[1] == 1 and self.mesh is None and not self._tp()

    def _tp_placements(self, module: nn.Module, mesh: Any) -> dict[str, Any]:
        """Parameter fqn -> its placement on the mesh's tp dimension ({} without one)."""
        if plan.tp_dim(mesh) is None:
            return {}
        from spmd.parallel.tensor_parallel import resolve_plan

        return resolve_plan(module, self._plan_for(module)).params

    def _ignored_names(self, module: nn.Module, styles: dict[str, str] | None = None) -> set[str]:
        """Fqns of the ignored parameters and of the buffers of ignored modules (both rank-local)."""
        styles = styles if styles is not None else self._styles(module)
        return {n for n, s in styles.items() if s == plan.IGNORED} | plan.ignored_buffers(
            module, self.ignored_modules
        )

    def _styles(self, module: nn.Module) -> dict[str, str]:
        """Every parameter fqn -> its style (see :func:`spmd.parallel.plan.assign_styles`)."""
        return plan.assign_styles(
            module,
            self.parallel_style,
            ignored_modules=self.ignored_modules,
            ignored_params=self.ignored_params,
            module_styles=self.module_styles,
        )

    def distribute(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Put the model's parameters and the optimizer's state in their distributed (DTensor) form now.

        The first compiled call does this by itself; call it yourself to load a checkpoint
        (``torch.distributed.checkpoint``) into the distributed state before training.
        Optimizer state is created (zeros) if the optimizer has none yet, at world size 1
        too (nothing is distributed there, but DCP loads optimizer state only into entries
        that exist). A model on the meta device is materialised here (see ``param_init_fn``).
        """
        self.prepare(module, optimizer, None)
        if optimizer is not None and self._single():
            optim_utils.ensure_state(optimizer, [p for g in optimizer.param_groups for p in g["params"]])

    def prepare(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, args: StepArgs | None
    ) -> None:
        single = self._single()
        if sharding.is_meta_model(module):
            self._materialize(module, optimizer, single)
        if single:
            return
        if all(isinstance(p, sharding.DTensor) for p in module.parameters()):
            checkpoint_layout.register(module, optimizer)  # an optimizer first seen now
            return
        styles = self._styles(module)
        plain = {
            n
            for n, p in module.named_parameters(remove_duplicate=False)
            if not isinstance(p, sharding.DTensor)
        }
        if all(styles[n] == plan.IGNORED for n in plain):
            return  # distributed already; only ignored parameters are plain
        if self.sync_module_states:
            sharding.broadcast_module_states(module, skip=self._ignored_names(module, styles))
        if optimizer is not None:
            # State is created on the full tensors, then sharded with them.
            optim_utils.ensure_state(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
        mesh = self._mesh(module)
        plan.check_mesh(mesh, self.parallel_style)
        tp = self._tp_placements(module, mesh)
        n = sharding.distribute_state(
            module,
            optimizer,
            mesh,
            lambda fqn, p: plan.placements_for(styles[fqn], mesh, p, tp.get(fqn)),
            offload=self._offload(mesh),
        )
        _MESH_OF[module] = mesh
        checkpoint_layout.register(module, optimizer)
        ignored = sum(s == plan.IGNORED for s in styles.values())
        log.info("spmd: distributed %d parameters (%s), %d ignored", n, self.parallel_style, ignored)

    def _materialize(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, single: bool) -> None:
        """Materialise a meta-device model module by module, each module sharded at once.

        An optimizer built over the meta parameters is re-keyed to the new ones (its state,
        created later by the first compile, is then created on the shards).
        """
        if optimizer is not None and any(
            optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]
        ):
            raise ConfigError(
                "spmd.DataParallel: the optimizer already has state for parameters on the meta device. "
                "Build the optimizer over the meta model without stepping it (or after "
                "DataParallel(...).distribute(model))."
            )
        mesh = None if single else self._mesh(module)
        device = _init_device(mesh)
        styles = self._styles(module)
        tp: dict[str, Any] = {}
        if mesh is not None:
            plan.check_mesh(mesh, self.parallel_style)
            tp = self._tp_placements(module, mesh)
        new_of = sharding.materialize_meta(
            module,
            device=device,
            mesh=mesh,
            placements_of=lambda fqn, p: (
                plan.placements_for(styles[fqn], mesh, p, tp.get(fqn)) if mesh is not None else None
            ),
            param_init_fn=self.param_init_fn,
            sync_module_states=self.sync_module_states,
            offload=self._offload(mesh),
        )
        sharding.rekey_optimizer(optimizer, new_of, mesh, self._offload(mesh))
        checkpoint_layout.register(module, optimizer)

    def _offload(self, mesh: Any) -> CPUOffloadPolicy | None:
        """The offload policy where it applies: a mesh on an accelerator (a CPU model has
        nothing to offload, and the policy is ignored)."""
        if self.offload_policy is None or mesh is None:
            return None
        if mesh.device_type == "cpu":
            log.info("spmd: offload_policy ignored: the model computes on the CPU already")
            return None
        return self.offload_policy

    # ------------------------------------------------------------------ graph

    def partition(self, gm: fx.GraphModule, state: LiftedState, args: StepArgs) -> fx.GraphModule:
        if self._single():
            return gm  # world size 1: nothing to communicate
        mesh = self._mesh(args.module)
        if plan.tp_dim(mesh) is not None:
            from spmd.parallel.tensor_parallel import expand_tp

            # step 1: the tensor-parallel piece of the step
            gm = expand_tp(gm, state, args, mesh, self._plan_for(args.module))
        gm = _partition(gm, state, args, mesh, self)
        if self.tp_plan == AUTO and (choice := auto_tp.chosen(args.module)) is not None:
            for n in gm.graph.nodes:  # why each parameter has its tp placement (report, dump)
                if n.op == "placeholder" and (why := choice.reasons.get(str(n.meta.get(STATE_NAME)))):
                    n.meta[TP_CHOICE] = why
        return gm


_PASS_ONLY_FIELDS = (
    "async_tp",
    "bucket_cap_mb",
    "bucket_mode",
    "forward_prefetch",
    "backward_prefetch",
    "max_inflight_bytes",
    "min_unit_mb",
)
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(DataParallel)}


def _init_device(mesh: Any = None) -> torch.device:
    """Where a meta-device model is materialised: the mesh's device; without a mesh, CUDA
    when the default process group can run on it (NCCL), else the CPU."""
    if mesh is not None:
        device_type = mesh.device_type
    elif torch.cuda.is_available() and (
        not torch.distributed.is_initialized() or "nccl" in str(torch.distributed.get_backend())
    ):
        device_type = "cuda"
    else:
        device_type = "cpu"
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _partition(
    gm: fx.GraphModule, state: LiftedState, args: StepArgs, mesh: Any, dp: DataParallel
) -> fx.GraphModule:
    """Rewrite the traced step into this rank's SPMD step; the pieces run in this order.

    The optimizer-region rewrites must follow the reductions: they find sharded gradients by
    the ``GRAD`` role the reductions give the reduced ones. The rest of the order is fixed too:
    it decides node names and, where two pieces insert at the same point, the collective
    order, so moving a piece changes the graph. ``meta['val']`` is refreshed last, on the
    local shapes.
    """
    ps = PartitionState(gm, state, args, mesh, dp)
    if dp.broadcast_buffers:
        buffers.broadcast_mutated_buffers(ps)
    gathers.refuse_compute_writes(ps)
    for name in ps.layouts:
        gathers.gather_param(ps, name)
    gathers.place_replicated_casts(ps)
    for name in ps.offloaded.keys() - ps.layouts.keys():
        gathers.copy_in_replicated(ps, name)
    reductions.reduce_grads(ps)
    if ps.layouts:
        sharded_optim.globalize_norms(ps)
        sharded_optim.align_fused_optimizer(ps)
    if ps.offloaded:
        sharded_optim.optimizer_on_cpu(ps)
    ps.graph.lint()
    ps.gm.recompile()
    refresh_vals(ps)
    if broken := check_reshard(ps.gm):  # cheap (one walk); a violation is a partitioner bug
        raise InvariantViolation([Violation("reshard", name, msg) for name, msg in broken])
    return ps.gm
