"""Shape checks of the fused optimizer kernels in a step's graph, at compile.

``_fused_adam_``, ``_fused_adamw_`` and ``_fused_sgd_`` (and ``spmd::aligned_fused_optimizer_``,
which wraps them) do not check that a parameter's gradient and state tensors have its size: on
CPU a state tensor with fewer elements is read and written past its end (heap corruption, a
crash at some later ``free``; seen with an ``exp_avg`` replaced by a smaller tensor). The graph
holds every tensor's shape, so a mismatch is found once per compile, before anything runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from passes import torch_compat
from passes.fused_align import ALIGNED_FUSED
from passes.torch_compat import OpOverload
from spmd.errors import ConfigError

_PACKETS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")


def _lists(n: fx.Node) -> list[tuple[str, list[Any]]]:
    """The per-parameter tensor lists of a fused optimizer node, by name (``state_steps`` aside:
    one scalar per parameter); empty for any other node."""
    if n.op != "call_function" or not isinstance(n.target, OpOverload):
        return []
    if n.target is ALIGNED_FUSED:
        names = ("params", "grads", "state0", "state1", "state2")
        return [(name, list(n.args[i])) for i, name in enumerate(names)]  # type: ignore[arg-type]
    if n.target.name().split("::")[-1].split(".")[0] not in _PACKETS:
        return []
    out = []
    for i, a in enumerate(torch_compat.op_schema(n.target).arguments):
        if a.kwarg_only or a.name == "state_steps":
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name, [])
        out.append((a.name, list(v)))  # type: ignore[arg-type]
    return out


def _shape(x: Any) -> tuple[int, ...] | None:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def check_fused_optimizer_shapes(gm: fx.GraphModule, step_name: str) -> None:
    """:class:`ConfigError` if a fused optimizer kernel in ``gm`` gets a gradient or state tensor
    whose shape is not its parameter's (the kernel would write past the smaller one's end)."""
    for n in gm.graph.nodes:
        lists = _lists(n)
        if not lists:
            continue
        (_, params), *others = lists
        for name, tensors in others:
            if not tensors:
                continue  # a list the kernel does not use (max_exp_avg_sqs without amsgrad, ...)
            for k, (p, t) in enumerate(zip(params, tensors)):
                want, got = _shape(p), _shape(t)
                if want is not None and got is not None and want != got:
                    raise ConfigError(
                        f"spmd: {step_name}: the optimizer's {name}[{k}] has shape {list(got)}, its "
                        f"parameter {list(want)} (graph node {n.name}, {n.target}): the fused kernel "
                        "would read and write past the smaller tensor's end. The optimizer state does "
                        "not belong to this model (a state dict of another model or sharding?): load a "
                        "matching one, or let the optimizer create its state (optimizer.state.clear())."
                    )
