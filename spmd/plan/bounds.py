"""What a configuration needs at least, known without lowering it: the search's first cut.

Parameters and optimizer state are resident for the whole step (the parameters a rank owns, and
the optimizer's state of them), whatever the passes do: a configuration whose share of them alone
is over the memory budget cannot fit, and :func:`spmd.plan` leaves it out without tracing or
partitioning it (a 70B model's replicate and hybrid_shard rows: ~850 GB of fp32 parameters and
Adam state over at most a node of 8 ranks), and a sharded style that keeps the gathered
parameters from forward to backward needs them all at the end of forward. Gradients are not
counted: with the optimizer overlapped into backward (``passes.optimizer_overlap``) they need
not all be alive at once.

The share is a lower bound: every parameter counts as divided by the configuration's sharding
degree (``tp`` for replicate; data shards x ``tp`` for the sharded styles), though some of them
(norms, biases, a class the automatic choice replicates) are not divided by ``tp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["state_bytes", "shard_degree", "gathered_bytes", "floor_bytes"]

# torch's optimizers whose state per parameter is a known number of parameter-sized tensors made
# by the first step (the step the plan traces), when the state is still empty.
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1, "RMSprop": 1}


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the parameters and of the optimizer's state, unsharded."""
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    if optimizer is None:
        return total
    per_param = _STATE_TENSORS.get(type(optimizer).__name__, 0)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                total += sum(
                    t.numel() * t.element_size()
                    for t in state.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0
                )
            elif p.requires_grad:
                total += per_param * p.numel() * p.element_size()
    return total


def shard_degree(opts: dict[str, Any], world: int, gpus_per_node: int) -> int:
    """How many ranks share one copy of the state under ``opts`` (a configuration's
    ``DataParallel`` keywords), at most."""
    tp = int(opts.get("tp_size") or 1)
    style = opts["parallel_style"]
    if style == "replicate":
        return tp
    if style == "hybrid_shard":
        return gpus_per_node  # dp_shard x tp: a node (spmd.parallel.plan.hybrid_mesh_shape)
    return world


def gathered_bytes(model: nn.Module, opts: dict[str, Any]) -> int:
    """Bytes of every parameter unsharded over the data ranks (a ``tp`` share of it), in the dtype
    the step computes with: what a sharded style that keeps its gathered parameters from forward
    to backward (``reshard_after_forward=False``) holds at the end of forward. 0 otherwise."""
    if opts["parallel_style"] == "replicate" or opts.get("reshard_after_forward", True):
        return 0
    mp = opts.get("mixed_precision")
    dtype = getattr(mp, "param_dtype", None)
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    total = sum(p.numel() * (size or p.element_size()) for p in model.parameters())
    return total // int(opts.get("tp_size") or 1)


def floor_bytes(
    total_state: int, opts: dict[str, Any], world: int, gpus_per_node: int, gathered: int = 0
) -> int:
    """The least bytes per rank ``opts`` needs: its share of the parameters and optimizer state,
    and ``gathered`` (:func:`gathered_bytes`) where it keeps the gathered parameters."""
    return -(-total_state // shard_degree(opts, world, gpus_per_node)) + gathered
