"""``DataParallel``'s options checked when it is made: each bad value a ``ConfigError`` that
names the option, what it got and what to write instead."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from spmd.errors import ConfigError
from spmd.parallel import plan
from spmd.parallel.auto_tp import AUTO
from spmd.parallel.mixed_precision import MixedPrecision
from spmd.parallel.offload import CPUOffloadPolicy

if TYPE_CHECKING:
    from spmd.parallel.data_parallel import DataParallel

STYLES = (plan.REPLICATE, plan.FULLY_SHARD, plan.HYBRID_SHARD)


def check_options(dp: DataParallel) -> None:
    """Raise ``ConfigError`` on the first bad option of ``dp`` (and normalise a few in place:
    lists of ignored modules to tuples, a tensor-parallel mesh without a plan to ``"auto"``)."""
    if dp.parallel_style not in STYLES:
        raise ConfigError(
            f"spmd.DataParallel: unknown parallel_style {dp.parallel_style!r}; valid styles are "
            f"{', '.join(repr(s) for s in STYLES)}."
        )
    _check_per_parameter_knobs(dp)
    if not isinstance(dp.input_batch_dim, int) or dp.input_batch_dim < 0:
        raise ConfigError(
            f"spmd.DataParallel: input_batch_dim must be a non-negative int, got {dp.input_batch_dim!r}."
        )
    for knob in ("reshard_after_forward", "broadcast_buffers", "sync_module_states"):
        if not isinstance(getattr(dp, knob), bool):
            raise ConfigError(f"spmd.DataParallel: {knob} must be True or False, got {getattr(dp, knob)!r}.")
    if dp.mesh is not None:
        plan.check_mesh(dp.mesh, dp.parallel_style)
    if not isinstance(dp.bucket_cap_mb, int | float) or dp.bucket_cap_mb <= 0:
        raise ConfigError(
            f"spmd.DataParallel: bucket_cap_mb must be a positive number, got {dp.bucket_cap_mb!r}."
        )
    if not isinstance(dp.min_unit_mb, int | float) or dp.min_unit_mb < 0:
        raise ConfigError(f"spmd.DataParallel: min_unit_mb must be a number >= 0, got {dp.min_unit_mb!r}.")
    if dp.bucket_mode not in (None, "size", "module"):
        raise ConfigError(
            f"spmd.DataParallel: bucket_mode must be 'size', 'module' or None, got {dp.bucket_mode!r}."
        )
    for knob in ("forward_prefetch", "backward_prefetch"):
        v = getattr(dp, knob)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"spmd.DataParallel: {knob} must be an int >= 0, got {v!r}.")
    mp = dp.mixed_precision
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
    if dp.param_init_fn is not None and not callable(dp.param_init_fn):
        raise ConfigError(
            "spmd.DataParallel: param_init_fn must be a function fn(module) that initialises the "
            f"module's own parameters and buffers, got {dp.param_init_fn!r}."
        )
    if dp.offload_policy is not None:
        if not isinstance(dp.offload_policy, CPUOffloadPolicy):
            raise ConfigError(
                "spmd.DataParallel: offload_policy must be spmd.CPUOffloadPolicy(...) or None, got "
                f"{dp.offload_policy!r}."
            )
        if dp.parallel_style != "fully_shard":
            raise ConfigError(
                "spmd.DataParallel: offload_policy offloads sharded state and needs "
                f"parallel_style='fully_shard', got {dp.parallel_style!r}. Use "
                "DataParallel('fully_shard', offload_policy=spmd.CPUOffloadPolicy())."
            )
    _check_tp(dp)
    a = dp.async_tp
    if not (a == "auto" or isinstance(a, bool) or (isinstance(a, int) and a >= 2)):
        raise ConfigError(
            f"spmd.DataParallel: async_tp must be 'auto', True, False or a number of chunks >= 2, got {a!r}."
        )
    m = dp.max_inflight_bytes
    if not (m is None or m == "auto" or (isinstance(m, int) and not isinstance(m, bool) and m > 0)):
        raise ConfigError(
            f"spmd.DataParallel: max_inflight_bytes must be a positive int, 'auto' or None, got {m!r}."
        )


def _check_tp(dp: DataParallel) -> None:
    ts = dp.tp_size
    if ts is not None and (not isinstance(ts, int) or isinstance(ts, bool) or ts < 1):
        raise ConfigError(f"spmd.DataParallel: tp_size must be an int >= 1, got {ts!r}.")
    if dp.tp_plan is not None and dp.tp_plan != AUTO and not isinstance(dp.tp_plan, Mapping):
        raise ConfigError(
            "spmd.DataParallel: tp_plan must be a dict {module or parameter name pattern: "
            "ColwiseParallel()/RowwiseParallel()/... or a Placement}, or 'auto' (spmd chooses), got "
            f"{dp.tp_plan!r}."
        )
    mesh_tp = dp.mesh is not None and plan.tp_dim(dp.mesh) is not None
    if (
        dp.tp_size is not None
        and dp.mesh is not None
        and (not mesh_tp or dp.mesh.size(plan.tp_dim(dp.mesh)) != dp.tp_size)
    ):
        raise ConfigError(
            "spmd.DataParallel: give either tp_size or a mesh with a 'tp' dimension, not both "
            "(they disagree)."
        )
    if dp.tp_plan is not None and not (mesh_tp or (dp.tp_size or 1) > 1):
        raise ConfigError(
            "spmd.DataParallel: tp_plan needs tensor-parallel ranks: tp_size=N (N > 1) or a mesh with "
            "a dimension named 'tp', e.g. init_device_mesh('cpu', (2, 2), "
            "mesh_dim_names=('dp_shard', 'tp'))."
        )
    if (mesh_tp or (dp.tp_size or 1) > 1) and dp.tp_plan is None:
        object.__setattr__(dp, "tp_plan", AUTO)  # tensor-parallel ranks, no plan: spmd chooses
    if dp.tp_plan is not None and dp.offload_policy is not None:
        raise ConfigError("spmd.DataParallel: offload_policy with tensor parallelism is not supported.")


def _check_per_parameter_knobs(dp: DataParallel) -> None:
    for knob in ("ignored_modules", "ignored_params"):
        v = getattr(dp, knob)
        if isinstance(v, str | nn.Module | torch.Tensor) or not hasattr(v, "__iter__"):
            raise ConfigError(
                f"spmd.DataParallel: {knob} must be a list (of modules/parameters or their fully "
                f"qualified names), got {type(v).__name__}."
            )
        object.__setattr__(dp, knob, tuple(v))
    if dp.module_styles is None:
        return
    if not isinstance(dp.module_styles, Mapping):
        raise ConfigError(
            "spmd.DataParallel: module_styles must be a dict {module fqn: style}, got "
            f"{type(dp.module_styles).__name__}."
        )
    sharded = plan.HYBRID_SHARD if dp.parallel_style == plan.HYBRID_SHARD else plan.FULLY_SHARD
    valid = (plan.REPLICATE, sharded)
    for fqn, style in dp.module_styles.items():
        if not isinstance(fqn, str) or style not in valid:
            raise ConfigError(
                f"spmd.DataParallel: module_styles[{fqn!r}] = {style!r}; keys must be module fqns and "
                f"styles one of {valid} with parallel_style={dp.parallel_style!r} (use "
                "ignored_modules to keep a module rank-local)."
            )
