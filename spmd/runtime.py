"""Run a compiled graph on the real model, optimizer and batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from passes.meta import Role
from spmd import tracing
from spmd.parallel.sharding import local


@dataclasses.dataclass
class Executable:
    """A final graph plus the recipe for feeding its placeholders."""

    gm: fx.GraphModule
    slots: list[tracing.Slot]
    out_spec: pytree.TreeSpec
    out_constants: list[Any]

    def inputs(self, step_args: tracing.StepArgs) -> list[torch.Tensor]:
        module, optimizer = step_args.module, step_args.optimizer
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())
        tensors = step_args.tensors
        flat: list[torch.Tensor] = []
        for slot in self.slots:
            if slot.role is Role.PARAM:
                flat.append(params[slot.name])
            elif slot.role is Role.BUFFER:
                flat.append(buffers[slot.name])
            elif slot.role is Role.OPTIM_STATE:
                assert optimizer is not None
                pname, key = slot.key
                flat.append(optimizer.state[params[pname]][key])
            elif slot.role is Role.HYPERPARAM:
                assert optimizer is not None
                flat.append(tracing.lr_tensor(optimizer.param_groups[slot.key]["lr"]))
            else:
                flat.append(tensors[int(slot.name.rsplit(".", 1)[1])])
        return flat

    def run(self, step_args: tracing.StepArgs) -> Any:
        flat = [local(t) for t in self.inputs(step_args)]
        with torch.no_grad():
            outs = self.gm(*flat)
        it = iter(outs)
        leaves = [next(it) if c is None else c for c in self.out_constants]
        return pytree.tree_unflatten(leaves, self.out_spec)


def make_executable(gm: fx.GraphModule, traced: tracing.TracedStep, state: tracing.LiftedState) -> Executable:
    return Executable(
        gm=gm, slots=list(traced.slots), out_spec=traced.out_spec, out_constants=traced.out_constants
    )
