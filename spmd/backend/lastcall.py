"""The fast path of a cached step: repeat the last call's graph and input recipe when nothing changed.

A call through the slow path splits the arguments, walks the module tree (structure
check, signature, parameters by name), checks the attribute guards and builds the
graph's input list: about a millisecond for a 24-block model. :class:`LastCall`
remembers what that call found and what it depended on; the next call compares only
the things that can change without touching a module:

- :func:`spmd.frontend.guards.module_version` (attributes, submodules, parameters, buffers,
  hooks, ``to()``: anything that changes the tree through a module bumps it),
- the arguments (the same module and optimizer objects; each tensor's shape, dtype,
  device, ``requires_grad`` and layout; each constant's type and value),
- per parameter: whether it has a ``.grad`` and whether it requires one,
- the optimizer's state: the same per-parameter dicts holding the same tensors, and its
  groups' hyperparameters,
- ``torch.is_grad_enabled()`` and the number of global module hooks,
- the attribute guards on non-module objects (a ``config``), whose writes do not bump
  the module version.

If all agree, the signature, structure and guards of the last call agree too, and the
cached input list (local tensors of the parameters, buffers and optimizer state) is
still the one to feed; only the learning rates, old gradients and argument tensors are
read again. Anything else takes the slow path, which records a new ``LastCall``.
Only calls whose arguments are all top-level (no lists or dicts of tensors) qualify.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any

import torch
import torch.nn as nn

from passes.meta import Role
from spmd.frontend import guards, step_inputs
from spmd.frontend import optim as optim_utils
from spmd.parallel.sharding import local


def _kind(x: Any) -> tuple[Any, ...]:
    if isinstance(x, torch.Tensor):
        return ("t", x.shape, x.dtype, x.device, x.requires_grad, _layout(x))
    if isinstance(x, nn.Module | torch.optim.Optimizer):
        return ("o", id(x))
    return ("c", type(x), x)


def _layout(t: torch.Tensor) -> tuple[int, ...] | None:
    """As the signature keys layouts (spmd.frontend.signature.tensor_sig): strides unless contiguous."""
    return None if t.is_contiguous() else tuple(t.stride())


def _optim_key(optimizer: torch.optim.Optimizer, lifted: list[bool]) -> tuple[Any, ...]:
    return tuple(
        (type(g["lr"]), optim_utils.hyperparameters(g, skip_lr=lift))
        for g, lift in zip(optimizer.param_groups, lifted, strict=True)
    )


@dataclasses.dataclass
class LastCall:
    entry: Any  # spmd.entry.Entry
    version: int
    kinds: tuple[tuple[Any, ...], ...]  # per argument (positional, then keyword values)
    kw_names: tuple[str, ...]
    params: list[torch.Tensor]
    grad_key: list[bool]  # p.grad is None, per parameter, as the graph expects
    requires_grad: list[bool]
    grad_enabled: bool
    hooks: tuple[int, ...]
    optimizer: torch.optim.Optimizer | None
    optim_state: Any
    state_dicts: list[dict[str, Any]]  # optimizer.state's values, in order
    state_reads: tuple[list[dict[str, Any]], list[str], list[torch.Tensor]]  # dict, key, tensor per slot
    lifted: list[bool]
    optim_key: tuple[Any, ...]
    template: list[torch.Tensor | None]  # graph inputs; None where read per call
    lr_slots: list[tuple[int, int]]  # (input index, param group)
    grad_slots: list[tuple[int, torch.Tensor]]  # (input index, parameter)
    arg_slots: list[tuple[int, int]]  # (input index, argument index)
    grad_params: list[torch.Tensor]
    cleared: list[torch.Tensor]
    carry_params: list[torch.Tensor]  # parameters whose shards carried gathers read (cross_step_prefetch)
    # Attribute guards on non-module objects (a config) as (namespaces, names, values):
    # checked by identity, so a rewrite with an equal value takes the slow path once.
    object_guards: tuple[list[dict[str, Any]], list[str], list[Any]]

    @staticmethod
    def build(
        entry: Any,
        step_args: step_inputs.StepArgs,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        grad_key: list[bool],
    ) -> LastCall | None:
        """The recipe of a call that just ran ``entry``; ``grad_key`` is ``[p.grad is None]`` at its start.

        Call after the run: the module version then includes what the call itself changed.
        """
        values = [*args, *kwargs.values()]
        if len(values) != len(step_args.leaves) or any(a is not b for a, b in zip(values, step_args.leaves)):
            return None  # a container among the arguments: the slow path flattens it
        module, optimizer = step_args.module, step_args.optimizer
        params: dict[str, torch.Tensor] = dict(module.named_parameters())
        exe = entry.exe
        template: list[torch.Tensor | None] = [None] * len(exe.slots)
        lr_slots: list[tuple[int, int]] = []
        grad_slots: list[tuple[int, torch.Tensor]] = []
        arg_slots: list[tuple[int, int]] = []
        buffers = dict(module.named_buffers())
        reads: tuple[list[dict[str, Any]], list[str], list[torch.Tensor]] = ([], [], [])
        for i, slot in enumerate(exe.slots):
            # Read after the run: what the call leaves is what the next call feeds.
            if slot.role is Role.PARAM:
                template[i] = local(params[slot.name])
            elif slot.role is Role.BUFFER:
                template[i] = local(buffers[slot.name])
            elif slot.role is Role.OPTIM_STATE:
                assert optimizer is not None
                per_param = optimizer.state[params[slot.key[0]]]
                reads[0].append(per_param)
                reads[1].append(slot.key[1])
                reads[2].append(per_param[slot.key[1]])
                template[i] = local(per_param[slot.key[1]])
            elif slot.role is Role.HYPERPARAM:
                lr_slots.append((i, slot.key))
            elif slot.role is Role.PARAM_GRAD:
                grad_slots.append((i, params[slot.key]))
            elif slot.role is Role.INPUT:
                arg_slots.append((i, step_args.tensor_positions[int(slot.name.rsplit(".", 1)[1])]))
            else:
                return None  # a slot kind this recipe does not know: always take the slow path
        plist: list[torch.Tensor] = list(module.parameters())
        object_guards = [g for g in entry.attr_guards if not g.on_module]
        lifted = (
            [optim_utils.lr_is_liftable(optimizer, g) for g in optimizer.param_groups]
            if optimizer is not None
            else []
        )
        return LastCall(
            entry=entry,
            version=guards.module_version(),
            kinds=tuple(_kind(x) for x in values),
            kw_names=tuple(kwargs),
            params=plist,
            grad_key=grad_key,
            requires_grad=[p.requires_grad for p in plist],
            grad_enabled=torch.is_grad_enabled(),
            hooks=guards.global_hooks_key(),
            optimizer=optimizer,
            optim_state=optimizer.state if optimizer is not None else None,
            state_dicts=list(optimizer.state.values()) if optimizer is not None else [],
            state_reads=reads,
            lifted=lifted,
            optim_key=_optim_key(optimizer, lifted) if optimizer is not None else (),
            template=template,
            lr_slots=lr_slots,
            grad_slots=grad_slots,
            arg_slots=arg_slots,
            grad_params=[params[n] for n in exe.grad_outs],
            cleared=[params[n] for n in exe.grad_cleared],
            carry_params=[params[n] for n in exe.carry_param_names()],
            object_guards=(
                [g.namespace for g in object_guards],
                [g.attr for g in object_guards],
                [g.value for g in object_guards],
            ),
        )

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
        """The graph's inputs for this call, or ``None`` if anything may have changed."""
        if guards.module_version() != self.version or tuple(kwargs) != self.kw_names:
            return None
        values = [*args, *kwargs.values()] if kwargs else args
        if len(values) != len(self.kinds):
            return None
        for x, k in zip(values, self.kinds):
            if k[0] == "t":
                if not (
                    isinstance(x, torch.Tensor)
                    and x.shape == k[1]
                    and x.dtype == k[2]
                    and x.device == k[3]
                    and x.requires_grad == k[4]
                    and _layout(x) == k[5]
                ):
                    return None
            elif k[0] == "o":
                if id(x) != k[1]:
                    return None
            elif type(x) is not k[1] or x != k[2]:
                return None
        if torch.is_grad_enabled() != self.grad_enabled or guards.global_hooks_key() != self.hooks:
            return None
        namespaces, names, values_now = self.object_guards
        if namespaces and not all(
            map(operator.is_, map(dict.get, namespaces, names, itertools.repeat(guards.MISSING)), values_now)
        ):
            return None
        params = self.params
        if [p.grad is None for p in params] != self.grad_key:
            return None
        if [p.requires_grad for p in params] != self.requires_grad:
            return None
        opt = self.optimizer
        if opt is not None:
            if opt.state is not self.optim_state or len(opt.state) != len(self.state_dicts):
                return None
            # C-level identity checks: ~10 us for hundreds of state tensors.
            if not all(map(operator.is_, opt.state.values(), self.state_dicts)):
                return None
            dicts, keys, tensors = self.state_reads
            if not all(map(operator.is_, map(dict.get, dicts, keys), tensors)):
                return None
            if len(opt.param_groups) != len(self.lifted) or _optim_key(opt, self.lifted) != self.optim_key:
                return None
        flat = list(self.template)
        for i, g in self.lr_slots:
            assert opt is not None
            flat[i] = step_inputs.lr_tensor(opt.param_groups[g]["lr"])
        for i, p in self.grad_slots:
            flat[i] = local(p.grad)  # type: ignore[arg-type]  # not None: grad_key matched
        for i, a in self.arg_slots:
            flat[i] = local(values[a])
        return flat  # type: ignore[return-value]

    def run(self, flat: list[torch.Tensor]) -> Any:
        return self.entry.exe.call(flat, self.grad_params, self.cleared, self.carry_params)
