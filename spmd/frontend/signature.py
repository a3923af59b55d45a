"""When a traced graph can be reused: the call's signature and the comparison of two traces.

:func:`signature` is everything a traced graph bakes in (argument shapes and values, model and
optimizer structure): the key of a compiled step's graph cache (:class:`spmd.api.CompiledStep`),
next to the attribute guards of :mod:`spmd.frontend.guards`. :func:`same_trace` says whether two
traces of a step gave the same graph (the guards of a step that changes what it reads on its
first call are taken from a second trace only then).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.nn as nn

from spmd.frontend import optim as optim_utils
from spmd.frontend import step_inputs, tracing


def same_trace(a: tracing.TracedStep, b: tracing.TracedStep) -> bool:
    """The same graph (code, constants, outputs and gradients) from two traces of a step."""
    if a.gm.code != b.gm.code or a.out_spec != b.out_spec or a.grads != b.grads:
        return False
    if a.grad_outs != b.grad_outs or a.grad_cleared != b.grad_cleared or len(a.slots) != len(b.slots):
        return False
    if not all(same_constant(x, y) for x, y in zip(a.out_constants, b.out_constants, strict=True)):
        return False
    return all(
        same_constant(getattr(a.gm, n.target, None), getattr(b.gm, n.target, None))
        for n in a.gm.graph.nodes
        if n.op == "get_attr"
    )


def same_constant(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.shape == y.shape
            and x.dtype == y.dtype
            and torch.equal(x, y)
        )
    return type(x) is type(y) and bool(x == y)


def tensor_sig(t: torch.Tensor) -> tuple[Any, ...]:
    # Strides too: the graph bakes in layout decisions (view vs copy, as_strided), so a
    # differently laid-out input (a transposed or channels_last batch) gets its own graph.
    layout = None if t.is_contiguous() else tuple(t.stride())
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, layout)


def signature(step_args: step_inputs.StepArgs) -> Hashable:
    """Everything the traced graph bakes in: argument shapes and values, model and optimizer structure."""
    arg_sig: list[Any] = []
    for x in step_args.leaves:
        if isinstance(x, torch.Tensor):
            arg_sig.append(tensor_sig(x))
        elif isinstance(x, nn.Module | torch.optim.Optimizer):
            arg_sig.append(type(x))
        else:
            arg_sig.append((type(x), x))
    module, optimizer = step_args.module, step_args.optimizer
    model_sig: tuple[Any, ...] = tuple(m.training for m in module.modules())
    # A parameter's existing .grad is a graph input (accumulated onto): its presence picks the graph.
    model_sig += tuple((n, id(p), *tensor_sig(p), p.grad is None) for n, p in module.named_parameters())
    model_sig += tuple((n, *tensor_sig(b)) for n, b in module.named_buffers())
    optim_sig: tuple[Any, ...] = ()
    if optimizer is not None:
        groups = []
        for g in optimizer.param_groups:
            lifted = optim_utils.lr_is_liftable(optimizer, g)
            state_sig = tuple(
                (k, tensor_sig(v) if isinstance(v, torch.Tensor) else v)
                for p in g["params"]
                for k, v in optimizer.state.get(p, {}).items()
            )
            groups.append(
                (
                    tuple(id(p) for p in g["params"]),
                    optim_utils.hyperparameters(g, skip_lr=lifted),
                    state_sig,
                )
            )
        optim_sig = (type(optimizer), tuple(groups))
    return (tuple(arg_sig), step_args.spec, model_sig, optim_sig, torch.is_grad_enabled())
