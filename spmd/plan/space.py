"""The search space of :func:`spmd.plan`: which ``DataParallel`` configurations a plan tries
(:func:`configurations`), how each is written for the user (:func:`expression`, the
``spmd.compile(...)`` call; :func:`_label`, the table's short name), and the memory budget's
parsing (:func:`parse_bytes`). Pure functions of the options: nothing here traces or prices."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch

from spmd.errors import ConfigError
from spmd.parallel import DataParallel, MixedPrecision

_DP_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataParallel)}


def parse_bytes(x: int | float | str | None) -> int | None:
    """``80GiB``, ``80GB``, ``512MiB``, ``1e9`` or a number of bytes -> bytes (None stays None)."""
    if x is None or isinstance(x, int | float) and not isinstance(x, bool):
        return None if x is None else int(x)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(x))
    if not m:
        raise ConfigError(
            f"spmd.plan: memory_per_rank {x!r} is not a size; write e.g. 80GiB, 80GB or 8.6e10."
        )
    unit = m.group(2) or "B"
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}.get(unit) or 2 ** (
        10 * "KMGT".index(unit[0]) + 10
    )
    return int(float(m.group(1)) * scale)


class NamedPlan(dict):  # type: ignore[type-arg]
    """A tensor-parallel plan (``DataParallel(tp_plan=...)``) that writes itself as the code that
    builds it (``tp_plans.llama()``), so that a configuration's expression is runnable."""

    def __init__(self, plan: Any = (), expr: str = "tp_plan") -> None:  # defaults: dataclasses.asdict's copy
        super().__init__(plan)
        self.expr = expr

    def __repr__(self) -> str:
        return self.expr

    def __hash__(self) -> int:  # type: ignore[override]  # hashed by what it says: one plan per search
        return hash(self.expr)


def code(expr: str) -> str:
    """``expr`` (a configuration's ``spmd.compile(...)`` call) with the imports it needs."""
    imports = ["import spmd"]
    if "torch." in expr:
        imports.append("import torch")
    if "tp_plans." in expr:
        imports.append("from spmd.parallel import tp_plans")
    return "; ".join([*imports, expr])


def tp_sizes(world_size: int, gpus_per_node: int, sizes: Sequence[int] | None) -> list[int]:
    """The tensor-parallel sizes searched: ``sizes`` (default 1, 2, 4, 8), each within a node
    (dividing ``gpus_per_node``, so a tp group's consecutive ranks share a node's links) and
    dividing ``world_size``."""
    out = [t for t in (sizes or (1, 2, 4, 8)) if t >= 1 and gpus_per_node % t == 0 and world_size % t == 0]
    return sorted(set(out)) or [1]


def _mp_expr(mp: MixedPrecision) -> str:
    parts = []
    for f in dataclasses.fields(mp):
        v = getattr(mp, f.name)
        if v == f.default:
            continue
        parts.append(f"{f.name}={v!r}" if not isinstance(v, torch.dtype) else f"{f.name}={v}")
    return f"spmd.MixedPrecision({', '.join(parts)})"


def expression(options: dict[str, Any]) -> str:
    """The ``spmd.compile(...)`` call of a configuration (evaluates with ``spmd`` and ``torch``)."""
    opts = dict(options)
    remat = opts.pop("remat", None)
    style = opts.pop("parallel_style")
    args = [repr(style)]
    for k, v in opts.items():
        if v == _DP_DEFAULTS.get(k):
            continue
        args.append(f"{k}={_mp_expr(v) if isinstance(v, MixedPrecision) else repr(v)}")
    dp = f"spmd.DataParallel({', '.join(args)})"
    extra = f", remat={remat!r}" if "remat" in options else ""
    return f"spmd.compile(parallel_mode={dp}{extra})"


def _label(options: dict[str, Any]) -> str:
    o = options
    style = o["parallel_style"]
    bits = [style]
    if o.get("tp_size", 1) > 1:
        bits.append(f"tp {o['tp_size']}")
    if style != "replicate":
        if not o.get("reshard_after_forward", True):
            bits.append("no reshard")
        bits.append(f"prefetch {o.get('forward_prefetch', 1)}")
        if "min_unit_mb" in o:
            bits.append(f"unit>={o['min_unit_mb']:g}MiB")
    if "remat" in o:
        bits.append(f"remat={o['remat']}")
    return ", ".join(bits)


def configurations(
    *,
    world_size: int,
    gpus_per_node: int,
    mixed_precision: MixedPrecision | None,
    styles: Sequence[str],
    prefetch: Sequence[int],
    min_unit_mb: Sequence[float],
    reshard: Sequence[bool],
    remat: Sequence[Any],
    tp_plan: NamedPlan | str | None = None,
    tp: Sequence[int] = (1,),
) -> list[dict[str, Any]]:
    """The DataParallel keyword sets to try (see the module docstring): with ``tp_plan``, each
    tensor-parallel size of ``tp`` above 1 adds the replicate and fully_shard configurations on
    a ``(data, tp)`` mesh, and hybrid_shard's on a ``(dp_replicate, dp_shard, tp)`` mesh where a
    node holds at least two tp groups (``dp_shard`` = ``gpus_per_node // tp`` >= 2: with one, it
    is replicate's). ``tp_plan="auto"``: automatic placements, chosen while each configuration
    lowers."""
    out = _data_configurations(
        world_size=world_size,
        gpus_per_node=gpus_per_node,
        mixed_precision=mixed_precision,
        styles=styles,
        prefetch=prefetch,
        min_unit_mb=min_unit_mb,
        reshard=reshard,
        remat=remat,
    )
    if tp_plan is None:
        return out
    for t in tp:
        if t <= 1:
            continue
        for opts in _data_configurations(
            world_size=world_size,
            gpus_per_node=gpus_per_node,
            mixed_precision=mixed_precision,
            styles=[s for s in styles if s != "hybrid_shard" or _hybrid_with_tp(gpus_per_node, t)],
            prefetch=prefetch,
            min_unit_mb=min_unit_mb,
            reshard=reshard,
            remat=remat,
        ):
            remat_opt = {"remat": opts.pop("remat")} if "remat" in opts else {}
            out.append({**opts, "tp_size": t, "tp_plan": tp_plan, **remat_opt})
    return out


def _hybrid_with_tp(gpus_per_node: int, tp: int) -> bool:
    """Whether hybrid_shard x tp has a data-sharding dimension: ``gpus_per_node // tp`` >= 2
    ranks shard within a node (:func:`spmd.parallel.plan.hybrid_mesh_shape`'s node)."""
    return gpus_per_node % tp == 0 and gpus_per_node // tp >= 2


def _data_configurations(
    *,
    world_size: int,
    gpus_per_node: int,
    mixed_precision: MixedPrecision | None,
    styles: Sequence[str],
    prefetch: Sequence[int],
    min_unit_mb: Sequence[float],
    reshard: Sequence[bool],
    remat: Sequence[Any],
) -> list[dict[str, Any]]:
    mp = {"mixed_precision": mixed_precision} if mixed_precision is not None else {}
    out: list[dict[str, Any]] = []
    sharded_remat: list[dict[str, Any]] = [{"remat": r} for r in remat] or [{}]
    if "replicate" in styles:
        out.append({"parallel_style": "replicate", **mp})
    if "fully_shard" in styles:
        for rs in reshard:
            for d in prefetch:
                for u in min_unit_mb:
                    for rm in sharded_remat:
                        out.append(
                            {
                                "parallel_style": "fully_shard",
                                "reshard_after_forward": rs,
                                "forward_prefetch": d,
                                "backward_prefetch": d,
                                "min_unit_mb": u,
                                **mp,
                                **rm,
                            }
                        )
    if "hybrid_shard" in styles and world_size > gpus_per_node and world_size % gpus_per_node == 0:
        for d in prefetch:
            for rm in sharded_remat:
                out.append(
                    {
                        "parallel_style": "hybrid_shard",
                        "forward_prefetch": d,
                        "backward_prefetch": d,
                        **mp,
                        **rm,
                    }
                )
    return out


_CHOICE = re.compile(r"(?P<names>.*?)(?: \(x\d+\))?: [^:]*?, (?P<verdict>sharded|replicated): ")


def tp_summary(choices: Sequence[str]) -> str:
    """The automatic placements of a row in one line, from its report's ``tp_choices`` (one
    line per class, :meth:`spmd.parallel.auto_tp.Decision.describe`): ``"2 classes sharded
    (tok.weight; blocks.*.fc.weight -> blocks.*.out.weight), 1 class replicated (...)"``."""
    groups: dict[str, list[str]] = {"sharded": [], "replicated": []}
    for c in choices:
        m = _CHOICE.match(c)
        groups[m.group("verdict") if m else "replicated"].append(m.group("names") if m else c)
    if not choices:
        return "nothing to shard: every parameter replicates"
    parts = [
        f"{len(names)} class{'es' if len(names) != 1 else ''} {verdict} ({'; '.join(names)})"
        for verdict, names in groups.items()
        if names
    ]
    return ", ".join(parts)


def _mesh_words(opts: dict[str, Any], world: int, gpus_per_node: int) -> str:
    """The mesh a configuration runs on, in words (the default mesh of its DataParallel)."""
    tp = int(opts.get("tp_size") or 1)
    style = opts["parallel_style"]
    if style == "hybrid_shard":
        local = gpus_per_node // tp
        dims = [("dp_replicate", world // gpus_per_node), ("dp_shard", local)]
    else:
        dims = [("dp_replicate" if style == "replicate" else "dp_shard", world // tp)]
    if tp > 1:
        dims.append(("tp", tp))
    return " x ".join(f"{n} {k}" for n, k in dims)
