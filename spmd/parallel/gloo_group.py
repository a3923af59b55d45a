"""spmd's collectives on their own one-thread gloo groups, where torch's default group runs several.

A gloo group made by ``torch.distributed.init_process_group("gloo")`` runs its collectives on two
worker threads, and torch's gloo can corrupt the heap when two collectives run at once
(benchmarks/results/crashes.md; ``benchmarks/diagnostics/gloo_concurrent_collectives.py``
reproduces it without spmd). On such a group spmd would have to keep one collective in flight at a time
(``spmd.pipeline.gloo_concurrent``), so a prefetched all-gather could not run while a reduce-scatter
does. Instead, the meshes spmd makes itself (no ``mesh=`` given) get groups of their own, made with
one worker thread: there gloo runs the collectives one after another in its thread, each still in the
background of the step's compute, and spmd keeps its whole schedule. The user's script does nothing.

What it costs: one more gloo group per mesh dimension (a TCP connection per peer and one thread,
made once, at the first compile, by every rank: ``new_group`` is collective). What it does not do:
change a mesh the user passes in (its groups are the user's; on a several-thread gloo group spmd
still keeps one collective in flight), or any group that is not gloo, or a gloo group that already
runs one thread (``spmd.gloo_threads(1)``), or the default group itself (the user's own collectives,
DDP's or FSDP2's, still run on it).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from passes import torch_compat


def several_threads(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: torch's default group) is a gloo group with more than one worker
    thread: a group on which two of spmd's collectives in flight would run at once."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    try:
        group = group if group is not None else torch_compat.get_default_group()
        if str(dist.get_backend(group)) != "gloo":
            return False
        return torch_compat.gloo_threads(group) > 1
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return False


def wanted(device_type: str) -> bool:
    """Whether spmd makes its own one-thread groups for a mesh on ``device_type``: a CPU mesh while
    torch's default group is gloo with several threads."""
    return device_type == "cpu" and several_threads()


@contextlib.contextmanager
def own_groups(device_type: str) -> Iterator[bool]:
    """The block makes spmd's groups for a mesh on ``device_type``: with one gloo thread where
    :func:`wanted`; else, on a CPU mesh over a gloo default group, with that group's thread count
    (a user's ``spmd.gloo_threads(1)`` reaches the mesh's groups: torch would make them with two,
    on which spmd keeps one collective in flight). Yields whether spmd set the count to one."""
    if not wanted(device_type):
        threads = _default_gloo_threads() if device_type == "cpu" else None
        if threads is None:
            yield False
            return
        with torch_compat.gloo_groups_with_threads(threads):
            yield False
        return
    with torch_compat.gloo_groups_with_threads(1):
        yield True


def _default_gloo_threads() -> int | None:
    """The worker threads of torch's default group where it is gloo; else None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        group = torch_compat.get_default_group()
        return torch_compat.gloo_threads(group) if str(dist.get_backend(group)) == "gloo" else None
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return None


# id(default group) -> (that group, spmd's copy of it). The default group is held so that its id,
# which keys the copy here and spmd's cached meshes (spmd.parallel.sharding), cannot be reused by a
# later default group while they are cached.
_WORLD: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def world_group(device_type: str) -> dist.ProcessGroup:
    """A group of every rank for spmd's collectives: torch's default group, or where :func:`wanted`,
    spmd's one-thread copy of it (made once per default group, by every rank at once)."""
    default = torch_compat.get_default_group()
    if not wanted(device_type):
        return default
    entry = _WORLD.get(id(default))
    if entry is None or entry[0] is not default:
        _WORLD.clear()  # a copy of an earlier (destroyed) default group is dead
        with own_groups(device_type):
            entry = (
                default,
                dist.new_group(backend="gloo", timeout=_timeout_of(default), group_desc="spmd_world"),
            )
        _WORLD[id(default)] = entry
    return entry[1]


def _timeout_of(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The collective timeout the user gave the default group (``init_process_group(timeout=)``),
    for spmd's copies of it: ``new_group`` would otherwise take torch's 30-minute default."""
    seconds = torch_compat.pg_timeout_s(group)
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def init_mesh(device_type: str, shape: Sequence[int], names: Sequence[str] | None = None) -> DeviceMesh:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)``, its groups spmd's own where
    :func:`wanted`: the 1-D mesh of every rank on :func:`world_group`, every dimension of a larger
    one on a new one-thread group (``backend_override``: else torch hands a dimension of every
    rank the default group)."""
    shape = tuple(shape)
    mesh_dim_names = tuple(names) if names is not None else None
    if not wanted(device_type):
        with own_groups(device_type):  # the default group's thread count
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=mesh_dim_names)
        return _users_timeout(mesh)
    world = world_group(device_type)  # made first on every rank; holds the default group (above)
    if len(shape) == 1 and shape[0] == dist.get_world_size():
        return DeviceMesh.from_group(world, device_type, mesh_dim_names=mesh_dim_names)
    with own_groups(device_type):
        mesh = init_device_mesh(
            device_type,
            shape,
            mesh_dim_names=mesh_dim_names,
            backend_override=dict.fromkeys(range(len(shape)), "gloo"),
        )
    return _users_timeout(mesh)


def flatten(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` flattened to one dimension (``DeviceMesh._flatten``), its new group one-thread where
    :func:`wanted`, with the default group's timeout."""
    with own_groups(mesh.device_type) as own:
        # backend_override: else a flattened dimension of every rank is the default group.
        flat = torch_compat.flatten_mesh(mesh, backend_override="gloo" if own else None)
    return _users_timeout(flat)


def _users_timeout(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` with every dimension's group on the default group's collective timeout (the user's
    ``init_process_group(timeout=)``): ``init_device_mesh`` makes them with torch's 30-minute default,
    so a rank whose peer died in a collective on one waited 30 minutes. Only for meshes spmd makes."""
    seconds = torch_compat.pg_timeout_s(torch_compat.get_default_group())
    if seconds is not None:
        for d in range(mesh.ndim):
            group = mesh.get_group(d)
            if torch_compat.pg_timeout_s(group) not in (seconds, None):
                torch_compat.set_pg_timeout(group, seconds)
    return mesh
