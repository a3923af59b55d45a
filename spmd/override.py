"""``spmd.Override``: a stand-in for a submodule the tracer cannot trace, and a hook on the
partitioned graph (the old ``torch.distributed._spmd`` API's ``Override``)."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from spmd.parallel.base import OVERRIDE_PLACEMENTS

log = logging.getLogger("spmd")


class Override(abc.ABC):
    """Swap an untraceable submodule for a traceable stand-in, and/or rewrite the graph.

    ``replacement`` is asked about every submodule, by fully qualified name, before
    the first trace; returning the module itself means "keep it" (and its children
    are asked in turn). The swap is permanent, as in the original ``_spmd``. The
    stand-in should reuse the original's parameters so training updates the model.
    ``transform`` runs on the partitioned graph with the real tensors that will be
    fed to its placeholders (state first, then the step's tensor arguments).
    """

    @abc.abstractmethod
    def replacement(self, fqn: str, orig_submodule: nn.Module) -> nn.Module: ...

    def transform(self, gm: fx.GraphModule, flat_state: list[torch.Tensor]) -> fx.GraphModule | fx.Graph:
        return gm

    def placements(self, fqn: str) -> tuple[Any, Any] | None:
        """For :class:`spmd.DTensorExpandMode`: ``(input_placements, output_placements)`` of the
        stand-in at ``fqn`` (each one Placement per mesh dimension), or None (default).

        With placements, the expansion runs the stand-in's forward and backward on local
        tensors, like ``torch.distributed.tensor.experimental.local_map``: the tensors it takes
        are redistributed to ``input_placements`` (its own parameters come as their local
        shards), what it returns is taken to have ``output_placements``, and the ops inside
        need no DTensor sharding rule. Without, the stand-in is expanded op by op.
        """
        return None


def apply_overrides(overrides: Sequence[Override], module: nn.Module) -> None:
    """Ask every override about every submodule of ``module`` (by fully qualified name, parents
    first) and swap in the stand-ins it returns, with their declared placements (in place)."""
    if not overrides:
        return

    def swap(prefix: str, parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            fqn = f"{prefix}.{name}" if prefix else name
            new = child
            for o in overrides:
                new = o.replacement(fqn, new)
            if new is child:
                swap(fqn, child)
            else:
                log.info("Override: %s (%s) -> %s", fqn, type(child).__name__, type(new).__name__)
                declared = [pl for o in overrides if (pl := o.placements(fqn)) is not None]
                if declared:
                    setattr(new, OVERRIDE_PLACEMENTS, declared[0])
                setattr(parent, name, new)

    swap("", module)
