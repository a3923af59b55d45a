"""The interface every parallel mode implements."""

from __future__ import annotations

import abc
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn

if TYPE_CHECKING:
    from spmd.frontend.step_inputs import LiftedState, StepArgs
    from spmd.frontend.trace_hooks import ComputeCasts

# Attribute of an Override's stand-in module: the (input, output) placements it declared.
OVERRIDE_PLACEMENTS = "_spmd_override_placements"


class ParallelMode(abc.ABC):
    """Turns the traced single-device graph into the graph each rank runs.

    ``prepare`` runs on every call before the graph cache is consulted (cheap when
    there is nothing to do); it may convert the model's and optimizer's state to
    their distributed form. ``partition`` runs once per traced graph.
    """

    def prepare(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, args: StepArgs) -> None:
        return None

    def needs_trace_before_prepare(self, module: nn.Module) -> bool:
        """Whether ``prepare`` needs a choice made from the step's trace on the undistributed
        model first (automatic tensor-parallel placements); the api then traces it and calls
        :meth:`choose_from_trace`."""
        return False

    def choose_from_trace(self, module: nn.Module, gm: fx.GraphModule, profile: Any = None) -> Any:
        """Make the choices ``prepare`` needs from ``gm``, the step traced on the undistributed
        model (single-device semantics), priced on ``profile`` (the device profile the step is
        lowered for; None: the local device's); returns the choice (for :meth:`reuse_choice`)."""
        return None

    def choice_key(self) -> Hashable | None:
        """What :meth:`choose_from_trace`'s choice depends on besides the trace and the model's
        structure (None: never reused). ``spmd.plan`` lowers many configurations of copies of one
        model: those with equal keys and equal traces reuse the first one's choice."""
        return None

    def reuse_choice(self, module: nn.Module, choice: Any) -> None:
        """Adopt for ``module`` a ``choice`` :meth:`choose_from_trace` made for a model of the
        same structure, with the same :meth:`choice_key` and trace."""
        return None

    @abc.abstractmethod
    def partition(self, gm: fx.GraphModule, state: LiftedState, args: StepArgs) -> fx.GraphModule: ...

    def trace_args(self, args: StepArgs) -> StepArgs:
        """The step's arguments as the single-device trace should see them (default: as given).

        A mode whose graph has global semantics (``DTensorExpandMode``) turns each rank's local
        batch into a tensor of the global shape here; the compiled step is still fed the local one.
        """
        return args

    def trace_casts(self) -> ComputeCasts | None:
        """The dtypes the traced step should compute in (mixed precision); None: as stored."""
        return None

    def accumulate_after_reduce(self) -> bool:
        """Where a step that does not zero gradients adds the new gradient to ``p.grad``:
        before the reduction (DDP reduces the accumulated gradient) or after it (FSDP2
        reduce-scatters the new gradient, then adds it to the sharded ``p.grad``)."""
        return False

    def partition_key(self) -> Hashable | None:
        """Equal for two modes whose ``partition`` makes the same graph from the same trace and
        state (they may differ in ``pass_options``), so a plan partitions once for both; None
        (default): never shared."""
        return None

    def pass_options(self) -> dict[str, Any]:
        """Knobs the pass pipeline reads (bucket sizes, prefetch depth, ...)."""
        return {}
