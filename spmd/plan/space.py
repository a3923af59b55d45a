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
) -> list[dict[str, Any]]:
    """The DataParallel keyword sets to try (see the module docstring)."""
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
