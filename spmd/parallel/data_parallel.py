"""``DataParallel``: replicate (DDP), fully_shard (FSDP/ZeRO-3)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn

from spmd.errors import ConfigError
from spmd.parallel.base import ParallelMode

if TYPE_CHECKING:
    from spmd.tracing import LiftedState, StepArgs

STYLES = ("replicate", "fully_shard")


@dataclasses.dataclass(frozen=True)
class DataParallel(ParallelMode):
    """Data parallelism over a 1-D mesh of all ranks.

    Args:
        parallel_style: ``"replicate"`` (DDP: gradients all-reduced, optimizer replicated) or
            ``"fully_shard"`` (FSDP/ZeRO-3: parameters, gradients and optimizer state sharded on dim 0).
        input_batch_dim: the batch dimension of the step's tensor arguments (each rank passes its
            local batch).
        mesh: a 1-D ``DeviceMesh``; default: all ranks of the default process group.
        reshard_after_forward: fully_shard only. True frees gathered parameters after forward and
            gathers them again for backward (FSDP FULL_SHARD); False keeps them (SHARD_GRAD_OP).
    """

    parallel_style: str = "replicate"
    _: dataclasses.KW_ONLY
    input_batch_dim: int = 0
    mesh: Any = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if self.parallel_style not in STYLES:
            raise ConfigError(
                f"spmd.DataParallel: unknown parallel_style {self.parallel_style!r}; valid styles are "
                f"{', '.join(repr(s) for s in STYLES)}."
            )
        if not isinstance(self.input_batch_dim, int) or self.input_batch_dim < 0:
            raise ConfigError(
                f"spmd.DataParallel: input_batch_dim must be a non-negative int, got {self.input_batch_dim!r}."
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError(
                "spmd.DataParallel: reshard_after_forward must be True or False, "
                f"got {self.reshard_after_forward!r}."
            )

    def prepare(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, args: StepArgs) -> None:
        return None

    def partition(self, gm: fx.GraphModule, state: LiftedState, args: StepArgs) -> fx.GraphModule:
        # World size 1: nothing to communicate. The multi-rank partitioners land with the
        # DataParallel partitioner issue.
        return gm
