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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes import collectives as C
from passes.graph_utils import PASS_THROUGH_OPS, mutated_nodes
from passes.meta import (
    CAST_OF,
    GRAD_OF,
    MICROBATCH,
    PHASE,
    PLACEMENT,
    ROLE,
    STATE_NAME,
    Phase,
    Role,
    copy_meta,
)
from passes.ops import TAG_GRAD
from spmd import optim as optim_utils
from spmd.errors import ConfigError, TraceError
from spmd.parallel import layout, plan, sharding
from spmd.parallel.base import ParallelMode
from spmd.parallel.mixed_precision import MixedPrecision
from spmd.parallel.offload import CPU, CPUOffloadPolicy

if TYPE_CHECKING:
    from spmd.tracing import ComputeCasts, LiftedState, StepArgs

log = logging.getLogger("spmd")

STYLES = (plan.REPLICATE, plan.FULLY_SHARD, plan.HYBRID_SHARD)

# Fused optimizer kernels whose SIMD/scalar split depends on where an element sits (see
# _Partitioner._align_fused_optimizer), their per-parameter list arguments, and an element
# alignment that is a multiple of every CPU vector width (AVX-512 float: 16, bf16: 32).
_FUSED_OPTIMIZERS = {
    torch.ops.aten._fused_adam_.default,
    torch.ops.aten._fused_adam_.tensor_lr,
    torch.ops.aten._fused_adamw_.default,
    torch.ops.aten._fused_adamw_.tensor_lr,
    torch.ops.aten._fused_sgd_.default,
    torch.ops.aten._fused_sgd_.tensor_lr,
}
_PER_PARAM_LISTS = {"self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "momentum_buffer_list"}
_ALIGN = 64

# model -> names of buffers any compiled step on it mutates (see _broadcast_mutated_buffers)
_MUTATED_BUFFERS: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()
# model -> the mesh it was distributed on
_MESH_OF: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
aten = torch.ops.aten


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
            collective's latency per block; larger blocks stay units of their own.
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

    def __post_init__(self) -> None:
        if self.parallel_style not in STYLES:
            raise ConfigError(
                f"spmd.DataParallel: unknown parallel_style {self.parallel_style!r}; valid styles are "
                f"{', '.join(repr(s) for s in STYLES)}."
            )
        self._check_per_parameter_knobs()
        if not isinstance(self.input_batch_dim, int) or self.input_batch_dim < 0:
            raise ConfigError(
                "spmd.DataParallel: input_batch_dim must be a non-negative int, "
                f"got {self.input_batch_dim!r}."
            )
        for knob in ("reshard_after_forward", "broadcast_buffers", "sync_module_states"):
            if not isinstance(getattr(self, knob), bool):
                raise ConfigError(
                    f"spmd.DataParallel: {knob} must be True or False, got {getattr(self, knob)!r}."
                )
        if self.mesh is not None:
            plan.check_mesh(self.mesh, self.parallel_style)
        if not isinstance(self.bucket_cap_mb, int | float) or self.bucket_cap_mb <= 0:
            raise ConfigError(
                f"spmd.DataParallel: bucket_cap_mb must be a positive number, got {self.bucket_cap_mb!r}."
            )
        if not isinstance(self.min_unit_mb, int | float) or self.min_unit_mb < 0:
            raise ConfigError(
                f"spmd.DataParallel: min_unit_mb must be a number >= 0, got {self.min_unit_mb!r}."
            )
        if self.bucket_mode not in (None, "size", "module"):
            raise ConfigError(
                f"spmd.DataParallel: bucket_mode must be 'size', 'module' or None, got {self.bucket_mode!r}."
            )
        for knob in ("forward_prefetch", "backward_prefetch"):
            v = getattr(self, knob)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"spmd.DataParallel: {knob} must be an int >= 0, got {v!r}.")
        mp = self.mixed_precision
        if mp is not None and not isinstance(mp, MixedPrecision):
            hint = ""
            if type(mp).__name__ == "MixedPrecisionPolicy":
                hint = (
                    " (FSDP2's MixedPrecisionPolicy translates as spmd.MixedPrecision(param_dtype=..., "
                    "reduce_dtype=..., cast_forward_inputs=...))"
                )
            elif isinstance(mp, torch.dtype):
                hint = f" (for example spmd.MixedPrecision(param_dtype={mp}))"
            raise ConfigError(
                f"spmd.DataParallel: mixed_precision must be an spmd.MixedPrecision or None, got "
                f"{type(mp).__name__}{hint}."
            )
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ConfigError(
                "spmd.DataParallel: param_init_fn must be a function fn(module) that initialises the "
                f"module's own parameters and buffers, got {self.param_init_fn!r}."
            )
        if self.offload_policy is not None:
            if not isinstance(self.offload_policy, CPUOffloadPolicy):
                raise ConfigError(
                    "spmd.DataParallel: offload_policy must be spmd.CPUOffloadPolicy(...) or None, got "
                    f"{self.offload_policy!r}."
                )
            if self.parallel_style != "fully_shard":
                raise ConfigError(
                    "spmd.DataParallel: offload_policy offloads sharded state and needs "
                    f"parallel_style='fully_shard', got {self.parallel_style!r}. Use "
                    "DataParallel('fully_shard', offload_policy=spmd.CPUOffloadPolicy())."
                )
        m = self.max_inflight_bytes
        if not (m is None or m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m > 0)):
            raise ConfigError(
                f"spmd.DataParallel: max_inflight_bytes must be a positive int, 'auto' or None, got {m!r}."
            )

    def trace_casts(self) -> ComputeCasts | None:
        return self.mixed_precision.compute_casts() if self.mixed_precision is not None else None

    def accumulate_after_reduce(self) -> bool:
        # FSDP2's order for sharded styles, DDP's for replicate; eager's where nothing is reduced.
        single = sharding.world_info()[1] == 1 and self.mesh is None
        return self.parallel_style != "replicate" and not single

    def _check_per_parameter_knobs(self) -> None:
        for knob in ("ignored_modules", "ignored_params"):
            v = getattr(self, knob)
            if isinstance(v, str | nn.Module | torch.Tensor) or not hasattr(v, "__iter__"):
                raise ConfigError(
                    f"spmd.DataParallel: {knob} must be a list (of modules/parameters or their fully "
                    f"qualified names), got {type(v).__name__}."
                )
            object.__setattr__(self, knob, tuple(v))
        if self.module_styles is None:
            return
        if not isinstance(self.module_styles, Mapping):
            raise ConfigError(
                "spmd.DataParallel: module_styles must be a dict {module fqn: style}, got "
                f"{type(self.module_styles).__name__}."
            )
        sharded = plan.HYBRID_SHARD if self.parallel_style == plan.HYBRID_SHARD else plan.FULLY_SHARD
        valid = (plan.REPLICATE, sharded)
        for fqn, style in self.module_styles.items():
            if not isinstance(fqn, str) or style not in valid:
                raise ConfigError(
                    f"spmd.DataParallel: module_styles[{fqn!r}] = {style!r}; keys must be module fqns and "
                    f"styles one of {valid} with parallel_style={self.parallel_style!r} (use "
                    "ignored_modules to keep a module rank-local)."
                )

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
        if self.parallel_style == plan.HYBRID_SHARD:
            return sharding.default_mesh(device_type, plan.hybrid_mesh_shape(sharding.world_info()[1]))
        return sharding.default_mesh(device_type)

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
        Optimizer state is created (zeros) if the optimizer has none yet. A model on the
        meta device is materialised here (see ``param_init_fn``).
        """
        self.prepare(module, optimizer, None)

    def prepare(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, args: StepArgs | None
    ) -> None:
        single = sharding.world_info()[1] == 1 and self.mesh is None
        if sharding.is_meta_model(module):
            self._materialize(module, optimizer, single)
        if single:
            return
        if all(isinstance(p, sharding.DTensor) for p in module.parameters()):
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
        n = sharding.distribute_state(
            module,
            optimizer,
            mesh,
            lambda fqn, p: plan.placements_for(styles[fqn], mesh, p),
            offload=self._offload(mesh),
        )
        _MESH_OF[module] = mesh
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
        if mesh is not None:
            plan.check_mesh(mesh, self.parallel_style)
        new_of = sharding.materialize_meta(
            module,
            device=device,
            mesh=mesh,
            placements_of=lambda fqn, p: (
                plan.placements_for(styles[fqn], mesh, p) if mesh is not None else None
            ),
            param_init_fn=self.param_init_fn,
            sync_module_states=self.sync_module_states,
            offload=self._offload(mesh),
        )
        sharding.rekey_optimizer(optimizer, new_of, mesh, self._offload(mesh))

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
        if sharding.world_info()[1] == 1 and self.mesh is None:
            return gm  # world size 1: nothing to communicate
        mesh = self._mesh(args.module)
        return _Partitioner(gm, state, args, mesh, self).run()


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


class _Partitioner:
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

    def run(self) -> fx.GraphModule:
        if self.dp.broadcast_buffers:
            self._broadcast_mutated_buffers()
        for name in self.layouts:
            self._gather_param(name)
        self._place_replicated_casts()
        for name in self.offloaded.keys() - self.layouts.keys():
            self._copy_in_replicated(name)
        self._reduce_grads()
        if self.layouts:
            self._globalize_norms()
            self._align_fused_optimizer()
        if self.offloaded:
            self._optimizer_on_cpu()
        self.graph.lint()
        self.gm.recompile()
        self._refresh_vals()
        return self.gm

    # ---------------------------------------------------------------- helpers

    def _first(self, nodes: list[fx.Node]) -> fx.Node:
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        return min(nodes, key=order.__getitem__)

    def _call(
        self,
        target: Any,
        args: tuple[Any, ...],
        like: fx.Node,
        role: Role = Role.COMM,
        kwargs: dict[str, Any] | None = None,
    ) -> fx.Node:
        n = self.graph.call_function(target, args, kwargs)
        copy_meta(n, like, role=role)
        return n

    def _to_dtype(self, x: fx.Node, dtype: torch.dtype, like: fx.Node, role: Role = Role.COMM) -> fx.Node:
        return self._call(aten._to_copy.default, (x,), like, role=role, kwargs={"dtype": dtype})

    def _to_device(self, x: fx.Node, device: torch.device, like: fx.Node, role: Role = Role.COMM) -> fx.Node:
        """A copy of ``x`` on ``device``: host-to-device (non-blocking from pinned memory) or
        device-to-host (blocking: the CPU reads it next; see spmd.parallel.offload)."""
        non_blocking = self.non_blocking and device.type != "cpu"
        kwargs = {"device": device, "non_blocking": non_blocking}
        return self._call(aten._to_copy.default, (x,), like, role=role, kwargs=kwargs)

    # ---------------------------------------------------------------- buffers

    def _broadcast_mutated_buffers(self) -> None:
        """Broadcast, before first use, the buffers some step on this model mutates.

        DDP broadcasts every buffer at every forward; buffers no step ever writes are
        equal on all ranks already, so only the written ones travel. An eval step
        compiled after the train step still broadcasts them (it reads stats that
        drifted apart on each rank during training), as DDP's eval forward does.
        """
        mutated = {m for n in self.graph.nodes for m in mutated_nodes(n)}
        known = _MUTATED_BUFFERS.setdefault(self.args.module, set())
        known.update(name for name, _ in self.state.buffers if self.by_name[name] in mutated)
        for name, _ in self.state.buffers:
            b = self.by_name[name]
            users = list(b.users)
            if name not in known or not users or name in self.ignored_buffers:
                continue
            with self.graph.inserting_before(self._first(users)):
                coll = self._call(C._c10d.broadcast.default, (b, 0, self.group), b)
                wait = self._call(C.WAIT, (coll,), b)
                self._call(aten.copy_.default, (b, wait), b)

    # ---------------------------------------------------------------- params

    def _emit_gather(self, p: fx.Node, name: str, like: fx.Node, dtype: torch.dtype | None = None) -> fx.Node:
        """shard -> (cast to ``dtype``) -> (pad) -> all_gather (shard group) -> wait -> (slice):
        the full parameter."""
        lay, group = self.layouts[name], self.comms[name].shard
        assert group is not None
        x = p
        if dtype is not None:  # mixed precision: cast the shard, gather in the compute dtype
            x = self._to_dtype(x, dtype, like)
            x.meta[CAST_OF] = name
        if name in self.offloaded:  # the shard lives on the CPU: host-to-device next
            x = self._to_device(x, self.offloaded[name], like)
        perm = self.perms.get(name)
        if perm is not None:  # gather in memory order (a view of a channels_last shard)
            x = self._call(aten.permute.default, (x, perm), like)
        if lay.padded:
            pad_rows = lay.chunk - lay.local_rows
            ndim = len(self.params[name].shape)
            x = self._call(aten.constant_pad_nd.default, (x, [0, 0] * (ndim - 1) + [0, pad_rows]), like)
        coll = self._call(C._c10d.all_gather_into_tensor.default, (x, group.size, group.name), like)
        full = self._call(C.WAIT, (coll,), like)
        if lay.padded:
            full = self._call(aten.slice.Tensor, (full, 0, 0, lay.rows), like, role=Role.ACTIVATION)
        if perm is not None:  # back to logical order: the parameter's own strides
            full = self._call(aten.permute.default, (full, layout.inverse(perm)), like, role=Role.ACTIVATION)
        return full

    def _gather_param(self, name: str) -> None:
        """Gather the parameter for each micro-batch's forward and backward readers.

        The shard's direct readers get the fp32 parameter; with mixed precision, the readers
        of the tracer's compute cast get the parameter gathered in the cast's dtype (the cast
        goes away). A step that accumulates gradients over k micro-batches gathers per
        micro-batch, as FSDP does, so no more than one micro-batch's gathered parameters
        live at once.
        """
        p = self.by_name[name]
        cast = self.casts.get(name)
        sources: list[tuple[fx.Node, torch.dtype | None]] = [(p, None)]
        if cast is not None:
            sources.append((cast, cast.meta["val"].dtype))
        for src, dtype in sources:
            by_micro: dict[int, list[fx.Node]] = {}
            for u in src.users:
                if u.meta.get(PHASE) is not Phase.OPTIMIZER and u is not cast:
                    by_micro.setdefault(u.meta.get(MICROBATCH, 0), []).append(u)
            for micro in sorted(by_micro):
                self._gather_for(p, src, name, dtype, by_micro[micro])
        if cast is not None and not cast.users:
            self.graph.erase_node(cast)

    def _gather_for(
        self, p: fx.Node, src: fx.Node, name: str, dtype: torch.dtype | None, users: list[fx.Node]
    ) -> None:
        """Point ``users`` (readers of ``src``) at a gather of shard ``p`` (cast to ``dtype``)."""
        fwd = [u for u in users if u.meta.get(PHASE) is Phase.FORWARD]
        bwd = [u for u in users if u.meta.get(PHASE) is Phase.BACKWARD]
        reshard = self.dp.reshard_after_forward and fwd
        first_fwd_users = fwd if reshard else users
        with self.graph.inserting_before(self._first(first_fwd_users)):
            full = self._emit_gather(p, name, self._first(first_fwd_users), dtype)
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
        first_bwd = self._first(anchors)
        remap: dict[fx.Node, fx.Node] = {}
        with self.graph.inserting_before(first_bwd):
            remap[full] = self._emit_gather(p, name, first_bwd, dtype)
            for d in derived:  # `derived` is in graph order
                if d in needed:
                    remap[d] = self.graph.node_copy(d, lambda n: remap.get(n, n))
                    copy_meta(remap[d], first_bwd, role=Role.ACTIVATION)
        for u in bwd:
            u.replace_input_with(src, remap[full])
        for d in needed:
            for u in list(d.users):
                if is_bwd(u) and u is not remap.get(u):
                    u.replace_input_with(d, remap[d])

    def _place_replicated_casts(self) -> None:
        """Move the compute casts of replicated parameters to just before their first reader.

        The tracer casts every parameter up front; each copy need only live from its first use.
        """
        for name, cast in self.casts.items():
            if name in self.layouts or not cast.users:
                continue
            self._first(list(cast.users)).prepend(cast)

    def _copy_in_replicated(self, name: str) -> None:
        """An offloaded parameter that is not sharded (0-d): copy it to the device once,
        before its first forward/backward use."""
        p = self.by_name[name]
        users = [u for u in p.users if u.meta.get(PHASE) is not Phase.OPTIMIZER]
        if not users:
            return
        first = self._first(users)
        with self.graph.inserting_before(first):
            on_device = self._to_device(p, self.offloaded[name], first)
        for u in users:
            u.replace_input_with(p, on_device)

    def _optimizer_on_cpu(self) -> None:
        """Point factory ops of the optimizer region at the CPU, where offloaded state lives.

        The trace saw the optimizer on the device; after offload it reads CPU shards, CPU
        gradients and CPU state, so a tensor it creates with ``device=<the device>`` (none
        in SGD/Adam/AdamW/clip_grad_norm_ on torch 2.13, but a custom step may) goes to the CPU.
        """
        devices = {d.type for d in self.offloaded.values()}
        for n in self.graph.nodes:
            if n.meta.get(PHASE) is not Phase.OPTIMIZER or n.meta.get(ROLE) is Role.COMM:
                continue
            dev = n.kwargs.get("device")
            if isinstance(dev, torch.device) and dev.type in devices:
                n.kwargs = {**n.kwargs, "device": CPU}

    # ---------------------------------------------------------------- grads

    def _reduce_grads(self) -> None:
        """Reduce every gradient as its parameter's plan says; ignored ones keep their tag.

        Sharded: reduce-scatter (avg) over the shard group at the tag. Then, for a replicate
        dimension, all-reduce (avg) over the replicate group: for a replicated parameter at the
        tag; after a reduce-scatter (hybrid_shard), right after its wait, which goes to the
        first node that computes with the gradient (past the detaches and views that only pass
        it on), so that the reduce-scatters stay adjacent in the collective order, and so do
        the all-reduces: bucketing merges each run. A rank-local gradient's tag stays, an
        identity that ``strip_grad_tags`` removes.
        """
        tags = [n for n in self.graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]
        for tag in tags:
            name = tag.args[1]
            g = tag.args[0]
            users = list(tag.users)
            comm = self.comms[name]
            if comm.local_only:
                continue
            sharded = comm.shard is not None
            perm = None if sharded else layout.memory_order(self.by_name[name].meta["val"])
            grad_dtype = g.meta["val"].dtype
            with self.graph.inserting_before(tag):
                send = self._to_reduce_dtype(g, tag)
                if sharded:
                    coll = self._emit_reduce_scatter(send, name, tag)
                else:
                    assert comm.reduce is not None
                    # In memory order: the reduced gradient keeps the parameter's strides (a
                    # fused optimizer reads a channels_last parameter and its gradient as flat
                    # memory; the functional all-reduce returns a contiguous tensor).
                    if perm is not None:
                        send = self._call(aten.permute.default, (send, perm), tag)
                    coll = self._call(C._c10d.all_reduce.default, (send, "avg", comm.reduce.name), tag)
            # The wait (and the un-padding slice) sits just before the gradient's first use.
            anchor = self._first(users) if users else tag.next
            if sharded and comm.reduce is not None and users:
                anchor = self._sink_pass_through_users(tag)
            with self.graph.inserting_before(anchor):
                res = self._call(C.WAIT, (coll,), tag)
                if sharded and comm.reduce is not None:
                    # On the padded shard: the same shape on every rank (uneven shards differ).
                    ar = self._call(C._c10d.all_reduce.default, (res, "avg", comm.reduce.name), tag)
                    res = self._call(C.WAIT, (ar,), tag)
                if sharded and self.layouts[name].padded:
                    res = self._call(aten.slice.Tensor, (res, 0, 0, self.layouts[name].local_rows), tag)
                if sharded and name in self.perms:  # reduced in memory order: back to logical
                    res = self._call(aten.permute.default, (res, layout.inverse(self.perms[name])), tag)
                if not sharded and perm is not None:
                    res = self._call(aten.permute.default, (res, layout.inverse(perm)), tag)
                if name in self.offloaded:  # the optimizer runs on the CPU: device-to-host
                    res = self._to_device(res, CPU, tag)
                if send is not g:  # reduced in another dtype: back to the optimizer's
                    res = self._to_dtype(res, grad_dtype, tag)
            res.meta[ROLE] = Role.GRAD
            res.meta[GRAD_OF] = name
            tag.replace_all_uses_with(res)
            self.graph.erase_node(tag)
            # A bypassed upcast (and autograd's detach of it) is now dead.
            dead = g
            while (
                dead is not send
                and not dead.users
                and dead.target in (aten.detach.default, aten._to_copy.default)
            ):
                up = dead.args[0]
                self.graph.erase_node(dead)
                if not isinstance(up, fx.Node):
                    break
                dead = up

    def _to_reduce_dtype(self, g: fx.Node, like: fx.Node) -> fx.Node:
        """The gradient as the reduction sends it: ``g``, or ``g`` cast to the reduce dtype.

        Where ``g`` is itself an upcast of a gradient in the reduce dtype (autograd's cast
        back through a bf16 compute copy), that gradient is sent directly: casting it up
        and down again is the identity.
        """
        rd = self.reduce_dtype
        if rd is None or g.meta["val"].dtype == rd:
            return g
        up = g
        while up.target is aten.detach.default and isinstance(up.args[0], fx.Node):
            up = up.args[0]  # autograd hands over p.grad detached
        if up.target is aten._to_copy.default:
            src = up.args[0]
            if isinstance(src, fx.Node) and src.meta["val"].dtype == rd and _widens(rd, g.meta["val"].dtype):
                return src
        return self._to_dtype(g, rd, like)

    def _sink_pass_through_users(self, tag: fx.Node) -> fx.Node:
        """Move the ops that only pass ``tag`` on (detach, views) to just before the first node
        that computes with it; return the first node now reading the gradient.

        Legal: those ops read nothing but the gradient (or each other), so they can run as
        late as their first real consumer.
        """
        chain, members, stack = [], {tag}, [tag]
        while stack:
            for u in stack.pop().users:
                if u in members or u.op != "call_function" or u.target not in PASS_THROUGH_OPS:
                    continue
                if all(i in members for i in u.all_input_nodes):
                    members.add(u)
                    chain.append(u)
                    stack.append(u)
        real = [u for n in members for u in n.users if u not in members]
        if not real:
            return self._first(list(tag.users))
        first = self._first(real)
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        moved = sorted((n for n in chain if order[n] < order[first]), key=order.__getitem__)
        for n in moved:
            first.prepend(n)
        return self._first(list(tag.users))

    def _emit_reduce_scatter(self, g: fx.Node, name: str, like: fx.Node) -> fx.Node:
        """full gradient -> (pad to W * chunk rows) -> reduce_scatter(avg) over the shard group."""
        lay, group = self.layouts[name], self.comms[name].shard
        assert group is not None
        x = g
        if name in self.perms:  # reduce in memory order, as the parameter was gathered
            x = self._call(aten.permute.default, (x, self.perms[name]), like)
        if lay.padded:
            pad = [0, 0] * (len(self.params[name].shape) - 1) + [0, lay.chunk * group.size - lay.rows]
            x = self._call(aten.constant_pad_nd.default, (x, pad), like)
        return self._call(C._c10d.reduce_scatter_tensor.default, (x, "avg", group.size, group.name), like)

    # ---------------------------------------------------------------- optimizer region

    def _globalize_norms(self) -> None:
        """Make norms over sharded gradients global: ``norm = allreduce(local_norm ** p) ** (1/p)``.

        Walks the graph from the sharded tensors (gradients, parameter and state shards)
        through elementwise ops; a norm of a shard becomes global, and any other op on a
        shard is an error (it would silently compute on part of the tensor).
        """
        sharded: set[fx.Node] = set()
        for name in self.layouts:
            sharded.add(self.by_name[name])
        for n in self.graph.nodes:
            if n.meta.get(ROLE) is Role.GRAD and n.meta.get(GRAD_OF) in self.layouts:
                sharded.add(n)
        for n in list(self.graph.nodes):
            # Gradients reach the optimizer through autograd's detach (any phase); the
            # partitioner's own pads and collectives read shards legitimately.
            if n.op != "call_function" or n.meta.get(ROLE) is Role.COMM:
                continue
            ins = _inputs(n)
            if not any(i in sharded for i in ins):
                continue
            if n.target is aten.linalg_vector_norm.default:
                self._globalize(n, n.args[1] if len(n.args) > 1 else n.kwargs.get("ord", 2))
            elif n.target is aten._foreach_norm.Scalar:
                ord_ = n.args[1] if len(n.args) > 1 else 2
                for u in list(n.users):
                    idx = u.args[1]
                    if n.args[0][idx] in sharded:
                        self._globalize(u, ord_)
            elif _elementwise(n):
                sharded.add(n)
            else:
                raise TraceError(
                    f"spmd fully_shard: the optimizer region applies {n.target} to sharded tensors "
                    f"(node {n.name}); only elementwise ops, foreach/fused optimizer kernels and norms are "
                    "supported on shards. Use DataParallel('replicate') for this step, or move the op "
                    "before loss.backward()."
                )

    def _align_fused_optimizer(self) -> None:
        """Feed fused optimizer kernels shards that sit where the full tensor's elements sit.

        CPU fused kernels (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``) run a SIMD
        loop with a scalar tail, and the two round differently (fused multiply-add). On the
        full tensor an element takes the SIMD path iff its index is below ``n - n % V``; on a
        shard it depends on the shard's own size. Where a shard does not start at a multiple
        of ``_ALIGN`` elements, or ends early, its elements would round differently from
        DDP's. Those shards are copied into a zero-padded buffer that covers the same global
        index range rounded out to ``_ALIGN`` (up to ``n`` when the shard holds the tensor's
        tail), the kernel runs on the buffers, and the results are copied back. Shards that
        are aligned already (the common case: rows of a multiple of 64 elements) cost nothing.
        """
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target not in _FUSED_OPTIMIZERS:
                continue
            schema = node.target._schema
            n_params = len(node.args[0])
            per_param = [
                i
                for i, a in enumerate(schema.arguments)
                if a.name in _PER_PARAM_LISTS and i < len(node.args) and len(node.args[i]) == n_params
            ]
            written = {i for i in per_param if schema.arguments[i].alias_info is not None}
            written.discard(1)  # grads: scratch, nothing to copy back
            args = [list(a) if isinstance(a, list | tuple) else a for a in node.args]
            copy_backs: list[tuple[fx.Node, fx.Node, int, int, list[int], list[int] | None]] = []
            for k, p in enumerate(node.args[0]):
                name = p.meta.get(STATE_NAME) if isinstance(p, fx.Node) else None
                lay = self.layouts.get(name) if name is not None else None
                if name is None or lay is None:
                    continue
                shape = self.params[name].shape
                row = math.prod(shape[1:])
                total, off, n_loc = lay.rows * row, lay.offset * row, lay.local_rows * row
                if off % _ALIGN == 0 and (n_loc % _ALIGN == 0 or off + n_loc == total):
                    continue
                pre = off % _ALIGN
                end = -(-(off + n_loc) // _ALIGN) * _ALIGN if off + n_loc <= total - total % _ALIGN else total
                post = end - (off - pre) - pre - n_loc
                # Flatten in memory order (the kernel DDP runs walks the full tensor's memory).
                perm = self.perms.get(name)
                local_shape = [lay.local_rows, *shape[1:]]
                with self.graph.inserting_before(node):
                    for i in per_param:
                        t = args[i][k]
                        src = t
                        if perm is not None:
                            src = self._call(aten.permute.default, (t, perm), node, role=Role.UPDATE)
                        flat = self._call(aten.reshape.default, (src, [-1]), node, role=Role.UPDATE)
                        buf = self._call(
                            aten.constant_pad_nd.default, (flat, [pre, post]), node, role=Role.UPDATE
                        )
                        args[i][k] = buf
                        if i in written:
                            copy_backs.append((t, buf, pre, n_loc, local_shape, perm))
            if not copy_backs:
                continue
            node.args = tuple(args)
            anchor = node
            for t, buf, pre, n_loc, local_shape, perm in copy_backs:
                with self.graph.inserting_after(anchor):
                    piece = self._call(aten.slice.Tensor, (buf, 0, pre, pre + n_loc), node, role=Role.UPDATE)
                with self.graph.inserting_after(piece):
                    view_shape = [local_shape[d] for d in perm] if perm is not None else local_shape
                    shaped = self._call(aten.view.default, (piece, view_shape), node, role=Role.UPDATE)
                if perm is not None:
                    with self.graph.inserting_after(shaped):
                        shaped = self._call(
                            aten.permute.default, (shaped, layout.inverse(perm)), node, role=Role.UPDATE
                        )
                with self.graph.inserting_after(shaped):
                    anchor = self._call(aten.copy_.default, (t, shaped), node, role=Role.UPDATE)

    def _globalize(self, norm: fx.Node, ord_: Any) -> None:
        users = list(norm.users)
        # Offloaded gradients have CPU norms; the collective runs on the device (NCCL has no CPU).
        device = next(iter(self.offloaded.values()), None)
        with self.graph.inserting_before(norm.next):

            def reduce(x: fx.Node, op: str) -> fx.Node:
                if device is not None:
                    x = self._to_device(x, device, norm)
                wait = self._call(
                    C.WAIT, (self._call(C._c10d.all_reduce.default, (x, op, self.shard_group), norm),), norm
                )
                return wait if device is None else self._to_device(wait, CPU, norm, role=Role.UPDATE)

            if ord_ in (float("inf"), "inf"):
                out = reduce(norm, "max")
            else:
                p = float(ord_)
                powed = self._call(aten.pow.Tensor_Scalar, (norm, p), norm, role=Role.UPDATE)
                out = self._call(
                    aten.pow.Tensor_Scalar, (reduce(powed, "sum"), 1.0 / p), norm, role=Role.UPDATE
                )
        for u in users:
            u.replace_input_with(norm, out)

    # ---------------------------------------------------------------- metadata

    def _refresh_vals(self) -> None:
        """Recompute ``meta['val']`` for the local shapes (keeps the val invariant true)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        # detach: an ignored parameter is a plain leaf that requires grad; the graph updates it in place.
        real = [
            sharding.local(t).detach() for t in self.state.tensors(self.args.optimizer)
        ] + self.args.tensors
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(t) for t in real]
        try:
            FakeTensorProp(self.gm, mode).propagate_dont_convert_inputs(*fakes)
        except Exception as exc:  # noqa: BLE001
            raise TraceError(
                f"spmd {self.dp.parallel_style}: the partitioned graph does not type-check on the local "
                f"shapes: {exc}. Some op of the step is not shape-agnostic on shards; try "
                "DataParallel('replicate')."
            ) from exc


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every ``src`` value is exactly a ``dst`` value (bf16/fp16 -> fp32, fp32 -> fp64)."""
    return dst in (torch.float32, torch.float64) and dst.itemsize > src.itemsize


def _inputs(n: fx.Node) -> list[fx.Node]:
    return list(n.all_input_nodes)


def _elementwise(n: fx.Node) -> bool:
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return t.__name__ == "getitem" if callable(t) else False
    name = t._schema.name
    if torch.Tag.pointwise in t.tags or "_foreach_" in name or "_fused_" in name:
        return True
    return t in (
        aten.clone.default,
        aten.detach.default,
        aten.copy_.default,
        aten.zero_.default,
        aten.fill_.Scalar,
    )


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
        if isinstance(n.target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in n.target.tags or mutated_nodes(n)
        ):
            continue
        ok.add(n)
        out.append(n)
        todo.extend(n.users)
    return out
