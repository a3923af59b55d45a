"""``DTensorExpandMode``: expand the traced step op by op with DTensor's sharding propagation.

The traced graph has single-device semantics on the *global* batch (``trace_args``
turns each rank's local batch into a DTensor of the global shape, so every shape the
trace bakes in, e.g. a ``view(b, t, h, d)``, is the global one; on mesh dimensions of
local batch semantics, the default, it is each rank's own batch there, as DDP). ``partition`` then
runs that graph once more, under ``make_fx``, on DTensors that carry the declared
placements: every aten op goes through DTensor's own dispatcher, which asks the op's
registered sharding strategy for the output placement, redistributes inputs the
strategy cannot take as they are (all-gather, all-reduce, reduce-scatter, all-to-all:
traced as ``_c10d_functional`` collectives) and runs the op on the local tensors with
local shape arguments. What ``make_fx`` records is the graph one rank runs: local
tensors, collectives explicit, so the dump shows them and the pass pipeline (dedup,
bucketing, wait placement, rank agreement) applies as for ``DataParallel``.

Where the expansion decides itself, rather than DTensor:

* a gradient (``spmd::tag_grad``) is redistributed to its parameter's placements at
  the tag, when autograd produces it, as DDP reduces in backward; a ``Partial``
  gradient becomes an all-reduce (sum) or a reduce-scatter. On the mesh dimensions of
  local batch semantics (the default, DDP's: see ``batch_semantics``) the inputs are
  each rank's own batch, DTensor expands on the sub-mesh of the other dimensions, and
  each gradient is multiplied by ``1 / degree`` and all-reduced (sum) there, as DDP's
  reducer. The collective's wait then becomes the gradient (its tag goes), so
  the gradients' collectives are adjacent and the bucketing pass merges them.
* a mesh made from a named shape is flattened too, so DTensor reduces a value partial
  over every dimension with one all-reduce instead of one per dimension.
* a graph output keeps its placement; the step returns its local tensor (for a
  ``Partial(avg)`` loss over a batch-sharded input: this rank's local loss, as DDP).
* factory ops (``arange``, ``zeros``) and other plain tensors are replicated
  (DTensor's ``implicit_replication``): they are computed alike on every rank.
* ops torch has no strategy for get one in :mod:`spmd.parallel.expand_rules`; an
  attention op's ``attn_mask`` keyword is redistributed here to follow q, as DTensor
  never redistributes keyword arguments.
* the nodes of an ``Override`` stand-in that declared placements
  (``Override.placements``) run on local tensors, as ``local_map`` would run them.
* any failure at a node (no strategy, a redistribution DTensor cannot do) is a
  :class:`~spmd.errors.ShardingPropagationError` naming the op, module, source line and
  the placements of its inputs.

Each new node finds the traced node it was recorded for through ``meta["custom"]``,
which ``make_fx`` copies from the node the interpreter is running
(``fx.traceback.preserve_node_meta``); roles, phases and module paths come from there.

Placements are recorded on every node of the partitioned graph
(``node.meta["spmd_expand_placements"]``), and on parameter placeholders in the
``passes.meta.PLACEMENT`` words the dump prints.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from passes import torch_compat
from spmd.errors import ConfigError, ShardingPropagationError
from spmd.frontend import optim as optim_utils
from spmd.parallel import gloo_group, sharding
from spmd.parallel.base import OVERRIDE_PLACEMENTS, ParallelMode
from spmd.parallel.expand_graph import expand_graph

if TYPE_CHECKING:
    from spmd.frontend.step_inputs import LiftedState, StepArgs

log = logging.getLogger("spmd")


# model -> the mesh it was distributed on
_MESH_OF: weakref.WeakKeyDictionary[nn.Module, DeviceMesh] = weakref.WeakKeyDictionary()

PlacementSpec = Placement | Sequence[Placement]


# Mesh dimension names that mean "data parallel" (the default input placement shards on it).
_DP_NAMES = ("dp", "data", "replicate", "batch")


@dataclasses.dataclass(frozen=True)
class DTensorExpandMode(ParallelMode):
    """Tensor and data parallelism from declared placements, expanded by DTensor's propagation.

    Args:
        mesh: a ``DeviceMesh``; or a shape, as a tuple (``(2, 2)``) or a dict of dimension
            names to sizes (``{"dp": 2, "tp": 2}``; one size may be -1, "the rest", as in
            ``{"dp": -1, "tp": 2}``), made over every rank of the default group (row-major:
            the last dimension's ranks are consecutive). Default: a 1-D mesh of all ranks
            (pure data parallelism).
        input_placements: the placements of the step's tensor arguments on the mesh, one
            tuple (one Placement per mesh dimension) for all of them, or a list with one
            per tensor argument. Each rank passes its *local* piece (its batch shard, as
            with DDP; ranks that replicate an input pass the same data). Default:
            ``Shard(0)`` on the data-parallel mesh dimension (named ``"dp"``/``"data"``/
            ``"replicate"``/``"batch"``, else dimension 0), ``Replicate()`` elsewhere.
        param_placements: ``{fqn pattern: placements}``: parameters whose fully qualified
            name matches the ``fnmatch`` pattern (``"blocks.*.fc.weight"``) take these
            placements (one per mesh dimension; a single Placement on a 1-D mesh). The
            first matching pattern wins; parameters nobody matches are ``Replicate()``. A tied
            parameter takes the placements of its first name (``named_parameters()`` order).
            Optimizer state shaped like a parameter follows it.
        custom_passes: extra ``gm -> gm`` functions run on the expanded graph, in order,
            before the built-in pass pipeline.
        batch_semantics: ``"local"`` (default; DDP's): on a mesh dimension that is exactly data
            parallelism (some input is ``Shard(0)`` there, no input is split on another dimension
            or partial, every parameter is ``Replicate()``), each rank runs the step on its own
            batch, as DDP does: BatchNorm takes this rank's statistics, a mean loss is this
            rank's mean, and every gradient is multiplied by ``1 / degree`` and all-reduced
            (sum) at its tag, after accumulation onto an old ``p.grad``: DDP's order. DTensor
            expands on the sub-mesh of the other dimensions, so it never communicates over a
            local one; elsewhere (``tp``, sequence sharding) the expansion is DTensor's.
            ``"global"``: the step means the global batch there too (DTensor's propagation:
            BatchNorm takes the statistics of the global batch, as ``SyncBatchNorm``; a mean
            loss divides by the global count; an old ``p.grad`` is added after the new
            gradient's reduction); equal to DDP only up to rounding, bit for bit for
            power-of-two degrees without BatchNorm.
    """

    mesh: Any = None
    _: dataclasses.KW_ONLY
    input_placements: Any = None
    param_placements: Mapping[str, PlacementSpec] | None = None
    custom_passes: Sequence[Any] = ()
    batch_semantics: str = "local"

    def __post_init__(self) -> None:
        m = self.mesh
        if not (m is None or isinstance(m, DeviceMesh | tuple | list | dict)):
            raise ConfigError(
                "spmd.DTensorExpandMode: mesh must be a DeviceMesh, a shape tuple such as (2, 2) or a "
                f"dict of dimension names to sizes such as {{'dp': 2, 'tp': 2}}, got {type(m).__name__}."
            )
        if isinstance(m, dict) and not all(isinstance(k, str) and isinstance(v, int) for k, v in m.items()):
            raise ConfigError(f"spmd.DTensorExpandMode: a dict mesh maps names to sizes, got {m!r}.")
        if self.param_placements is not None:
            if not isinstance(self.param_placements, Mapping):
                raise ConfigError(
                    "spmd.DTensorExpandMode: param_placements must be a dict {fqn pattern: placements}, "
                    f"got {type(self.param_placements).__name__}."
                )
            for pat, pl in self.param_placements.items():
                if not isinstance(pat, str):
                    raise ConfigError(f"spmd.DTensorExpandMode: param_placements key {pat!r} is not a str.")
                _as_placements(pl, f"param_placements[{pat!r}]")
        ip = self.input_placements
        if ip is not None and not isinstance(ip, Placement | list | tuple):
            raise ConfigError(
                "spmd.DTensorExpandMode: input_placements must be a tuple of Placements (one per mesh "
                f"dimension) or a list of such tuples, got {ip!r}."
            )
        if self.batch_semantics not in ("local", "global"):
            raise ConfigError(
                "spmd.DTensorExpandMode: batch_semantics must be 'local' (each rank's own batch, as "
                f"DDP) or 'global' (the global batch, as SyncBatchNorm), got {self.batch_semantics!r}."
            )
        for f in self.custom_passes:
            if not callable(f):
                raise ConfigError(
                    f"spmd.DTensorExpandMode: custom_passes items must be callables, got {f!r}."
                )

    # ------------------------------------------------------------------ mesh and placements

    def device_mesh(self, module: nn.Module | None = None) -> DeviceMesh:
        """The mesh of this mode (made on first use from a shape)."""
        if module is not None and module in _MESH_OF:
            return _MESH_OF[module]
        if isinstance(self.mesh, DeviceMesh):
            return self.mesh
        device_type = "cpu"
        if module is not None:
            p0 = next(module.parameters(), None)
            if p0 is not None and not p0.is_meta:
                device_type = sharding.local(p0).device.type
        if self.mesh is None:
            return sharding.default_mesh(device_type)
        if isinstance(self.mesh, dict):
            shape, names = tuple(self.mesh.values()), tuple(self.mesh.keys())
        else:
            shape, names = tuple(self.mesh), None
        shape = _fill_shape(shape, sharding.world_info()[1])

        def make() -> DeviceMesh:
            mesh = gloo_group.init_mesh(device_type, shape, names)
            if names is not None and len(names) > 1:
                # A flattened dimension lets DTensor reduce a value partial over every dimension
                # with one all-reduce instead of one per dimension.
                gloo_group.flatten(mesh[names])
            return mesh

        # Cached with sharding's default meshes, which are dropped with their process group.
        return sharding.cached_mesh(device_type, ("expand", shape, names), make)

    def _param_placements(self, fqn: str, mesh: DeviceMesh) -> tuple[Placement, ...]:
        for pat, pl in (self.param_placements or {}).items():
            if fnmatch.fnmatchcase(fqn, pat):
                return _check_ndim(
                    _as_placements(pl, f"param_placements[{pat!r}]"), mesh, f"parameter {fqn!r}"
                )
        return (Replicate(),) * mesh.ndim

    def _input_placements(self, i: int, n: int, mesh: DeviceMesh) -> tuple[Placement, ...]:
        ip = self.input_placements
        if ip is None:
            dp = 0
            names = mesh.mesh_dim_names or ()
            for k, name in enumerate(names):
                if name in _DP_NAMES:
                    dp = k
                    break
            return tuple(Shard(0) if k == dp else Replicate() for k in range(mesh.ndim))
        if isinstance(ip, Placement) or (
            isinstance(ip, tuple | list) and ip and isinstance(ip[0], Placement)
        ):
            return _check_ndim(_as_placements(ip, "input_placements"), mesh, "input_placements")
        if len(ip) != n:
            raise ConfigError(
                f"spmd.DTensorExpandMode: input_placements has {len(ip)} entries but the step takes {n} "
                "tensor arguments; give one tuple of placements per tensor argument, or one for all."
            )
        return _check_ndim(_as_placements(ip[i], f"input_placements[{i}]"), mesh, f"input_placements[{i}]")

    def _local_dims(self, module: nn.Module, n_inputs: int, mesh: DeviceMesh) -> tuple[int, ...]:
        """The mesh dimensions of local batch semantics: some input is sharded there, none is
        partial, and every parameter is replicated (pure data parallelism on that dimension)."""
        if self.batch_semantics != "local" or n_inputs == 0:
            return ()
        ins = [self._input_placements(i, n_inputs, mesh) for i in range(n_inputs)]
        params = [_placements_of(p) or (Replicate(),) * mesh.ndim for p in module.parameters()]
        # Exactly data parallelism: the batch dimension (0) of some input is split there, no input
        # is split on another dimension (sequence parallelism) or partial, no parameter is split.
        return tuple(
            k
            for k in range(mesh.ndim)
            if any(isinstance(pl[k], Shard) for pl in ins)
            and all(isinstance(pl[k], Replicate) or _is_batch_shard(pl[k]) for pl in ins)
            and all(isinstance(pl[k], Replicate) for pl in params)
        )

    def _single(self) -> bool:
        """Whether the step runs on one device: world size 1 without an explicit DeviceMesh
        (a shape must then have one rank; the same script runs under plain ``python``)."""
        if isinstance(self.mesh, DeviceMesh) or sharding.world_info()[1] != 1:
            return False
        if self.mesh is not None:
            shape = tuple(self.mesh.values()) if isinstance(self.mesh, dict) else tuple(self.mesh)
            _fill_shape(shape, 1)
        return True

    # ------------------------------------------------------------------ ParallelMode

    def prepare(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None, args: StepArgs | None
    ) -> None:
        if module in _MESH_OF and all(isinstance(p, DTensor) for p in module.parameters()):
            return
        if module not in _MESH_OF and any(isinstance(p, DTensor) for p in module.parameters()):
            raise ConfigError(
                "spmd.DTensorExpandMode: the model's parameters are DTensors already, distributed by another "
                "parallel mode (e.g. DataParallel) or by hand. Give DTensorExpandMode a freshly built model: "
                "it places every parameter itself from param_placements."
            )
        if self._single():
            return
        mesh = self.device_mesh(module)
        if optimizer is not None:
            optim_utils.ensure_state(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
        # Every placement is checked before any parameter changes: a bad one leaves the model as it was.
        placements: dict[int, tuple[Placement, ...]] = {}
        for fqn, p in module.named_parameters():
            if not isinstance(p, DTensor):
                placements[id(p)] = self._param_placements(fqn, mesh)
                _check_dims(f"parameter {fqn!r}", p.shape, placements[id(p)])
        new_of: dict[int, nn.Parameter] = {}
        for _, mod in module.named_modules(remove_duplicate=False):
            for name, p in list(torch_compat.module_parameters(mod).items()):
                if p is None or isinstance(p, DTensor):
                    continue
                if id(p) not in new_of:
                    dt = distribute_tensor(p.detach(), mesh, placements[id(p)], src_data_rank=None)
                    new_of[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
                torch_compat.module_parameters(mod)[name] = new_of[id(p)]
        sharding.rekey_optimizer(optimizer, new_of, mesh)
        _MESH_OF[module] = mesh
        log.info("spmd: DTensorExpandMode distributed %d parameters on %s", len(new_of), mesh)

    def trace_args(self, args: StepArgs) -> StepArgs:
        """The step's arguments as the single-device trace sees them: global shapes.

        Each tensor argument becomes a DTensor of its placements over this rank's local
        tensor (no communication: every rank passes an equal-sized local piece), whose
        shape is the global one the trace bakes in.
        """
        if self._single():
            return args
        mesh = self.device_mesh(args.module)
        leaves = list(args.leaves)
        n = len(args.tensor_positions)
        local_dims = self._local_dims(args.module, n, mesh)
        for i, pos in enumerate(args.tensor_positions):
            t = leaves[pos]
            pl = self._input_placements(i, n, mesh)
            _check_dims(f"argument #{i} (a tensor argument of the step)", t.shape, pl)
            pl = _replicate_on(pl, local_dims)
            leaves[pos] = DTensor.from_local(t, mesh, pl, run_check=False)
        return dataclasses.replace(args, leaves=leaves)

    def partition(self, gm: fx.GraphModule, state: LiftedState, args: StepArgs) -> fx.GraphModule:
        if self._single():
            return gm
        mesh = self.device_mesh(args.module)
        n = len(args.tensor_positions)
        local_dims = self._local_dims(args.module, n, mesh)
        in_specs = [_placements_of(t) for t in state.tensors(args.optimizer)]
        # Declared placements, on the full mesh: expand_graph drops (or replicates) the local dimensions.
        in_specs += [self._input_placements(i, n, mesh) for i in range(n)]
        reals = [sharding.local(t) for t in state.tensors(args.optimizer)] + args.tensors
        param_pl = {name: _placements_of(p) for name, p in state.params}
        regions = {
            fqn: _override_placements(fqn, pl, mesh)
            for fqn, m in args.module.named_modules()
            if (pl := getattr(m, OVERRIDE_PLACEMENTS, None)) is not None
        }
        if local_dims:
            log.info(
                "spmd: DTensorExpandMode: local batch semantics (DDP's) on mesh dimensions %s", local_dims
            )
        out = expand_graph(gm, mesh, reals, in_specs, param_pl, regions, local_dims)
        for f in self.custom_passes:
            res = f(out)
            out = res if isinstance(res, fx.GraphModule) else out
        return out

    def pass_options(self) -> dict[str, Any]:
        return {"bucket_mode": "size"}


def _fill_shape(shape: tuple[int, ...], world: int) -> tuple[int, ...]:
    """``shape`` with a -1 size replaced by what fills ``world``; checks the product."""
    known = math.prod(s for s in shape if s != -1)
    if shape.count(-1) == 1 and known > 0 and world % known == 0:
        shape = tuple(world // known if s == -1 else s for s in shape)
    if math.prod(shape) != world or any(s < 1 for s in shape):
        raise ConfigError(
            f"spmd.DTensorExpandMode: mesh shape {shape} does not fit the default process group's {world} "
            "ranks. Give sizes that multiply to the world size (one of them may be -1: the rest)."
        )
    return shape


def _as_placements(pl: Any, what: str) -> tuple[Placement, ...]:
    if isinstance(pl, Placement):
        return (pl,)
    if isinstance(pl, tuple | list) and all(isinstance(x, Placement) for x in pl) and pl:
        return tuple(pl)
    raise ConfigError(
        f"spmd.DTensorExpandMode: {what} must be a Placement or a tuple of Placements (one per mesh "
        f"dimension, e.g. (Replicate(), Shard(0))), got {pl!r}."
    )


def _check_ndim(
    pl: tuple[Placement, ...], mesh: DeviceMesh, what: str, *, allow_partial: bool = False
) -> tuple[Placement, ...]:
    if len(pl) != mesh.ndim:
        raise ConfigError(
            f"spmd.DTensorExpandMode: {what} gives {len(pl)} placements {list(pl)} but the mesh has "
            f"{mesh.ndim} dimensions {mesh.mesh_dim_names or ''}; give one placement per mesh dimension."
        )
    if not allow_partial and any(isinstance(p, Partial) for p in pl):
        raise ConfigError(f"spmd.DTensorExpandMode: {what}: state cannot be Partial ({list(pl)}).")
    return pl


def _override_placements(fqn: str, pl: Any, mesh: DeviceMesh) -> tuple[tuple[Placement, ...], ...]:
    what = f"Override.placements({fqn!r})"
    if not isinstance(pl, tuple | list) or len(pl) != 2:
        raise ConfigError(
            f"spmd.DTensorExpandMode: {what} must return (input_placements, output_placements) or None, "
            f"got {pl!r}."
        )
    return tuple(
        _check_ndim(_as_placements(x, what), mesh, f"{what}[{i}]", allow_partial=i == 1)
        for i, x in enumerate(pl)
    )


def _check_dims(what: str, shape: torch.Size, pl: tuple[Placement, ...]) -> None:
    """Raise :class:`ShardingPropagationError` unless every ``Shard(d)`` names a dimension of ``shape``."""
    for p in pl:
        if isinstance(p, Shard):
            d = p.dim if p.dim >= 0 else p.dim + len(shape)
            if not 0 <= d < len(shape):
                raise ShardingPropagationError(
                    f"spmd.DTensorExpandMode: {what} of shape {tuple(shape)} cannot take "
                    f"{list(pl)}: it has no dimension {p.dim}. Shard one of its {len(shape)} dimensions."
                )


def _replicate_on(pl: tuple[Placement, ...], dims: Sequence[int]) -> tuple[Placement, ...]:
    """``pl`` with ``Replicate()`` on ``dims``: there each rank's piece is its whole batch (DDP's
    local semantics), so DTensor computes on it without communication."""
    return tuple(Replicate() if k in dims else p for k, p in enumerate(pl))


def _is_batch_shard(p: Placement) -> bool:
    return type(p) is Shard and p.dim == 0


def _placements_of(t: torch.Tensor) -> tuple[Placement, ...] | None:
    return tuple(t.placements) if isinstance(t, DTensor) else None


def _style(self: DTensorExpandMode) -> str:
    mesh = self.mesh
    if isinstance(mesh, DeviceMesh):
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        return "dtensor_expand (" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")"
    if isinstance(mesh, dict):
        return "dtensor_expand (" + ", ".join(f"{n}={s}" for n, s in mesh.items()) + ")"
    return f"dtensor_expand {tuple(mesh)}" if mesh is not None else "dtensor_expand"


DTensorExpandMode.parallel_style = property(_style)  # type: ignore[attr-defined]
