"""Folded search: plan on copies of the model with fewer identical layers, extrapolate in depth.

A transformer's layers are identical: the same class, the same parameter shapes and the same
settings, repeated ``L`` times in one ``nn.ModuleList``. Lowered for data parallelism, each
layer adds the same nodes, the same collectives (its parameters' all-gathers and reduce-scatters)
and the same saved activations, so the quantities a plan reports per configuration -- peak memory,
step time, compute and communication time, FLOPs, bytes on the wire -- grow by a fixed increment
per layer once the model is deep enough that no layer is special. :func:`spmd.plan` lowers every
configuration on two copies of the model truncated to ``L1 < L2`` layers (the rest unchanged:
embedding, head, the same batch, sequence and world size), takes the per-layer increment
``(v(L2) - v(L1)) / (L2 - L1)`` and extrapolates ``v(L) = v(L2) + increment x (L - L2)``. Tracing
and partitioning a 4-layer copy of an 80-layer model costs a few percent of the full model, so the
search costs little more than the final, exact simulation of the configurations it picks.

Only for a model whose layers are identical (:func:`find_layers`: one ``nn.ModuleList`` of
blocks of one class whose parameters, buffers and plain attributes are equal, except an attribute
that is each block's own index, like Hugging Face's ``layer_idx``; no parameter shared with the
rest of the model); otherwise every configuration is lowered exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from typing import Any

import torch
import torch.nn as nn

from passes import torch_compat
from passes.meta import MODULE, PHASE
from spmd.frontend import step_inputs
from spmd.plan.space import _label

log = logging.getLogger("spmd")

__all__ = [
    "Layers",
    "find_layers",
    "truncated_args",
    "extrapolate",
    "extrapolates",
    "same_site",
    "confirm",
    "peak_site",
    "LINEAR",
    "folded_search",
    "extrapolated_row",
]

_PLAIN = (int, float, str, bool, type(None))


@dataclasses.dataclass(frozen=True)
class Layers:
    """The model's repeated blocks: ``path`` (dotted, from the model) of an ``nn.ModuleList``."""

    path: str
    count: int


def _attrs(block: nn.Module) -> dict[str, Any]:
    """Every plain setting of ``block`` and its submodules, by dotted name."""
    out: dict[str, Any] = {}
    for prefix, m in block.named_modules():
        out[f"{prefix}:class"] = type(m).__qualname__
        for k, v in vars(m).items():
            if k.startswith("_") or k == "training":
                continue
            if isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)):
                out[f"{prefix}.{k}"] = v
        for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            out[f"{prefix}.{name}:tensor"] = (tuple(t.shape), t.dtype, t.requires_grad, t.layout)
    return out


def _identical(blocks: list[nn.Module]) -> bool:
    """Blocks of one class with equal settings and tensors (an attribute equal to each block's
    own index, e.g. ``layer_idx``, excepted)."""
    if len({type(b) for b in blocks}) != 1:
        return False
    attrs = [_attrs(b) for b in blocks]
    if any(a.keys() != attrs[0].keys() for a in attrs):
        return False
    for key in attrs[0]:
        values = [a[key] for a in attrs]
        if all(v == values[0] for v in values):
            continue
        if all(type(v) is int and v == i for i, v in enumerate(values)):
            continue  # the block's own index
        return False
    return True


def find_layers(model: nn.Module, *, min_layers: int) -> Layers | None:
    """The model's largest ``nn.ModuleList`` of identical blocks with ``>= min_layers`` of them
    (by parameter count), or None when it has none or a block shares a tensor with the rest."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < min_layers or not path:
            continue
        blocks = list(m)
        if not _identical(blocks):
            continue
        size = sum(p.numel() for p in m.parameters())
        if best is None or size > best[0]:
            best = (size, path, m)
    if best is None:
        return None
    _, path, layers = best
    inside = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    per_block = sum(len(list(b.parameters())) + len(list(b.buffers())) for b in layers)
    if len(inside) != per_block:
        return None  # a tensor shared between blocks
    outside = {
        id(t)
        for name, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
        if not (name == path or name.startswith(path + "."))
    }
    if inside & outside:
        return None  # tied to a tensor outside the blocks
    return Layers(path=path, count=len(layers))


def _truncated_module(model: nn.Module, path: str, n: int) -> nn.Module:
    """A copy of ``model`` whose ModuleList at ``path`` keeps its first ``n`` blocks: the modules
    on the path are shallow copies (their own ``_modules``), everything else is shared."""
    names = path.split(".")
    root = copy.copy(model)
    torch_compat.set_module_children(root, dict(torch_compat.module_children(model)))  # type: ignore[assignment]
    parent = root
    for name in names[:-1]:
        child = copy.copy(torch_compat.module_children(parent)[name])
        assert child is not None
        torch_compat.set_module_children(child, dict(torch_compat.module_children(child)))  # type: ignore[assignment]
        torch_compat.module_children(parent)[name] = child
        parent = child
    full = torch_compat.module_children(parent)[names[-1]]
    assert isinstance(full, nn.ModuleList)
    torch_compat.module_children(parent)[names[-1]] = nn.ModuleList(list(full)[:n])
    return root


def _truncated_optimizer(optim: torch.optim.Optimizer, keep: set[int]) -> torch.optim.Optimizer:
    """An optimizer of ``optim``'s class and groups over the parameters whose id is in ``keep``
    (their state, if any, carried over)."""
    groups = []
    for g in optim.param_groups:
        params = [p for p in g["params"] if id(p) in keep]
        if params:
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    # Every group carries all its settings; the constructor's defaults only need to be accepted
    # (AdamW's defaults hold a key its constructor does not take).
    accepted = inspect.signature(type(optim).__init__).parameters
    new = type(optim)(groups, **{k: v for k, v in optim.defaults.items() if k in accepted})
    for p, s in optim.state.items():
        if id(p) in keep:
            new.state[p] = dict(s)
    return new


def truncated_args(
    example_args: tuple[Any, ...], kwargs: dict[str, Any], layers: Layers, n: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The step's arguments with the model's blocks cut to the first ``n`` (and its optimizer
    over the parameters left). The originals are not changed; the result shares their tensors
    (copy it with :func:`spmd.simulate.fake_copy` before lowering)."""
    split = step_inputs.split_args(example_args, kwargs)
    model, optim = split.module, split.optimizer
    small = _truncated_module(model, layers.path, n)
    keep = {id(p) for p in small.parameters()}
    new_optim = _truncated_optimizer(optim, keep) if optim is not None else None

    def swap(x: Any) -> Any:
        if x is model:
            return small
        if optim is not None and x is optim:
            return new_optim
        if isinstance(x, tuple | list):
            return type(x)(swap(y) for y in x)
        if isinstance(x, dict):
            return {k: swap(v) for k, v in x.items()}
        return x

    return swap(example_args), swap(kwargs)


def set_config_depth(args: tuple[Any, ...], kwargs: dict[str, Any], full: int, n: int) -> None:
    """A Hugging Face model's ``config.num_hidden_layers`` (on the copy) says ``n``, not ``full``:
    its forward slices its layers by it, and its caches are sized by it."""
    model = step_inputs.split_args(args, kwargs).module
    seen: set[int] = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in seen and getattr(cfg, "num_hidden_layers", None) == full:
            seen.add(id(cfg))
            cfg.num_hidden_layers = n
            if isinstance(getattr(cfg, "layer_types", None), list):
                cfg.layer_types = cfg.layer_types[:n]


def extrapolate(v1: float, v2: float, l1: int, l2: int, depth: int) -> float:
    """``v`` at ``depth`` layers, linear in the layer count through ``(l1, v1)`` and ``(l2, v2)``."""
    return v2 + (v2 - v1) / (l2 - l1) * (depth - l2)


def extrapolates(options: dict[str, Any]) -> bool:
    """Whether a configuration's predictions are linear in the block count, as measured
    (benchmarks/results/plan-validation.md, "What a plan costs"): not with a remat budget given
    as a fraction, whose
    knapsack chooses what to recompute over the whole step (Llama 3.1 8B shapes, ``remat=0.5``:
    the peak extrapolated from 3 and 6 blocks was 17-25% low). Such a configuration is lowered
    on the full model."""
    remat = options.get("remat")
    return not (isinstance(remat, float) and not isinstance(remat, bool))


def _block_of(module: str, path: str) -> int | None:
    """The block index of a module path inside ``path`` (``model.layers.5.mlp`` -> 5), else None."""
    prefix = path + "."
    if not module.startswith(prefix):
        return None
    head = module[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def same_site(a: tuple[str, str], b: tuple[str, str], path: str, l1: int, l2: int) -> bool:
    """Whether the peaks of the ``l1``- and ``l2``-block copies are at the same point of the step:
    the same phase, and the same module outside the blocks, or the same block counted from the
    first or from the last (the first backward block is the last one). Only then is the
    difference of the two peaks the growth per block of one peak: where the peak moves (a late
    backward peak in the short copy, an early backward one in the long), linear extrapolation
    through the two mixes two lines, and the full model is lowered instead."""
    (pa, ma), (pb, mb) = a, b
    if pa != pb:
        return False
    ia, ib = _block_of(ma, path), _block_of(mb, path)
    if ia is None or ib is None:
        return ia is None and ib is None and ma == mb
    return ia == ib or l1 - 1 - ia == l2 - 1 - ib


def confirm(
    rows: list[Any],
    budget: int | None,
    margin: float,
    exact: Any,
    linear: tuple[str, ...],
    affordable: Any = lambda r: True,
) -> list[Any]:
    """Lower exactly the rows a folded search could get wrong: those whose extrapolated peak is
    within ``margin`` of the budget (fits or not could flip), then the best row, again until the
    best row is an exact one. Only rows ``affordable(row)`` says to: the others keep their
    extrapolation (``exact=False``)."""

    def key(r: Any) -> tuple[bool, float, int]:
        return (budget is not None and r.peak_bytes > budget, r.step_s, r.peak_bytes)

    def redo(r: Any) -> Any:
        e = exact(r)
        return dataclasses.replace(
            e, lower_s=e.lower_s + r.lower_s, extrapolated={k: getattr(r, k) for k in linear}
        )

    rows = list(rows)
    if budget is not None:
        rows = [
            redo(r) if abs(r.peak_bytes - budget) <= margin * budget and affordable(r) else r for r in rows
        ]
    rows.sort(key=key)
    while not rows[0].exact and affordable(rows[0]):
        rows[0] = redo(rows[0])
        rows.sort(key=key)
    return rows


def peak_site(gm: Any, node_name: str) -> tuple[str, str]:
    """(phase, module path) of the node ``node_name`` of ``gm`` (empty where not found)."""
    for n in gm.graph.nodes:
        if n.name == node_name:
            phase = n.meta.get(PHASE)
            return (getattr(phase, "value", str(phase or "")), str(n.meta.get(MODULE, "")))
    return ("", "")


LINEAR = ("peak_bytes", "step_s", "exposed_comm_s", "comm_s", "compute_s", "flops", "comm_bytes")


def folded_search(
    configs: list[dict[str, Any]],
    layers: Layers,
    depths: tuple[int, int],
    lower: Any,
    tokens: int,
) -> list[Any]:
    """Each configuration lowered at ``L1`` and ``L2`` blocks, extrapolated to the model's depth
    (one that does not extrapolate, :func:`extrapolates`, lowered on the full model)."""
    l1, l2 = depths
    rows = []
    for opts in configs:
        if not extrapolates(opts):
            rows.append(lower(opts, None))
            continue
        a, b = lower(opts, l1), lower(opts, l2)
        if not same_site(a.peak_site, b.peak_site, layers.path, l1, l2):
            # The peak is at another point of the step in the two copies (late backward in the
            # shorter, early backward in the longer): the increment between them is not the
            # peak's per-block growth (70B shapes, prefetch 0: extrapolated 171 GiB, exactly 232).
            # A third copy, deeper by as much again, usually has the longer one's peak: the
            # increment from the longer to it is that peak's growth.
            l3 = 2 * l2 - l1
            c = lower(opts, l3) if l3 < layers.count else None
            if c is None or not same_site(b.peak_site, c.peak_site, layers.path, l2, l3):
                log.info(
                    "spmd.plan: %s: the peak moves between %d, %d and %d blocks (%s, %s, %s): "
                    "lowered exactly",
                    _label(opts), l1, l2, l3, a.peak_site, b.peak_site, c and c.peak_site,
                )  # fmt: skip
                rows.append(lower(opts, None))
                continue
            log.info(
                "spmd.plan: %s: the peak moves between %d and %d blocks (%s, %s): extrapolated "
                "from %d and %d",
                _label(opts), l1, l2, a.peak_site, b.peak_site, l2, l3,
            )  # fmt: skip
            rows.append(extrapolated_row(b, c, l2, l3, layers, tokens, a.lower_s))
            continue
        rows.append(extrapolated_row(a, b, l1, l2, layers, tokens))
    return rows


def extrapolated_row(
    a: Any, b: Any, l1: int, l2: int, layers: Layers, tokens: int, more_s: float = 0.0
) -> Any:
    """The row at the model's depth, extrapolated from its lowerings ``a`` (``l1`` blocks) and
    ``b`` (``l2``); ``more_s``: seconds of other lowerings it took."""
    values = {k: extrapolate(getattr(a, k), getattr(b, k), l1, l2, layers.count) for k in LINEAR}
    step_s = values["step_s"]
    return dataclasses.replace(
        b,
        peak_bytes=round(values["peak_bytes"]),
        step_s=step_s,
        tokens_per_s=tokens / step_s if step_s > 0 else float("inf"),
        exposed_comm_s=values["exposed_comm_s"],
        comm_s=values["comm_s"],
        compute_s=values["compute_s"],
        flops=values["flops"],
        comm_bytes=round(values["comm_bytes"]),
        comm_bytes_by_dim={
            d: round(extrapolate(a.comm_bytes_by_dim.get(d, 0), v, l1, l2, layers.count))
            for d, v in b.comm_bytes_by_dim.items()
        },
        lower_s=a.lower_s + b.lower_s + more_s,
        exact=False,
    )
