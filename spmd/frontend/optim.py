"""What the tracer needs to know about ``torch.optim``.

Three facts drive this module (measured on torch 2.13, see DESIGN.md):

* The optimizers only take their tensor-valued, traceable code paths while
  ``torch.compiler.is_compiling()`` is true; :func:`traceable_optimizers` sets it inside
  ``optimizer.step()`` only (model code asking the same question gets eager's answer).
* The traced step must be the steady-state step, so optimizer state has to exist
  before tracing: :func:`ensure_state` creates it exactly as a fresh optimizer's
  first step would see it.
* A learning rate baked into the graph as a constant would make every scheduler
  step a retrace. Where the optimizer can take a tensor learning rate without
  changing its arithmetic, :func:`lr_is_liftable` says so and the tracer feeds the
  learning rate as a graph input instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from passes import torch_compat

log = logging.getLogger("spmd")

# Keys of a param group that are not hyperparameters.
_NON_HYPER_KEYS = frozenset({"params", "param_names"})


# In-place fused optimizer kernels that torch 2.13 ships without a Meta kernel. Fake tensor
# mode then runs the real CPU kernel on zero-filled real copies of every parameter, gradient
# and state tensor: for GPT-2 small with fused AdamW that is ~2 GB, and the trace took 24.5 s
# instead of 6.7 s (benchmarks/profiles/trace_time.py).
# They return nothing and change no tensor's metadata, so the Meta kernel has nothing to do.
_FUSED_INPLACE_OPS = (
    "_fused_adam_.tensor_lr",
    "_fused_adamw_.tensor_lr",
    "_fused_sgd_.default",
    "_fused_sgd_.tensor_lr",
)
_meta_lib: torch.library.Library | None = None


def _no_op_meta(*args: Any, **kwargs: Any) -> None:
    return None


def register_fused_meta_kernels() -> list[str]:
    """Give the fused optimizer ops above the Meta kernel they lack; idempotent.

    Returns the overloads registered by this call (none when torch already has them).
    """
    global _meta_lib
    missing = []
    for name in _FUSED_INPLACE_OPS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet), overload)
        # (not the "computed" table: that reports a Meta kernel which only raises NotImplementedError)
        if not torch_compat.dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
            missing.append(op)
    if missing:
        if _meta_lib is None:
            _meta_lib = torch.library.Library("aten", "IMPL")  # kept for the life of the process
        for op in missing:
            _meta_lib.impl(op, _no_op_meta, "Meta")
        log.debug("registered Meta kernels for %s", ", ".join(str(op) for op in missing))
    return [str(op) for op in missing]


@contextlib.contextmanager
def traceable_optimizers(optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
    """Make ``optimizer`` take its traceable code paths (tensor ``step``, no ``.item()``).

    ``torch.optim`` takes them only while ``torch.compiler.is_compiling()`` is true. That
    question is asked by model code too (torch's ``torch.compiler.is_compiling``, the older
    ``torch._dynamo.is_compiling`` / ``torch._utils.is_compiling``, and ``transformers``'
    ``is_torchdynamo_compiling``, which all read the same flag), and eager answers it "no":
    Hugging Face's Mamba, for one, switches its scan to another algorithm (other rounding)
    when it is true. So the flag is true only inside ``optimizer.step()``: a step pre-hook on
    this optimizer sets it, a post-hook clears it, and forward and backward see eager's
    answer. The one place that sets the private is-compiling flag (``passes.torch_compat``).
    Also makes sure the fused kernels can be traced without running them
    (:func:`register_fused_meta_kernels`).
    """
    register_fused_meta_kernels()
    old = torch_compat.get_compiling_flag()
    handles = []
    if optimizer is not None:

        def set_flag(opt: Any, args: Any, kwargs: Any) -> None:
            torch_compat.set_compiling_flag(True)

        def clear_flag(opt: Any, args: Any, kwargs: Any) -> None:
            torch_compat.set_compiling_flag(old)

        # Registered last: the user's own step pre-hooks run before, with eager's answer.
        handles = [optimizer.register_step_pre_hook(set_flag), optimizer.register_step_post_hook(clear_flag)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        torch_compat.set_compiling_flag(old)


def _adam_family(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt, torch.optim.Adam | torch.optim.AdamW)


def lr_is_liftable(opt: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``group['lr']`` can be a graph input (a 0-d tensor) instead of a constant.

    Fused kernels have a tensor-lr overload that reads the value once as a double:
    the arithmetic is unchanged, so results stay bit-for-bit. The non-fused Adam
    family takes a tensor lr on its ``capturable`` path, which the tracer switches
    on (that path is already tolerance-compared, see :func:`trace_group_overrides`).
    SGD's foreach path multiplies by a tensor lr where eager fuses a multiply-add,
    which changes the last bit, so it keeps a constant lr and retraces per value.
    """
    if "lr" not in group:
        return False
    if group.get("fused"):
        return True
    return _adam_family(opt) and not group.get("differentiable", False)


def trace_group_overrides(opt: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """Param-group entries to set while tracing (restored afterwards)."""
    if _adam_family(opt) and not group.get("fused"):
        # The non-capturable path calls `.item()`-like scalar math on `step`; the
        # capturable path keeps everything in tensors (and accepts a tensor lr).
        return {"capturable": True}
    return {}


def hyperparameters(group: dict[str, Any], *, skip_lr: bool) -> tuple[tuple[str, Any], ...]:
    """The param group's hyperparameters as a hashable key (constants baked into the graph)."""
    items = []
    for k in sorted(group):
        if k in _NON_HYPER_KEYS or (skip_lr and k == "lr"):
            continue
        v = group[k]
        if isinstance(v, torch.Tensor):
            v = ("tensor", tuple(v.shape), v.dtype, v.tolist() if v.numel() <= 4 else id(v))
        elif isinstance(v, list):
            v = tuple(v)
        items.append((k, v))
    return tuple(items)


@contextlib.contextmanager
def _saved_grads(params: list[torch.Tensor]) -> Iterator[None]:
    saved = [p.grad for p in params]
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


def ensure_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Create the optimizer state of ``params`` as a fresh optimizer's first step sees it.

    Runs one real step with zero gradients and a zero learning rate over exactly the
    parameters that have no state yet (so neither the parameters nor any existing
    state change), then zeroes the new state, ``step`` included. For SGD, Adam and
    AdamW the traced steady-state step then computes the same numbers as eager's
    first step. Returns the parameters whose state was created here.
    """
    fresh = [p for p in params if p.requires_grad and not opt.state.get(p)]
    if not fresh:
        return []
    fresh_ids = {id(p) for p in fresh}
    all_params = [p for g in opt.param_groups for p in g["params"]]
    saved_lrs = [g.get("lr") for g in opt.param_groups]
    with _saved_grads(all_params), torch.no_grad():
        for p in all_params:
            p.grad = torch.zeros_like(p) if id(p) in fresh_ids else None
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        try:
            opt.step()
        finally:
            for g, lr in zip(opt.param_groups, saved_lrs):
                if lr is not None:
                    g["lr"] = lr
        for p in fresh:
            # .get: `opt.state` is a defaultdict, and indexing it would give stateless
            # optimizers (SGD without momentum) an empty entry eager never has.
            for v in opt.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    v.zero_()
    log.debug("created optimizer state for %d parameters", len(fresh))
    return fresh


def drop_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Forget state created by :func:`ensure_state` for parameters that got no gradient."""
    for p in params:
        opt.state.pop(p, None)
