"""The model's and optimizer's state in its distributed form: DTensors on a device mesh.

After the first data-parallel call every parameter is an ``nn.Parameter`` holding a
``DTensor`` (``Replicate()`` or ``Shard(0)`` on a 1-D mesh; ``(Replicate(), Shard(0))``
on a hybrid 2-D mesh), as FSDP2 leaves it, and optimizer state tensors shaped like
their parameter follow its placement; scalar state (``step``) stays a plain tensor.
Ignored parameters stay plain tensors. The compiled graph works on the local tensors;
``full_tensor()``, ``state_dict()`` and DCP see the DTensors.

A ``Shard(0)`` local tensor follows ``torch.chunk`` over the sharding mesh dimension:
rank ``r`` of it holds rows ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / W)`` (so the
last ranks may hold fewer rows, or none). The graph pads each local shard to ``c`` rows
for the collectives and slices the padding off again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from passes import torch_compat
from passes.torch_compat import DTensorSpec, TensorMeta
from passes.torch_compat import StridedShard as _StridedShard
from spmd.errors import ConfigError
from spmd.parallel import gloo_group
from spmd.parallel.offload import CPUOffloadPolicy, to_host

log = logging.getLogger("spmd")


def world_info() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# (device type, id(default group), world, shape, names) -> (that default group, its mesh). The group
# is kept and compared: a default group made after another was destroyed may get the same id.
_DEFAULT_MESHES: dict[tuple[Any, ...], tuple[Any, DeviceMesh]] = {}


def default_mesh(
    device_type: str, shape: Sequence[int] | None = None, names: Sequence[str] | None = None
) -> DeviceMesh:
    """A mesh over every rank of the default process group: 1-D, or ``shape`` (replicate, shard),
    or ``shape`` with its dimension ``names``.

    Made once per device type, shape and default group: a group destroyed and initialised
    again (tests, ``spmd.simulate``) gets a new mesh.
    """
    shape = tuple(shape) if shape is not None else (dist.get_world_size(),)
    if names is None:
        names = ("replicate", "shard") if len(shape) == 2 else None
    # Where the default group is gloo with several threads, on groups of spmd's own (one thread).
    return cached_mesh(
        device_type, (shape, tuple(names or ())), lambda: gloo_group.init_mesh(device_type, shape, names)
    )


def cached_mesh(device_type: str, tag: Any, make: Callable[[], DeviceMesh]) -> DeviceMesh:
    """The mesh ``make()`` returns, made once per device type, ``tag`` and default process group
    (every rank calls it at the same point: making a mesh is collective)."""
    group = torch_compat.get_default_group()
    key = (device_type, id(group), dist.get_world_size(), tag)
    entry = _DEFAULT_MESHES.get(key)
    if entry is None or entry[0] is not group:
        if any(g is not group for g, _ in _DEFAULT_MESHES.values()):
            _DEFAULT_MESHES.clear()  # meshes of earlier groups are dead
        entry = _DEFAULT_MESHES[key] = (group, make())
    return entry[1]


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How one dim-0-sharded tensor of ``rows`` rows is split over ``world`` ranks."""

    rows: int
    world: int
    rank: int

    @property
    def chunk(self) -> int:
        """Rows per rank after padding (``ceil(rows / world)``)."""
        return math.ceil(self.rows / self.world) if self.rows else 0

    @property
    def local_rows(self) -> int:
        return Shard.local_shard_size_and_offset(self.rows, self.world, self.rank)[0]

    @property
    def offset(self) -> int:
        return min(self.rank * self.chunk, self.rows)

    @property
    def padded(self) -> bool:
        """Whether any rank needs padding (then every rank emits the pad, keeping graphs uniform)."""
        return self.chunk * self.world != self.rows


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, Shard | _StridedShard) for p in t.placements)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the graph reads: a DTensor's local tensor, or ``t`` itself."""
    return torch_compat.local_tensor(t) if isinstance(t, DTensor) else t


def _to_dtensor(
    t: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    offload: CPUOffloadPolicy | None = None,
) -> DTensor:
    """``t`` (the full value, equal on every rank) as a DTensor with this rank's piece of it."""
    if offload is not None:
        return _to_offloaded_dtensor(t, mesh, any(isinstance(pl, Shard) for pl in placements), offload)
    if any(isinstance(pl, _StridedShard) for pl in placements):
        # FSDP x TP: the tensor-parallel piece first, then that piece's rows over the data
        # dimension (right to left, as FSDP2 shards a parallelize_module parameter).
        # A strided split with nothing split after it on its dimension (a fused projection's
        # tensor-parallel split, groups of equal size): this rank's share of every group.
        piece = t.detach()
        cut: set[int] = set()
        for dim in reversed(range(len(placements))):
            pl = placements[dim]
            if isinstance(pl, Shard | _StridedShard):
                d = pl.dim % t.dim()
                groups = pl.split_factor if isinstance(pl, _StridedShard) and d not in cut else 1
                parts = []
                for g in piece.chunk(groups, d):
                    size, off = Shard.local_shard_size_and_offset(
                        g.shape[d], mesh.size(dim), mesh.get_local_rank(dim)
                    )
                    parts.append(g.narrow(d, off, size))
                piece = parts[0] if len(parts) == 1 else torch.cat(parts, d)
                cut.add(d)
        return DTensor.from_local(
            piece.clone(), mesh, list(placements), run_check=False, shape=t.shape, stride=t.stride()
        )
    if any(isinstance(pl, Shard) and pl.dim != 0 for pl in placements):
        # Declared placements (DTensorExpandMode, tensor parallelism) may shard any dim: DTensor's
        # own chunks, cut from the local full value without communication.
        return distribute_tensor(t.detach(), mesh, placements, src_data_rank=None)
    piece = t.detach()
    for dim, pl in enumerate(placements):
        if isinstance(pl, Shard):
            assert pl.dim == 0, pl
            lay = ShardLayout(t.shape[0], mesh.size(dim), mesh.get_local_rank(dim))
            piece = piece.narrow(0, lay.offset, lay.local_rows).clone()
    return DTensor.from_local(
        piece, mesh, list(placements), run_check=False, shape=t.shape, stride=t.stride()
    )


def _to_offloaded_dtensor(
    t: torch.Tensor, mesh: DeviceMesh, shard: bool, offload: CPUOffloadPolicy
) -> DTensor:
    """A DTensor on ``mesh`` whose local tensor lives on the CPU (``from_local`` would move it
    to the mesh's device, so the spec is built directly, as FSDP2 does for offloaded shards)."""
    if shard:
        lay = ShardLayout(t.shape[0], mesh.size(), mesh.get_local_rank())
        piece = to_host(t.detach().narrow(0, lay.offset, lay.local_rows), offload)
        if piece.untyped_storage().nbytes() != piece.nbytes:
            piece = piece.clone()  # the shard alone, never a view of the full (CPU) tensor
    else:
        piece = to_host(t.detach(), offload)
    spec = DTensorSpec(
        mesh, (Shard(0),) if shard else (Replicate(),), TensorMeta(t.shape, t.stride(), t.dtype)
    )
    return DTensor(piece, spec, requires_grad=False)  # type: ignore[call-arg]


def distribute_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: DeviceMesh,
    placements_of: Callable[[str, nn.Parameter], Sequence[Placement] | None],
    *,
    replaced: dict[int, nn.Parameter] | None = None,
    offload: CPUOffloadPolicy | None = None,
) -> int:
    """Turn every plain parameter of ``module`` into a DTensor parameter, in place.

    ``placements_of(fqn, param)`` gives each parameter's placements on ``mesh``, or None to
    leave it a plain tensor (an ignored parameter). Tied parameters stay tied (one new
    Parameter at every name). The optimizer's param_groups and state are re-keyed to the
    new parameters, and state tensors shaped like their parameter take its placement.
    ``replaced`` maps ``id(old)`` to the new parameter for parameters already swapped by
    the caller (:func:`materialize_meta`), so the optimizer follows those too. With
    ``offload`` the local tensors of parameters and optimizer state go to the CPU
    (:mod:`spmd.parallel.offload`). Returns how many parameters were converted (0 when the
    model is already distributed).
    """
    new_of: dict[int, nn.Parameter] = dict(replaced or {})
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(torch_compat.module_parameters(mod).items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in new_of:
                placements = placements_of(f"{prefix}.{name}" if prefix else name, p)
                if placements is None:
                    continue
                new_of[id(p)] = nn.Parameter(
                    _to_dtensor(p, mesh, placements, offload), requires_grad=p.requires_grad
                )
            torch_compat.module_parameters(mod)[name] = new_of[id(p)]
    rekey_optimizer(optimizer, new_of, mesh, offload)
    return len(new_of)


def rekey_optimizer(
    optimizer: torch.optim.Optimizer | None,
    new_of: dict[int, nn.Parameter],
    mesh: DeviceMesh | None,
    offload: CPUOffloadPolicy | None = None,
) -> None:
    """Point the optimizer's param_groups and state at the new parameters (``id(old) -> new``).

    State tensors shaped like their parameter take the new parameter's placement
    (when ``mesh`` is given and the new parameter is a DTensor); with ``offload`` they and
    the scalar state (Adam's ``step``) move to the CPU, where the optimizer will run.
    """
    if not new_of or optimizer is None:
        return
    old_state = optimizer.state
    for g in optimizer.param_groups:
        new_params = []
        for p in g["params"]:
            np_ = new_of.get(id(p), p)
            if np_ is not p and p in old_state:
                st = old_state.pop(p)
                for k, v in list(st.items()):
                    if (
                        mesh is not None
                        and isinstance(np_, DTensor)
                        and isinstance(v, torch.Tensor)
                        and not isinstance(v, DTensor)
                        and v.shape == p.shape
                    ):
                        st[k] = _to_dtensor(v, mesh, np_.placements, offload)
                    elif offload is not None and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                        st[k] = v.to("cpu")
                old_state[np_] = st
            new_params.append(np_)
        g["params"] = new_params


# ----------------------------------------------------------------------------- meta-device init


def is_meta_model(module: nn.Module) -> bool:
    """Whether every parameter of ``module`` is on the meta device (built under
    ``torch.device("meta")``). A model with only some parameters there is refused by the
    tracer's device check instead: re-initialising part of a module would overwrite the
    real values beside it."""
    params = list(module.parameters())
    return bool(params) and all(p.is_meta for p in params)


def materialize_meta(
    module: nn.Module,
    *,
    device: torch.device,
    mesh: DeviceMesh | None,
    placements_of: Callable[[str, nn.Parameter], Sequence[Placement] | None],
    param_init_fn: Callable[[nn.Module], None] | None = None,
    sync_module_states: bool = False,
    offload: CPUOffloadPolicy | None = None,
) -> dict[int, nn.Parameter]:
    """Allocate and initialise a model built on the meta device, one module at a time.

    For each module (in ``module.modules()`` order, which is construction order for the
    usual ``__init__`` that creates children in registration order) whose own parameters
    or buffers are on the meta device: allocate them empty on ``device``, initialise them
    with ``param_init_fn(module)`` if given, else ``module.reset_parameters()``, broadcast
    them from rank 0 if ``sync_module_states``, and replace each parameter at once by this
    rank's piece of it (``placements_of(fqn, param)``; None keeps it plain). So at most one
    module's full tensors are alive at a time, and no rank ever holds the full model. With
    ``mesh=None`` (world size 1) the parameters stay plain tensors on ``device``. With
    ``offload`` each shard goes to the CPU as soon as it is cut (:mod:`spmd.parallel.offload`).

    A tied parameter is materialised at its first module; a later module holding it still
    runs its initialiser on a scratch copy (so the random stream is consumed as eager
    construction consumes it, before ``self.head.weight = self.tok.weight``) and then gets
    the first module's parameter back. Buffers are allocated whole (they are not sharded).

    Returns ``id(meta parameter) -> new parameter`` for re-keying an optimizer built
    over the meta parameters (:func:`rekey_optimizer`).
    """
    new_of: dict[int, nn.Parameter] = {}
    new_buf_of: dict[int, torch.Tensor] = {}
    for fqn, mod in module.named_modules():
        metas = [
            (n, p) for n, p in torch_compat.module_parameters(mod).items() if p is not None and p.is_meta
        ]
        meta_bufs = [
            (n, b) for n, b in torch_compat.module_buffers(mod).items() if b is not None and b.is_meta
        ]
        if not metas and not meta_bufs:
            continue
        init = _initializer(fqn, mod, [n for n, _ in metas + meta_bufs], param_init_fn)
        with torch.no_grad():
            for n, p in metas:
                torch_compat.module_parameters(mod)[n] = nn.Parameter(
                    torch.empty_like(p, device=device), p.requires_grad
                )
            for n, b in meta_bufs:
                torch_compat.module_buffers(mod)[n] = torch.empty_like(b, device=device)
            init(mod)
            fresh = [(n, p) for n, p in metas if id(p) not in new_of]
            fresh_bufs = [(n, b) for n, b in meta_bufs if id(b) not in new_buf_of]
            for kind, table, items in (
                ("parameter", torch_compat.module_parameters(mod), fresh),
                ("buffer", torch_compat.module_buffers(mod), fresh_bufs),
            ):
                for n, _ in items:
                    t = table[n]
                    if t is None or t.is_meta:
                        raise ConfigError(
                            f"spmd.DataParallel: {kind} {_join(fqn, n)} is still on the meta device after "
                            "its module's initialiser ran; the param_init_fn must allocate it (e.g. "
                            f"module.to_empty(device={str(device)!r}, recurse=False)) and initialise it."
                        )
                    if sync_module_states and mesh is not None:
                        dist.broadcast(t.data, src=0)
            for n, p in metas:
                if id(p) not in new_of:
                    full = torch_compat.module_parameters(mod)[n]
                    assert full is not None
                    name = f"{fqn}.{n}" if fqn else n
                    placements = placements_of(name, full) if mesh is not None else None
                    if mesh is None or placements is None:  # world size 1, or ignored: stays plain
                        new_of[id(p)] = full
                    else:
                        new_of[id(p)] = nn.Parameter(
                            _to_dtensor(full, mesh, placements, offload), full.requires_grad
                        )
                torch_compat.module_parameters(mod)[n] = new_of[id(p)]
            for n, b in meta_bufs:
                new_buf_of.setdefault(id(b), torch_compat.module_buffers(mod)[n])  # type: ignore[arg-type]
                torch_compat.module_buffers(mod)[n] = new_buf_of[id(b)]
    log.info(
        "spmd: materialised %d meta parameters and %d buffers on %s module by module",
        len(new_of),
        len(new_buf_of),
        device,
    )
    return new_of


def _join(fqn: str, name: str) -> str:
    return repr(f"{fqn}.{name}" if fqn else name)


def _initializer(
    fqn: str, mod: nn.Module, names: list[str], param_init_fn: Callable[[nn.Module], None] | None
) -> Callable[[nn.Module], None]:
    if param_init_fn is not None:
        return param_init_fn
    reset = getattr(mod, "reset_parameters", None)
    if callable(reset):
        return lambda m: reset()
    where = f"module {fqn!r}" if fqn else "the root module"
    raise ConfigError(
        f"spmd.DataParallel: {_join(fqn, names[0])} is on the meta device, but {where} "
        f"({type(mod).__name__}) has no reset_parameters() to initialise it. Pass "
        "DataParallel(..., param_init_fn=fn): fn(module) is called on every module whose own "
        "tensors are on the meta device, after they are allocated (empty) on the target device, "
        "and must fill them; or give the module a reset_parameters() method."
    )


def broadcast_module_states(module: nn.Module, skip: Collection[str] = ()) -> None:
    """Overwrite every plain parameter and buffer with rank 0's value (in place), except the
    names in ``skip`` (rank-local state)."""
    with torch.no_grad():
        for n, t in [*module.named_parameters(), *module.named_buffers()]:
            if not isinstance(t, DTensor) and n not in skip:
                dist.broadcast(t.data, src=0)


def full_state_dict(module: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered to a full, plain tensor.

    A collective: every rank must call it. With ``rank0_only`` (default) the other ranks
    get an empty dict, as FSDP's ``FULL_STATE_DICT`` with ``rank0_only=True``. The result
    loads into the plain, undistributed model with ``load_state_dict``.
    """
    rank = world_info()[0]
    out: dict[str, torch.Tensor] = {}
    for k, v in module.state_dict().items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if not rank0_only or rank == 0:
            out[k] = full.detach().clone()
    return out
