"""``spmd.MixedPrecision``: low-precision compute and communication over fp32 master weights.

The semantics are FSDP2's ``MixedPrecisionPolicy`` (plus FSDP1's ``buffer_dtype``):
parameters stay fp32 in the model and the optimizer (sharded under fully_shard); the
step computes with copies cast to ``param_dtype``; gradients are reduced in
``reduce_dtype`` and handed to the optimizer in the parameters' dtype. Every cast is a
node of the compiled graph: the tracer makes the compute casts (``passes.meta.CAST_OF``
marks them), the partitioner moves each parameter's cast before its all-gather
(:mod:`spmd.parallel.gathers`) and adds the gradient casts around the reduction
(:mod:`spmd.parallel.reductions`).
"""

from __future__ import annotations

import dataclasses

import torch

from spmd.errors import ConfigError
from spmd.frontend.trace_hooks import ComputeCasts


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes for compute and gradient reduction; ``None`` leaves a dtype as it is.

    Keyword-only: FSDP2's ``MixedPrecisionPolicy`` has ``output_dtype`` third, where
    this has ``buffer_dtype``, so positional arguments would silently mean different things.

    Args:
        param_dtype: the dtype forward and backward compute with. Floating parameters are
            cast to it in the graph (under fully_shard, each rank casts its fp32 shard and
            the all-gather sends ``param_dtype``: half the bytes for bf16). The fp32
            parameters stay the optimizer's master weights. FSDP2 ``param_dtype``.
        reduce_dtype: the dtype gradients are all-reduced / reduce-scattered in; the
            reduced gradient is cast back to the parameter's dtype for the optimizer.
            ``None``: ``param_dtype`` (the gradients' own dtype), as in FSDP2.
        buffer_dtype: floating buffers are cast to it for compute (FSDP1 ``buffer_dtype``);
            buffers the step updates (BatchNorm running statistics) are updated in this
            dtype and written back to the model's buffer. ``None``: buffers as they are.
        cast_forward_inputs: cast the floating tensors passed to the forward of the root module
            and of every module named by ``cast_forward_inputs_at`` to ``param_dtype`` (FSDP2
            ``cast_forward_inputs``, which casts at each ``fully_shard``-ed module).
        cast_forward_inputs_at: where inputs are cast besides the root: ``None`` (default) at
            every communication unit, the numbered blocks of the model (``layers.0``,
            ``layers.1``, ...), as FSDP2 does when ``fully_shard`` is applied to each block and
            then the root; or a list of ``fnmatch`` patterns of module paths (``["layers.*"]``
            matches every submodule under ``layers``; ``[]``: the root only). A block that
            receives fp32 tensors computed at the root (rotary ``cos``/``sin``) computes with
            them in ``param_dtype`` only if it casts them.
        output_dtype: cast the floating tensors returned by the forward of the same modules
            (the root included) to this dtype (FSDP2 ``output_dtype``); ``None``: as computed.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    cast_forward_inputs_at: tuple[str, ...] | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for knob in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
            v = getattr(self, knob)
            if v is None:
                continue
            if not isinstance(v, torch.dtype):
                raise ConfigError(
                    f"spmd.MixedPrecision: {knob} must be a torch.dtype such as torch.bfloat16, or None; "
                    f"got {v!r}."
                )
            if not v.is_floating_point:
                raise ConfigError(
                    f"spmd.MixedPrecision: {knob} must be a floating-point dtype (torch.bfloat16, "
                    f"torch.float16, torch.float32), got {v}."
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise ConfigError(
                f"spmd.MixedPrecision: cast_forward_inputs must be True or False, got "
                f"{self.cast_forward_inputs!r}."
            )
        at = self.cast_forward_inputs_at
        if at is not None:
            if isinstance(at, str) or not hasattr(at, "__iter__") or not all(isinstance(p, str) for p in at):
                raise ConfigError(
                    "spmd.MixedPrecision: cast_forward_inputs_at must be None or a list of fnmatch "
                    f"patterns of module paths, such as ['layers.*'], got {at!r}."
                )
            object.__setattr__(self, "cast_forward_inputs_at", tuple(at))

    @property
    def gradient_reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in (``reduce_dtype``, else ``param_dtype``); None: unchanged."""
        return self.reduce_dtype or self.param_dtype

    def compute_casts(self) -> ComputeCasts | None:
        """What the tracer casts (None when nothing is cast at trace time)."""
        if self.param_dtype is None and self.buffer_dtype is None and self.output_dtype is None:
            return None
        return ComputeCasts(
            param_dtype=self.param_dtype,
            buffer_dtype=self.buffer_dtype,
            input_dtype=self.param_dtype if self.cast_forward_inputs else None,
            input_cast_at=self.cast_forward_inputs_at,
            output_dtype=self.output_dtype,
        )
