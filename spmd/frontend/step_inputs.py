r"""What a train step takes in: its arguments, and the model's and optimizer's state lifted into graph inputs.

:func:`split_args` finds the one module, the optional optimizer and the tensors among the
decorated function's arguments; :func:`check_devices` refuses a step whose tensors are not on
one device before the trace would fail on it deep inside. :func:`lift_state` collects the
parameters, buffers, optimizer state and liftable learning rates that become graph inputs, in
the order of their :class:`Slot`\ s. :mod:`spmd.frontend.tracing` traces the step over these inputs.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from passes import torch_compat
from passes.meta import Role
from passes.torch_compat import pytree
from spmd.errors import InvalidArgumentsError, ModelChangedError
from spmd.frontend import optim as optim_utils

# ----------------------------------------------------------------------------- arguments


@dataclasses.dataclass
class StepArgs:
    """The decorated function's arguments, split into what the graph needs."""

    leaves: list[Any]
    spec: pytree.TreeSpec
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    tensor_positions: list[int]  # leaves that are tensors (graph inputs)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_positions]


def split_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> StepArgs:
    """Find the one module, the optional optimizer and the tensors among the arguments."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    modules = [x for x in leaves if isinstance(x, nn.Module)]
    optims = [x for x in leaves if isinstance(x, torch.optim.Optimizer)]
    if not modules:
        raise InvalidArgumentsError(
            "spmd.compile: the train step got no nn.Module among its arguments. "
            "Pass the model as an argument, e.g. train_step(model, optim, x, y), so spmd can lift its "
            "parameters into the graph."
        )
    if len({id(m) for m in modules}) > 1:
        names = ", ".join(type(m).__name__ for m in modules)
        raise InvalidArgumentsError(
            f"spmd.compile: the train step got {len(modules)} nn.Modules ({names}); exactly one is "
            "supported. Wrap them in one parent module (e.g. nn.ModuleDict) and pass that."
        )
    if len({id(o) for o in optims}) > 1:
        raise InvalidArgumentsError(
            f"spmd.compile: the train step got {len(optims)} optimizers; at most one is supported. "
            "Use one optimizer with several param_groups instead."
        )
    tensor_positions = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            tensor_positions.append(i)
        elif isinstance(x, nn.Module | torch.optim.Optimizer) or _is_constant(x):
            continue
        else:
            raise InvalidArgumentsError(
                f"spmd.compile: unsupported argument of type {type(x).__name__!r}. The train step takes "
                "one nn.Module, at most one optimizer, tensors and plain Python values (numbers, "
                "strings, None, and lists/tuples/dicts of them)."
            )
    return StepArgs(leaves, spec, modules[0], optims[0] if optims else None, tensor_positions)


def _argument_names(fn: Callable[..., Any], step_args: StepArgs) -> list[str]:
    """A readable name per leaf of the step's arguments: ``x``, ``batch[1]``, ``cfg['scale']``."""
    args, kwargs = pytree.tree_unflatten(step_args.leaves, step_args.spec)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        top, key, rest = path[0], path[1], pytree.keystr(path[2:])
        if getattr(top, "idx", 0) == 1:
            names.append(f"{getattr(key, 'key', key)}{rest}")
            continue
        i = getattr(key, "idx", 0)
        if i < len(positional):
            names.append(f"{positional[i]}{rest}")
        elif var is not None:
            names.append(f"{var}[{i - len(positional)}]{rest}")
        else:
            names.append(f"argument {i}{rest}")
    return names


def check_devices(fn: Callable[..., Any], step_args: StepArgs, state: LiftedState) -> None:
    """Raise :class:`InvalidArgumentsError` if the step's tensors are not all on one device.

    The device is the parameters'. Buffers, optimizer state and argument tensors must be
    on it too; 0-d tensors may stay on the CPU (as torch allows, e.g. Adam's ``step``).
    A mismatch would otherwise surface as a fake-tensor error deep inside the trace. A
    CPU-offloaded DTensor (local shard on the CPU, mesh on an accelerator) counts as on the
    mesh's device, where it computes.
    """
    param_devices: dict[torch.device, list[str]] = defaultdict(list)
    for n, p in state.params:
        param_devices[compute_device(p)].append(n)
    if len(param_devices) > 1:
        where = "; ".join(f"{_few(names)} on {d}" for d, names in param_devices.items())
        raise InvalidArgumentsError(
            f"spmd.compile: the model's parameters are on different devices ({where}). spmd compiles one "
            "device's step: move the whole model with model.to(device) before building the optimizer."
        )
    home = next(iter(param_devices), None)
    if home is None:  # a model without parameters: the first argument tensor decides
        home = next((t.device for t in step_args.tensors if t.dim() > 0), None)
    if home is None:
        return
    if home.type == "meta":
        raise InvalidArgumentsError(
            "spmd.compile: the model's parameters are on the meta device (no data). spmd.DataParallel "
            "materialises a meta-device model before tracing (with reset_parameters() or its "
            "param_init_fn); a custom ParallelMode must do it in prepare(), or build the model on a "
            "real device."
        )

    def off(t: torch.Tensor) -> bool:
        return compute_device(t) != home and not (t.dim() == 0 and t.device.type == "cpu")

    stray = [f"buffer {n!r} on {b.device}" for n, b in state.buffers if off(b)]
    stray += [f"optimizer state {n}.{k} on {t.device}" for n, k, t in state.optim_states if off(t)]
    if any(off(t) for t in step_args.tensors):
        names = _argument_names(fn, step_args)
        for i in step_args.tensor_positions:
            t = step_args.leaves[i]
            if off(t):
                desc = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                stray.append(f"argument {names[i]} ({desc}) on {t.device}")
    if stray:
        raise InvalidArgumentsError(
            f"spmd.compile: the train step's tensors are on different devices: the model's parameters "
            f"are on {home}, but not {_few(stray, 4)}. Move the batch to the model's device before calling "
            f"the step (x = x.to({str(home)!r})), or move the model (model.to(device)) before building "
            "the optimizer and compiling."
        )


def _few(items: list[str], n: int = 3) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def _is_constant(x: Any) -> bool:
    return x is None or isinstance(x, bool | int | float | str | torch.dtype | torch.device)


# ----------------------------------------------------------------------------- lifted state


@dataclasses.dataclass
class Slot:
    """One graph input: where its tensor lives and what it is."""

    role: Role
    name: str  # fully qualified: "layers.0.weight", "layers.0.weight.exp_avg", "lr.0", "input.2"
    # For optimizer state: (param fqn, state key). For hyperparameters: group index.
    key: Any = None


@dataclasses.dataclass
class LiftedState:
    """The model's and optimizer's tensors in graph-input order (inputs excluded)."""

    params: list[tuple[str, nn.Parameter]]
    buffers: list[tuple[str, torch.Tensor]]
    optim_states: list[tuple[str, str, torch.Tensor]]  # (param fqn, key, tensor)
    lr_groups: list[int]  # param-group indices whose lr is a graph input
    # (param fqn, its .grad) for parameters that have a gradient before the step
    grads: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)

    def slots(self) -> list[Slot]:
        out = [Slot(Role.PARAM, n) for n, _ in self.params]
        out += [Slot(Role.BUFFER, n) for n, _ in self.buffers]
        out += [Slot(Role.OPTIM_STATE, f"{n}.{k}", (n, k)) for n, k, _ in self.optim_states]
        out += [Slot(Role.HYPERPARAM, f"lr.{g}", g) for g in self.lr_groups]
        out += [Slot(Role.PARAM_GRAD, f"{n}.grad", n) for n, _ in self.grads]
        return out

    def tensors(self, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        """The current real tensors, in slot order (learning rates made 0-d float64 tensors)."""
        out: list[torch.Tensor] = [p for _, p in self.params]
        out += [b for _, b in self.buffers]
        out += [t for _, _, t in self.optim_states]
        if self.lr_groups:
            assert optimizer is not None
            out += [lr_tensor(optimizer.param_groups[g]["lr"]) for g in self.lr_groups]
        out += [g for _, g in self.grads]
        return out


def lr_tensor(lr: float | torch.Tensor) -> torch.Tensor:
    # float64 keeps a Python float's value exactly; fused kernels read it as a double.
    if isinstance(lr, torch.Tensor):
        return lr.detach().to(torch.float64).reshape(())
    return torch.tensor(lr, dtype=torch.float64)


# model -> {id(param): (weakref to it, its name)} for every parameter ever lifted from it
_LIFTED_PARAMS: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[weakref.ref, str]]] = (
    weakref.WeakKeyDictionary()
)


def param_fqns(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first fully qualified name (tied weights map to one name)."""
    return {id(p): n for n, p in module.named_parameters()}


def lift_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> LiftedState:
    """Collect the tensors that become graph inputs; creates optimizer state if missing."""
    params = list(module.named_parameters())
    buffers = list(module.named_buffers())
    optim_states: list[tuple[str, str, torch.Tensor]] = []
    lr_groups: list[int] = []
    if optimizer is not None:
        fqns = param_fqns(module)
        known = _LIFTED_PARAMS.get(module, {})
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in fqns:
                    continue
                ref, old_name = known.get(id(p), (None, ""))
                if ref is not None and ref() is p:
                    raise ModelChangedError(
                        f"spmd.compile: parameter {old_name!r} was removed from the model (or replaced by "
                        "another tensor) after the step was compiled, but the optimizer still holds it. "
                        "Rebuild the optimizer from model.parameters() after changing the model (or drop "
                        "the old parameter from optimizer.param_groups)."
                    )
                raise InvalidArgumentsError(
                    f"spmd.compile: the optimizer holds a parameter of shape {tuple(p.shape)} that is "
                    "not a parameter of the model passed to the train step. Build the optimizer from "
                    "model.parameters() of that same model."
                )
        for p in [p for g in optimizer.param_groups for p in g["params"]]:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    optim_states.append((fqns[id(p)], k, v))
        lr_groups = [
            i for i, g in enumerate(optimizer.param_groups) if optim_utils.lr_is_liftable(optimizer, g)
        ]
    # Remember what was lifted, so that a parameter later removed from the model but still
    # held by the optimizer is reported as a model change rather than a foreign parameter.
    _LIFTED_PARAMS.setdefault(module, {}).update((id(p), (weakref.ref(p), n)) for n, p in params)
    grads = [(n, p.grad) for n, p in params if p.grad is not None]
    return LiftedState(params, buffers, optim_states, lr_groups, grads)


def compute_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` computes on in the traced step: its own, except for an offloaded
    DTensor (local tensor on the CPU, mesh on an accelerator), which computes on the mesh's."""
    if isinstance(t, DTensor):
        loc, mesh_type = torch_compat.local_tensor(t).device, t.device_mesh.device_type
        if loc.type == mesh_type:
            return loc
        handle = getattr(torch, mesh_type, None)
        if handle is not None and getattr(handle, "is_available", lambda: False)():
            return torch.device(mesh_type, handle.current_device())
        # No such device here (fake tensors under the fake process group): fake tensors say index 0.
        return torch.device(mesh_type, 0)
    return t.device
