"""Tensor parallelism on a mesh's ``"tp"`` dimension, composed with the data dimensions.

``DataParallel(style, tp_size=..., tp_plan=...)`` (or a ``mesh`` with a dimension named
``"tp"``) partitions one traced step over two kinds of mesh dimension, each by its own
partitioner, in this order:

1. :func:`expand_tp` runs the traced step (single-device semantics on this rank's local
   batch, full parameters) once more on DTensors over the ``tp`` sub-mesh, with every
   parameter placed as the plan says (:func:`resolve_plan`): DTensor's sharding strategies
   decide each op's local form and the activations' redistributions on ``tp`` (traced as
   functional collectives; :mod:`spmd.parallel.expand_graph`). The data dimensions are
   *local* there (each rank's own batch, as DDP), so nothing is communicated over them, and
   gradients keep their tags, unreduced over data: the result is the step of one
   tensor-parallel piece of the model, on this rank's batch.
2. :func:`spmd.parallel.data_parallel._partition` then treats each parameter's
   tensor-parallel piece as the parameter: it shards the piece's dim 0 over the data
   dimension (fully_shard, hybrid_shard) or replicates it, and gathers, reduce-scatters,
   all-reduces, prefetches and buckets exactly as without tensor parallelism.

So every data-parallel feature (units, prefetch, reshard-after-forward, mixed precision, remat,
``clip_grad_norm_``: the norm's partial sums are summed over tp by step 1 and over the shard
group by step 2) applies unchanged. The state is 2-D DTensors as FSDP2 +
``parallelize_module`` leave it: ``(Shard(0), Shard(1))`` for a row-parallel weight on
``(dp, tp)``, ``(_StridedShard(0, sf=tp), Shard(0))`` for a column-parallel one (tp splits
first, then each piece's rows are split over dp; :func:`spmd.parallel.plan.placements_for`).

The plan (:func:`resolve_plan`) is written as torchtitan writes it: module-name patterns to
``torch.distributed.tensor.parallel`` styles (``ColwiseParallel``, ``RowwiseParallel``,
``SequenceParallel``, ``PrepareModuleInput``...), or parameter-name patterns to a
``Placement`` on tp. What spmd takes from a style is the placement of the module's
parameters; activation layouts (``input_layouts``, ``output_layouts``, ``use_local_output``)
are DTensor's propagation's choice in the whole-step graph (see docs/tensor-parallel.md for
what that means for sequence parallelism).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from passes import torch_compat
from passes.torch_compat import FakeTensorMode
from spmd.errors import ConfigError
from spmd.parallel import plan
from spmd.parallel.base import OVERRIDE_PLACEMENTS
from spmd.parallel.expand_graph import expand_graph

if TYPE_CHECKING:
    from spmd.frontend.step_inputs import LiftedState, StepArgs

log = logging.getLogger("spmd")


# ----------------------------------------------------------------------------- the plan


def _style_names() -> dict[type, str]:
    from torch.distributed.tensor import parallel as tpar

    return {
        tpar.ColwiseParallel: "colwise",
        tpar.RowwiseParallel: "rowwise",
        tpar.SequenceParallel: "replicate",
        tpar.PrepareModuleInput: "replicate",
        tpar.PrepareModuleOutput: "replicate",
        tpar.PrepareModuleInputOutput: "replicate",
    }


def _kind_of(style: Any) -> str | None:
    """``"colwise"`` / ``"rowwise"`` / ``"replicate"`` for a torch parallel style, else None."""
    for cls, kind in _style_names().items():
        if isinstance(style, cls):
            return kind
    return None


def _is_conv1d(m: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: a linear layer whose weight is stored transposed, ``(in, out)``."""
    return (
        type(m).__name__ == "Conv1D"
        and hasattr(m, "nf")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
    )


def _module_placements(fqn: str, m: nn.Module, kind: str, style: Any) -> dict[str, Placement]:
    """Own parameter name -> placement on tp, for ``style`` applied to module ``m``."""
    own = {n for n, p in m.named_parameters(recurse=False)}
    if kind == "replicate" or not own:
        return {n: Replicate() for n in own}
    col = kind == "colwise"
    out: dict[str, Placement]
    if isinstance(m, nn.Linear):
        out = {"weight": Shard(0) if col else Shard(1)}
        if "bias" in own:
            out["bias"] = Shard(0) if col else Replicate()
        return out
    if isinstance(m, nn.Embedding):
        # Colwise: the embedding dimension split (output sharded on its last dim); rowwise: the
        # vocabulary split (a vocabulary-parallel embedding, partial sums over tp).
        return {"weight": Shard(1) if col else Shard(0)}
    if _is_conv1d(m):
        out = {"weight": Shard(1) if col else Shard(0)}  # weight is (in, out)
        if "bias" in own:
            out["bias"] = Shard(0) if col else Replicate()
        return out
    raise ConfigError(
        f"spmd tp_plan: {type(style).__name__} on module {fqn!r} of type {type(m).__name__}: spmd maps "
        "ColwiseParallel/RowwiseParallel onto nn.Linear, nn.Embedding and GPT-2's Conv1D. For this module "
        f"give its parameters' placements on tp instead, e.g. {{'{fqn}.weight': Shard(0)}}."
    )


def _module_layouts(m: nn.Module, style: Any) -> tuple[Placement | None, ...]:
    """(input, output, output gradient) layouts on tp of a module under ``style``: what a forward
    value is redistributed to where it enters or leaves the module, and what the gradient of its
    output takes where it enters the module's backward (None: whatever DTensor propagates)."""
    from torch.distributed.tensor import parallel as tpar

    if isinstance(style, tpar.ColwiseParallel):
        return style.desired_input_layouts[0], style.output_layouts[0], Shard(-1)
    if isinstance(style, tpar.RowwiseParallel):
        rows = Replicate() if isinstance(m, nn.Embedding) else Shard(-1)
        # The output is a partial sum before its redistribution: its gradient is replicated.
        return rows, style.output_layouts[0], Replicate()
    if isinstance(style, tpar.SequenceParallel):
        seq = style.sequence_sharding[0]
        return seq, seq, seq
    return None, None, None  # PrepareModuleInput/Output: positional layouts; propagation decides


def _check_strided(pattern: str, value: Placement, fqn: str, p: torch.Tensor) -> None:
    """A strided split (``_StridedShard(d, split_factor=k)``: k equal groups on dim d, each rank
    its share of every group, as a fused qkv projection splits) must cut its dimension into
    groups of equal size."""
    if isinstance(value, torch_compat.StridedShard) and p.shape[value.dim] % value.split_factor:
        raise ConfigError(
            f"spmd tp_plan[{pattern!r}] = {value!r}: parameter {fqn!r} of shape {tuple(p.shape)}: "
            f"dimension {value.dim} does not split into {value.split_factor} equal groups. Give a "
            "split_factor that divides it, or Shard/Replicate."
        )


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """A plan resolved on one model: each placed parameter's placement on tp (the others
    replicate), and the activation layouts at the planned modules' boundaries."""

    params: dict[str, Placement]
    layouts: dict[str, tuple[Placement | None, ...]]


def resolve_plan(module: nn.Module, tp_plan: Mapping[str, Any]) -> TPPlan:
    """Every parameter fqn the plan places -> its placement on tp (the others replicate).

    Keys are ``fnmatch`` patterns. A key matching module fqns takes a
    ``torch.distributed.tensor.parallel`` style: ``ColwiseParallel`` splits an ``nn.Linear``'s
    output features (weight ``Shard(0)``, bias ``Shard(0)``), ``RowwiseParallel`` its input
    features (weight ``Shard(1)``, bias replicated), on an ``nn.Embedding`` the embedding
    dimension (``Shard(1)``) or the vocabulary (``Shard(0)``), on GPT-2's transposed ``Conv1D``
    the same with the weight's dimensions swapped; ``SequenceParallel`` and the
    ``PrepareModule*`` styles replicate the module's own parameters. A key matching parameter
    fqns takes a ``Placement`` (``Shard(d)`` or ``Replicate()``). The first matching key wins; a
    key that matches nothing is an error (a typo would silently replicate). A tied parameter
    must get one placement under all its names.

    A style's activation layouts hold at the module's boundary in forward: a value entering the
    module is redistributed to its ``desired_input_layouts`` (``ColwiseParallel``: replicated;
    ``RowwiseParallel``: split on the last dimension, or replicated token ids for an embedding;
    ``SequenceParallel``: split on the sequence), a value leaving it to its ``output_layouts``
    (``RowwiseParallel``'s default ``Replicate()`` is Megatron's all-reduce; ``Shard(1)`` a
    reduce-scatter into sequence parallelism). ``input_layouts`` and ``use_local_output`` have
    no meaning in a whole-step graph (values carry their layouts), and ``PrepareModuleInput``/
    ``PrepareModuleOutput`` add none.
    """
    from torch.distributed.tensor.parallel import ParallelStyle

    modules = dict(module.named_modules())
    params = dict(module.named_parameters(remove_duplicate=False))
    out: dict[str, Placement] = {}
    layouts: dict[str, tuple[Placement | None, ...]] = {}
    for pattern, value in tp_plan.items():
        if not isinstance(pattern, str):
            raise ConfigError(f"spmd tp_plan: keys are module or parameter name patterns, got {pattern!r}.")
        matched = False
        if isinstance(value, Placement):
            if isinstance(value, Shard | Replicate | torch_compat.StridedShard) is False:
                raise ConfigError(
                    f"spmd tp_plan[{pattern!r}] = {value!r}: a parameter's placement on tp is Shard(d), "
                    "Replicate() or, for a fused projection, _StridedShard(d, split_factor=k) (state is "
                    "never Partial)."
                )
            for fqn, p in params.items():
                if fnmatch.fnmatchcase(fqn, pattern):
                    matched = True
                    dim = getattr(value, "dim", None)  # Shard and _StridedShard
                    if isinstance(dim, int) and not -p.dim() <= dim < p.dim():
                        raise ConfigError(
                            f"spmd tp_plan[{pattern!r}] = {value!r}: parameter {fqn!r} of shape "
                            f"{tuple(p.shape)} has no dimension {dim}."
                        )
                    _check_strided(pattern, value, fqn, p)
                    out.setdefault(fqn, value)
        elif isinstance(value, ParallelStyle):
            kind = _kind_of(value)
            if kind is None:
                raise ConfigError(
                    f"spmd tp_plan[{pattern!r}]: {type(value).__name__} is not a style spmd maps "
                    "(ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output). "
                    "Give the module's parameters' placements on tp instead."
                )
            for fqn, m in modules.items():
                if fqn and fnmatch.fnmatchcase(fqn, pattern):
                    matched = True
                    for n, pl in _module_placements(fqn, m, kind, value).items():
                        out.setdefault(f"{fqn}.{n}", pl)
                    if fqn not in layouts and any(x is not None for x in _module_layouts(m, value)):
                        layouts[fqn] = _module_layouts(m, value)
        else:
            raise ConfigError(
                f"spmd tp_plan[{pattern!r}] = {value!r}: give a torch.distributed.tensor.parallel style "
                "(for a module pattern) or a Placement on tp (for a parameter pattern)."
            )
        if not matched:
            names = [n for n in (*modules, *params) if n]
            near = difflib.get_close_matches(pattern, names, n=3)
            hint = f" Did you mean {', '.join(map(repr, near))}?" if near else ""
            raise ConfigError(
                f"spmd tp_plan: {pattern!r} matches no "
                f"{'parameter' if isinstance(value, Placement) else 'module'} of the model.{hint}"
            )
    _check_tied(module, out)
    return TPPlan(out, layouts)


def _check_tied(module: nn.Module, placed: dict[str, Placement]) -> None:
    """A tied parameter has one placement: a name the plan leaves out takes its tied name's; two
    names placed differently are an error. Fills ``placed`` in place."""
    first: dict[int, tuple[str, Placement]] = {}
    named = list(module.named_parameters(remove_duplicate=False))
    for fqn, p in named:
        if fqn in placed:
            if id(p) in first and first[id(p)][1] != placed[fqn]:
                other, opl = first[id(p)]
                raise ConfigError(
                    f"spmd tp_plan: parameter {other!r} is tied to {fqn!r}, but the plan places them "
                    f"differently ({opl} and {placed[fqn]}). A tied parameter has one placement: place both "
                    "names alike (a vocabulary-parallel embedding and tied head: RowwiseParallel on the "
                    "embedding, ColwiseParallel on the head: both Shard(0) of the shared weight)."
                )
            first.setdefault(id(p), (fqn, placed[fqn]))
    for fqn, p in named:
        if fqn not in placed and id(p) in first:
            placed[fqn] = first[id(p)][1]


# ----------------------------------------------------------------------------- the graph


def _tp_spec(t: torch.Tensor, mesh: DeviceMesh, tp: int) -> tuple[Placement, ...] | None:
    """A state tensor's placements as the tensor-parallel expansion sees them: its tp placement,
    ``Replicate()`` on the data dimensions (local there; step 2 shards them)."""
    if not isinstance(t, DTensor):
        return None
    out: list[Placement] = [Replicate()] * mesh.ndim
    out[tp] = t.placements[tp]
    return tuple(out)


def _tp_piece(t: torch.Tensor, mesh: DeviceMesh, tp: int, fake: FakeTensorMode) -> torch.Tensor:
    """A fake tensor of ``t``'s tensor-parallel piece (its shape, dtype and device; no memory)."""
    assert isinstance(t, DTensor)
    shape = list(t.shape)
    pl = t.placements[tp]
    if isinstance(pl, Shard | torch_compat.StridedShard):  # a strided split: groups divide evenly
        d = pl.dim % t.dim()
        shape[d] = Shard.local_shard_size_and_offset(shape[d], mesh.size(tp), mesh.get_local_rank(tp))[0]
    with fake:
        return torch.empty(shape, dtype=t.dtype, device=torch_compat.local_tensor(t).device)


def expand_tp(
    gm: fx.GraphModule, state: LiftedState, args: StepArgs, mesh: DeviceMesh, tp_plan: Mapping[str, Any]
) -> fx.GraphModule:
    """Step 1 of an FSDP x TP partition: ``gm`` expanded over the mesh's ``tp`` dimension.

    Returns the graph of one tensor-parallel piece of the step on this rank's batch: parameter
    placeholders hold the pieces (full on the data dimensions), tensor-parallel collectives are
    explicit, gradients are tagged and not reduced over data (see the module docstring).
    """
    tp = plan.tp_dim(mesh)
    assert tp is not None
    state_ts = state.tensors(args.optimizer)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    reals = [_tp_piece(t, mesh, tp, fake) if isinstance(t, DTensor) else t for t in state_ts]
    reals += list(args.tensors)
    specs = [_tp_spec(t, mesh, tp) for t in state_ts]
    specs += [(Replicate(),) * mesh.ndim for _ in args.tensors]
    param_pl = {name: _tp_spec(p, mesh, tp) for name, p in state.params}
    regions: dict[str, Any] = {}
    for fqn, m in args.module.named_modules():
        if getattr(m, OVERRIDE_PLACEMENTS, None) is not None:
            raise ConfigError(
                f"spmd.DataParallel with tensor parallelism: Override {fqn!r} declares placements "
                "(Override.placements), which only DTensorExpandMode reads. Return None from placements() "
                "and place the stand-in's parameters with tp_plan."
            )
    layouts = {
        fqn: tuple((x,) if x is not None else None for x in pls)
        for fqn, pls in resolve_plan(args.module, tp_plan).layouts.items()
    }
    log.info(
        "spmd: tensor parallelism over %d ranks, data dimensions %s", mesh.size(tp), plan.data_dims(mesh)
    )
    return expand_graph(
        gm,
        mesh,
        reals,
        specs,
        param_pl,
        regions,
        plan.data_dims(mesh),
        reduce_local=False,
        boundaries=layouts,
        replicate_unknown=True,
        vocab_parallel_loss=True,
    )
