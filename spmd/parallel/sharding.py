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

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Shard

log = logging.getLogger("spmd")


def world_info() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_DEFAULT_MESHES: dict[tuple[str, int, int, tuple[int, ...]], DeviceMesh] = {}


def default_mesh(device_type: str, shape: Sequence[int] | None = None) -> DeviceMesh:
    """A mesh over every rank of the default process group: 1-D, or ``shape`` (replicate, shard).

    Made once per device type, shape and default group: a group destroyed and initialised
    again (tests, ``spmd.simulate``) gets a new mesh.
    """
    shape = tuple(shape) if shape is not None else (dist.get_world_size(),)
    group = dist.distributed_c10d._get_default_group()
    key = (device_type, id(group), dist.get_world_size(), shape)
    if key not in _DEFAULT_MESHES:
        if any(k[1] != id(group) for k in _DEFAULT_MESHES):
            _DEFAULT_MESHES.clear()  # meshes of earlier groups are dead
        names = ("replicate", "shard") if len(shape) == 2 else None
        _DEFAULT_MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _DEFAULT_MESHES[key]


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
    return isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the graph reads: a DTensor's local tensor, or ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _to_dtensor(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``t`` (the full value, equal on every rank) as a DTensor with this rank's piece of it."""
    piece = t.detach()
    for dim, pl in enumerate(placements):
        if isinstance(pl, Shard):
            assert pl.dim == 0, pl
            lay = ShardLayout(t.shape[0], mesh.size(dim), mesh.get_local_rank(dim))
            piece = piece.narrow(0, lay.offset, lay.local_rows).clone()
    return DTensor.from_local(
        piece, mesh, list(placements), run_check=False, shape=t.shape, stride=t.stride()
    )


def distribute_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: DeviceMesh,
    placements_of: Callable[[str, nn.Parameter], Sequence[Placement] | None],
) -> int:
    """Turn every plain parameter of ``module`` into a DTensor parameter, in place.

    ``placements_of(fqn, param)`` gives each parameter's placements on ``mesh``, or None to
    leave it a plain tensor (an ignored parameter). Tied parameters stay tied (one new
    Parameter at every name). The optimizer's param_groups and state are re-keyed to the
    new parameters, and state tensors shaped like their parameter take its placement.
    Returns how many parameters were converted (0 when the model is already distributed).
    """
    new_of: dict[int, nn.Parameter] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in new_of:
                placements = placements_of(f"{prefix}.{name}" if prefix else name, p)
                if placements is None:
                    continue
                new_of[id(p)] = nn.Parameter(_to_dtensor(p, mesh, placements), requires_grad=p.requires_grad)
            mod._parameters[name] = new_of[id(p)]
    if not new_of or optimizer is None:
        return len(new_of)
    old_state = optimizer.state
    for g in optimizer.param_groups:
        new_params = []
        for p in g["params"]:
            np_ = new_of.get(id(p), p)
            if np_ is not p and p in old_state:
                st = old_state.pop(p)
                for k, v in list(st.items()):
                    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == p.shape:
                        st[k] = _to_dtensor(v, mesh, np_.placements)
                old_state[np_] = st
            new_params.append(np_)
        g["params"] = new_params
    return len(new_of)


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
