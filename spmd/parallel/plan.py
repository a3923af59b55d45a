"""Per-parameter plans: which placement each parameter gets, and which groups its collectives use.

Every per-parameter decision of :class:`~spmd.parallel.DataParallel` is made here, in two steps:

* :func:`assign_placements` runs when the model is first distributed. From the mode's
  configuration (style, mesh, ``ignored_modules`` / ``ignored_params``, ``module_styles``) it
  gives every parameter fqn a placement tuple on the mesh, or None for a parameter that stays a
  plain, rank-local tensor (ignored: never gathered, never reduced, updated locally).
* :func:`comm_plan` runs when a graph is partitioned. From a parameter's distributed state (a
  plain tensor, or a DTensor's placements on its mesh) it derives the groups the graph uses:
  dim-0 shards gathered and reduce-scattered over the mesh dimension that shards, then
  gradients all-reduced over the dimensions that replicate.

The second step reads the state, not the configuration, so a second compiled step on the same
model (an eval step) follows whatever the first one set up.

Meshes: ``replicate`` and ``fully_shard`` use a 1-D mesh; ``hybrid_shard`` a 2-D mesh of
(replicate, shard) dimensions, like FSDP's HYBRID_SHARD: parameters sharded within a group,
the shard groups replicas of each other. Its dimensions are found by name (``"replicate"`` /
``"shard"``, or torchtitan's ``"dp_replicate"`` / ``"dp_shard"``), else dim 0 replicates and
dim 1 shards.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from passes import torch_compat
from passes.torch_compat import StridedShard as _StridedShard
from spmd.errors import ConfigError
from spmd.parallel import gloo_group
from spmd.parallel.sharding import ShardLayout

# The styles a parameter can have; DataParallel's parallel_style is the default for all of them.
REPLICATE, FULLY_SHARD, HYBRID_SHARD, IGNORED = "replicate", "fully_shard", "hybrid_shard", "ignored"
_DIM_NAMES = (("replicate", "shard"), ("dp_replicate", "dp_shard"))
# The mesh dimension of tensor parallelism (torchtitan's name); every other dimension is a data one.
TP = "tp"


# ----------------------------------------------------------------------------- meshes


def tp_dim(mesh: Any) -> int | None:
    """The index of the mesh's tensor-parallel dimension (named ``"tp"``), or None."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return names.index(TP) if TP in names else None


def data_dims(mesh: Any) -> tuple[int, ...]:
    """The data-parallel dimensions of ``mesh``: every dimension but ``"tp"``."""
    tp = tp_dim(mesh)
    return tuple(d for d in range(getattr(mesh, "ndim", 1)) if d != tp)


def hybrid_dims(mesh: DeviceMesh) -> tuple[int, int]:
    """(replicate dim, shard dim) of a hybrid mesh's two data dimensions: by dimension names if it
    has them, else the first two data dimensions in order."""
    names = tuple(mesh.mesh_dim_names or ())
    for rep, shard in _DIM_NAMES:
        if rep in names and shard in names:
            return names.index(rep), names.index(shard)
    dims = data_dims(mesh)
    return dims[0], dims[1]


def shard_dim(mesh: DeviceMesh) -> int:
    """The data dimension a sharded style shards over: the hybrid mesh's shard dimension, else the
    one data dimension."""
    dims = data_dims(mesh)
    return hybrid_dims(mesh)[1] if len(dims) == 2 else dims[0]


def check_mesh(mesh: Any, style: str, *, where: str = "spmd.DataParallel") -> None:
    """Raise ConfigError unless ``mesh`` has the data dimensions ``style`` needs (plus, optionally,
    a ``"tp"`` dimension)."""
    ndim = getattr(mesh, "ndim", None)
    nd = len(data_dims(mesh)) if ndim is not None else None
    tp = " plus a 'tp' dimension" if ndim is not None and tp_dim(mesh) is not None else ""
    if style == HYBRID_SHARD and nd != 2:
        raise ConfigError(
            f"{where}: parallel_style='hybrid_shard' needs 2 data dimensions (replicate x shard){tp}, got "
            f"{'a ' + str(ndim) + '-D mesh' if ndim is not None else type(mesh).__name__}. Build one with "
            "init_device_mesh('cpu', (num_replicas, shard_size), mesh_dim_names=('replicate', 'shard')), "
            "or pass mesh=None to shard within each node (torchrun's LOCAL_WORLD_SIZE)."
        )
    if style != HYBRID_SHARD and nd != 1:
        hint = " Use parallel_style='hybrid_shard' for 2 data dimensions." if nd == 2 else ""
        if ndim == 2 and not tp:
            hint += " For tensor parallelism name the model dimension 'tp' (mesh_dim_names=('dp', 'tp'))."
        raise ConfigError(
            f"{where}: parallel_style={style!r} needs one data dimension{tp}, got "
            f"{'a ' + str(ndim) + '-D mesh' if ndim is not None else type(mesh).__name__}.{hint}"
        )


def hybrid_mesh_shape(world: int) -> tuple[int, int]:
    """The default hybrid mesh (replicas, shard size): shard within a node, replicate across nodes.

    The node size is torchrun's ``LOCAL_WORLD_SIZE``, as FSDP's HYBRID_SHARD uses the
    intra-node group.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE")
    fix = (
        "Pass mesh=init_device_mesh(device_type, (num_replicas, shard_size), "
        "mesh_dim_names=('replicate', 'shard')) to DataParallel('hybrid_shard', ...)."
    )
    if local is None or not local.isdigit() or int(local) < 1:
        raise ConfigError(
            "spmd.DataParallel('hybrid_shard'): no mesh given and LOCAL_WORLD_SIZE is not set (torchrun "
            f"sets it), so the shard group (one node) is unknown. {fix}"
        )
    n = int(local)
    if world % n:
        raise ConfigError(
            f"spmd.DataParallel('hybrid_shard'): the world size {world} is not a multiple of "
            f"LOCAL_WORLD_SIZE={n}, so ranks cannot be split into equal nodes. {fix}"
        )
    return world // n, n


def whole_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A process group of every rank of ``mesh``."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return gloo_group.world_group(mesh.device_type)
    return gloo_group.flatten(mesh).get_group()


def data_group(mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of this rank's ``dims`` (data dimensions) of ``mesh``."""
    if len(dims) == mesh.ndim:
        return whole_group(mesh)
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise ConfigError("spmd.DataParallel: a mesh with a 'tp' dimension must name all its dimensions.")
    return gloo_group.flatten(mesh[tuple(names[d] for d in dims)]).get_group()


# ----------------------------------------------------------------------------- placements


def _by_fqn(module: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Parameter]]:
    return dict(module.named_modules()), dict(module.named_parameters(remove_duplicate=False))


def _fqns_of(items: Iterable[Any], named: Mapping[str, Any], what: str, knob: str) -> set[str]:
    """The fqns of ``items`` (module/parameter objects or fqn strings), each checked to exist."""
    by_id: dict[int, str] = {}
    for n, obj in named.items():
        by_id.setdefault(id(obj), n)
    out: set[str] = set()
    for item in items:
        if isinstance(item, str):
            if item not in named:
                near = difflib.get_close_matches(item, [n for n in named if n], n=3)
                hint = f" Did you mean {', '.join(map(repr, near))}?" if near else ""
                raise ConfigError(
                    f"spmd.DataParallel: {knob} names {item!r}, which is not a {what} of the model.{hint} "
                    f"Use fully qualified names as model.named_{what}s() gives them."
                )
            fqn = item
        elif id(item) in by_id:
            fqn = by_id[id(item)]
        else:
            raise ConfigError(
                f"spmd.DataParallel: {knob} holds a {type(item).__name__} that is not a {what} of the "
                f"model being distributed. Pass {what}s of that model, or their fully qualified names "
                "(names also work on the copies spmd.simulate makes)."
            )
        out.add(fqn)
    return out


def assign_styles(
    module: nn.Module,
    style: str,
    *,
    ignored_modules: Iterable[Any] = (),
    ignored_params: Iterable[Any] = (),
    module_styles: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Every parameter fqn of ``module`` (tied parameters under each name) -> its style.

    ``module_styles`` maps module fqns to a style for their parameters; the longest matching
    prefix wins (so ``{"": "replicate", "body": "fully_shard"}`` is possible). Ignored modules
    and parameters override every style. A parameter tied under names of different styles is an
    error: it has one placement.
    """
    modules, params = _by_fqn(module)
    prefixes = dict(module_styles or {})
    _fqns_of(prefixes, modules, "module", "module_styles")
    ignored_mods = _fqns_of(ignored_modules, modules, "module", "ignored_modules")
    ignored_ps = _fqns_of(ignored_params, params, "parameter", "ignored_params")

    def under(fqn: str, prefix: str) -> bool:
        return prefix == "" or fqn == prefix or fqn.startswith(prefix + ".")

    out: dict[str, str] = {}
    for fqn in params:
        if fqn in ignored_ps or any(under(fqn, m) for m in ignored_mods):
            out[fqn] = IGNORED
            continue
        best = max((p for p in prefixes if under(fqn, p)), key=len, default=None)
        out[fqn] = prefixes[best] if best is not None else style
    by_param: dict[int, str] = {}
    names: dict[int, str] = {}
    for fqn, p in params.items():
        if id(p) in by_param and by_param[id(p)] != out[fqn]:
            raise ConfigError(
                f"spmd.DataParallel: parameter {names[id(p)]!r} is tied to {fqn!r}, but the two names get "
                f"different styles ({by_param[id(p)]!r} and {out[fqn]!r}). A tied parameter has one "
                "placement: give both modules the same style (module_styles / ignored_*)."
            )
        by_param.setdefault(id(p), out[fqn])
        names.setdefault(id(p), fqn)
    return out


def ignored_buffers(module: nn.Module, ignored_modules: Iterable[Any]) -> set[str]:
    """Fqns of the buffers inside ignored modules: rank-local, never broadcast."""
    modules = dict(module.named_modules())
    prefixes = _fqns_of(ignored_modules, modules, "module", "ignored_modules")
    return {
        n
        for n, _ in module.named_buffers(remove_duplicate=False)
        if any(p == "" or n.startswith(p + ".") for p in prefixes)
    }


def placements_for(
    style: str, mesh: DeviceMesh, p: torch.Tensor, tp: Placement | None = None
) -> tuple[Placement, ...] | None:
    """The DTensor placements of a parameter of this style on ``mesh`` (None: stays a plain tensor).

    ``tp``: its placement on the mesh's ``"tp"`` dimension. A sharded style shards dim 0 of the
    parameter's tensor-parallel piece over the data dimension, as FSDP2 composes with
    ``parallelize_module``: where tp shards dim 0 too, the data dimension's placement is
    ``_StridedShard(0, split_factor=tp size)`` (tp splits first, then each piece is split again).
    A parameter split strided on dim 0 over tp (a fused projection) replicates over the data
    dimension.
    """
    if style == IGNORED:
        return None
    out: list[Placement] = [Replicate()] * mesh.ndim
    t = tp_dim(mesh)
    if t is not None:
        out[t] = tp if tp is not None else Replicate()
    if p.dim() == 0 or style == REPLICATE:
        return tuple(out)
    if t is not None and isinstance(tp, Shard) and tp.dim in (0, -p.dim()):
        out[shard_dim(mesh)] = _StridedShard(0, split_factor=mesh.size(t))
    elif t is not None and isinstance(tp, _StridedShard) and tp.dim in (0, -p.dim()):
        # A fused projection split strided over tp on dim 0: its rows on a rank are groups from
        # all over the tensor, which no placement of the data dimension's contiguous dim-0
        # shard of them describes; it replicates over the data dimension (gradient all-reduced).
        pass
    else:
        out[shard_dim(mesh)] = Shard(0)
    return tuple(out)


def is_dim0_shard(pl: Placement) -> bool:
    """``Shard(0)``, or the strided dim-0 shard of a data dimension under tensor parallelism."""
    return isinstance(pl, Shard | _StridedShard) and pl.dim == 0


# ----------------------------------------------------------------------------- communication


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group as the graph's functional collectives name it, from this rank's view."""

    name: str
    size: int
    rank: int  # this rank's index in the group


@dataclasses.dataclass(frozen=True)
class ParamComm:
    """What the partitioned graph does with one parameter.

    ``shard``: the local tensor is a dim-0 shard over this group (all-gathered before use, its
    gradient reduce-scattered with avg). ``reduce``: the gradient (after any reduce-scatter) is
    all-reduced with avg over this group. Neither: the parameter is rank-local (ignored, or a
    group of one rank), and its gradient is used as it is.
    """

    shard: Group | None
    reduce: Group | None
    layout: ShardLayout | None  # the shard's rows on this rank, when ``shard``

    @property
    def local_only(self) -> bool:
        return self.shard is None and self.reduce is None


LOCAL = ParamComm(shard=None, reduce=None, layout=None)


def _group(pg: dist.ProcessGroup) -> Group | None:
    size = dist.get_world_size(pg)
    return Group(pg.group_name, size, dist.get_rank(pg)) if size > 1 else None


def comm_plan(p: torch.Tensor, mesh: DeviceMesh) -> ParamComm:
    """The parameter's communication on the data dimensions, read from its state (a plain
    tensor is rank-local).

    The groups come from ``mesh`` (the mode's), not from ``p.device_mesh``: DTensor may hand a
    parameter an earlier mesh that compares equal (same ranks and dimension names) but holds
    other process groups, and every parameter of one graph must use the same groups. A
    ``"tp"`` dimension is not the data partitioner's: the graph it sees already works on the
    parameter's tensor-parallel piece, whose dim 0 is what the data dimension shards.
    """
    if not isinstance(p, DTensor):
        return LOCAL
    placements = p.placements
    if p.device_mesh.ndim != mesh.ndim:
        raise ConfigError(
            f"spmd.DataParallel: the model was distributed on a {p.device_mesh.ndim}-D mesh, but this step's "
            f"mode uses a {mesh.ndim}-D one. Compile every step on one model with the same parallel_style."
        )
    dims = data_dims(mesh)
    shard_dims = [d for d in dims if not isinstance(placements[d], Replicate)]
    rep_dims = tuple(d for d in dims if isinstance(placements[d], Replicate))
    if len(shard_dims) > 1 or not all(is_dim0_shard(placements[d]) for d in shard_dims):
        raise ConfigError(
            f"spmd.DataParallel: a parameter has placements {placements}; only Shard(0) on one data "
            "mesh dimension (and Replicate() on the others) is supported."
        )
    shard = _group(mesh.get_group(shard_dims[0])) if shard_dims else None
    reduce = _group(data_group(mesh, rep_dims)) if rep_dims else None
    rows = p.shape[0] if p.dim() else 0
    t = tp_dim(mesh)
    tp_pl = placements[t] if t is not None else None
    if t is not None and isinstance(tp_pl, Shard) and tp_pl.dim in (0, -p.dim()):
        rows = Shard.local_shard_size_and_offset(rows, mesh.size(t), mesh.get_local_rank(t))[0]
    layout = ShardLayout(rows, shard.size, shard.rank) if shard is not None else None
    return ParamComm(shard=shard, reduce=reduce, layout=layout)


def describe(p: torch.Tensor, comm: ParamComm) -> str:
    """One line for the dump: the parameter's placement and the groups (as global ranks)."""
    if not isinstance(p, DTensor):
        return "ignored: rank-local, no collectives"
    parts = [str(tuple(p.placements))]
    if comm.shard is not None:
        parts.append(f"shard over ranks {group_ranks(comm.shard.name)}")
    if comm.reduce is not None:
        parts.append(f"all-reduce over ranks {group_ranks(comm.reduce.name)}")
    return ", ".join(parts)


def group_ranks(name: str) -> list[int]:
    """The global ranks of the process group called ``name`` (empty if unknown here)."""
    try:
        pg = torch_compat.resolve_process_group(name)  # type: ignore[arg-type]
        return dist.get_process_group_ranks(pg)
    except Exception:  # noqa: BLE001 - a name from another process group world
        return []


def group_label(name: str) -> object:
    """A rank-independent label of a group: its size and its ranks' offsets from its first rank.

    Ranks in different shard groups of a hybrid mesh use different group names for the same
    mesh dimension (ranks 0,1 and 2,3 both have offsets (0, 1)); the replicate dimension's groups
    (0,2 and 1,3) have offsets (0, 2). Used where ranks compare collective sequences.
    """
    ranks = group_ranks(name)
    if not ranks:
        return name
    return (len(ranks), tuple(r - ranks[0] for r in ranks))
