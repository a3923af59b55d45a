"""Trace a whole train step (forward, backward, optimizer update) into one fx graph.

The user's function runs once under ``make_fx`` in fake mode with the model's
parameters and buffers, the optimizer's state and (where liftable) its learning
rates swapped for graph inputs. The resulting graph mutates those inputs in place,
so running it on the real tensors under ``torch.no_grad()`` *is* the train step.

While tracing we record, once, what every node is and when it runs
(:mod:`passes.meta`): forward/backward/optimizer from the boundaries of
``torch.autograd.backward``; module paths from forward hooks (and, for backward
nodes, from the autograd node that produced them); gradients from a ``tag_grad``
op applied by a hook on every parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import inspect
import logging
import os
import re
import sys
import sysconfig
import time
import traceback
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils.stateless import _reparametrize_module

from passes.cleanup import strip_grad_tag
from passes.graph_utils import mutated_nodes
from passes.meta import CAST_OF, GRAD_OF, INPUT_CAST, MICROBATCH, MODULE, PHASE, ROLE, STATE_NAME, Phase, Role
from passes.ops import TAG_GRAD, tag_grad
from passes.prefetch import unit_path
from spmd import optim as optim_utils
from spmd.errors import (
    DataDependentControlFlowError,
    InvalidArgumentsError,
    ModelChangedError,
    SpmdError,
    TraceError,
    UntraceableOpError,
)

log = logging.getLogger("spmd")

_CUSTOM = "custom"  # node.meta key that make_fx copies from fx_traceback.current_meta
_PHASE_KEY = "spmd_phase"
_MODULE_KEY = "spmd_module"
_MICROBATCH_KEY = "spmd_microbatch"
# Marks where a graph output goes among the step's (otherwise constant) output leaves.
TENSOR_OUT = object()
_CAST_KEY = "spmd_cast_of"


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


# ----------------------------------------------------------------------------- compute casts


@dataclasses.dataclass(frozen=True)
class ComputeCasts:
    """The dtypes the traced step computes in (mixed precision); ``None``: as stored.

    The parallel mode decides them (``ParallelMode.trace_casts``); the tracer puts the
    casts in the graph, marked with ``passes.meta.CAST_OF``, so that the partitioner can
    move them (cast a shard before gathering it) and the dump shows them.
    """

    param_dtype: torch.dtype | None = None  # floating parameters, as modules see them
    buffer_dtype: torch.dtype | None = None  # floating buffers, as modules see them
    input_dtype: torch.dtype | None = None  # floating tensors passed to a cast module's forward
    # fnmatch patterns of the module paths whose forward inputs (and outputs) are cast besides
    # the root; None: every communication unit (``passes.prefetch.unit_path``), as FSDP2 casts at
    # each ``fully_shard``-ed block.
    input_cast_at: tuple[str, ...] | None = None
    output_dtype: torch.dtype | None = None  # floating forward outputs of the cast modules


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


# ----------------------------------------------------------------------------- tracing contexts


def _annotate(**kv: Any) -> dict[str, Any]:
    """Merge ``kv`` into the metadata make_fx copies onto new nodes; returns the old value."""
    old = fx_traceback.current_meta.get(_CUSTOM, {})
    fx_traceback.current_meta[_CUSTOM] = {**old, **kv}
    return old


@contextlib.contextmanager
def _swapped_optimizer(
    optimizer: torch.optim.Optimizer,
    fake_params: dict[int, torch.Tensor],
    fake_states: dict[int, dict[str, Any]],
    fake_lrs: dict[int, torch.Tensor],
) -> Iterator[None]:
    """Point the optimizer at the traced stand-ins of its params, state and lrs."""
    saved_state = optimizer.state
    saved_groups = [dict(g) for g in optimizer.param_groups]
    new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    try:
        for gi, g in enumerate(optimizer.param_groups):
            new_params = []
            for p in g["params"]:
                fp = fake_params[id(p)]
                new_params.append(fp)
                new_state[fp] = fake_states.get(id(p), {})
            g["params"] = new_params
            if gi in fake_lrs:
                g["lr"] = fake_lrs[gi]
            g.update(optim_utils.trace_group_overrides(optimizer, g))
        optimizer.state = new_state
        yield
    finally:
        optimizer.state = saved_state
        for g, saved in zip(optimizer.param_groups, saved_groups):
            g.clear()
            g.update(saved)


@contextlib.contextmanager
def _module_paths(module: nn.Module) -> Iterator[None]:
    """Annotate every node made inside a submodule's forward with its module path.

    A forward pre-hook also switches the phase back to forward (the next micro-batch).
    """
    handles = []
    stack: list[dict[str, Any]] = []

    def pre(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            stack.append(_annotate(**{_MODULE_KEY: path, _PHASE_KEY: Phase.FORWARD}))

        return hook

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        if stack:
            old = stack.pop()
            # keep the phase (forward), restore the enclosing module path
            _annotate(**{_MODULE_KEY: old.get(_MODULE_KEY, "")})

    for path, sub in module.named_modules():
        handles.append(sub.register_forward_pre_hook(pre(path)))
        handles.append(sub.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _cast(t: torch.Tensor, dtype: torch.dtype, cast_of: str, module: str) -> torch.Tensor:
    """``t.to(dtype)``, its node marked as a compute cast of ``cast_of`` made in ``module``."""
    old = _annotate(**{_CAST_KEY: cast_of, _MODULE_KEY: module})
    try:
        return t.to(dtype)
    finally:
        fx_traceback.current_meta[_CUSTOM] = old


def _compute_copies(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors modules compute with: floating ones cast to ``dtype`` (in the graph)."""
    if dtype is None:
        return tensors
    return {
        n: _cast(t, dtype, n, n.rpartition(".")[0]) if t.is_floating_point() and t.dtype != dtype else t
        for n, t in tensors.items()
    }


def cast_modules(module: nn.Module, patterns: tuple[str, ...] | None) -> list[str]:
    """The module paths whose forward inputs/outputs are cast: the root (``""``), plus every
    communication unit (``patterns=None``) or every path matching one of ``patterns``."""
    out = []
    for path, _ in module.named_modules():
        if path == "":
            out.append(path)
        elif patterns is None:
            if unit_path(path) == path and path.rpartition(".")[2].isdigit():
                out.append(path)  # a numbered block (``layers.3``), not a top-level leaf
        elif any(fnmatch.fnmatchcase(path, pat) for pat in patterns):
            out.append(path)
    return out


@contextlib.contextmanager
def _cast_forward_io(module: nn.Module, casts: ComputeCasts) -> Iterator[None]:
    """FSDP2's ``cast_forward_inputs`` and ``output_dtype``: at each module of
    :func:`cast_modules`, cast the floating tensors passed to its forward to
    ``casts.input_dtype`` and those it returns to ``casts.output_dtype``."""
    if casts.input_dtype is None and casts.output_dtype is None:
        yield
        return

    def caster(dtype: torch.dtype, path: str) -> Callable[[Any], Any]:
        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return _cast(x, dtype, INPUT_CAST, path)
            return x

        return cast

    def pre(path: str, dtype: torch.dtype) -> Callable[..., Any]:
        cast = caster(dtype, path)

        def hook(mod: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return pytree.tree_map(cast, args), pytree.tree_map(cast, kwargs)

        return hook

    def post(path: str, dtype: torch.dtype) -> Callable[..., Any]:
        cast = caster(dtype, path)
        return lambda mod, args, out: pytree.tree_map(cast, out)

    subs = dict(module.named_modules())
    handles = []
    for path in cast_modules(module, casts.input_cast_at):
        if casts.input_dtype is not None:
            handles.append(
                subs[path].register_forward_pre_hook(pre(path, casts.input_dtype), with_kwargs=True)
            )
        if casts.output_dtype is not None:
            handles.append(subs[path].register_forward_hook(post(path, casts.output_dtype)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _seq_nr_modules(graph: fx.Graph) -> dict[int, str]:
    out: dict[int, str] = {}
    for n in graph.nodes:
        seq = n.meta.get("seq_nr")
        mod = n.meta.get(_CUSTOM, {}).get(_MODULE_KEY)
        if seq is not None and mod is not None and seq not in out:
            out[seq] = mod
    return out


def _autograd_nodes(roots: list[Any]) -> list[Any]:
    seen: set[int] = set()
    out = []
    todo = [r for r in roots if r is not None]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        out.append(fn)
        todo.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return out


def _nodes_after(graph: fx.Graph, node: fx.Node) -> Iterator[fx.Node]:
    n = node.next
    while n.op != "root":
        yield n
        n = n.next


@contextlib.contextmanager
def _backward_phases() -> Iterator[list[int]]:
    """Mark nodes made inside ``torch.autograd.backward`` as backward (and after it as optimizer).

    Backward nodes inherit the module path of the forward op whose autograd node
    produced them (matched by autograd sequence number).
    """
    real_backward = torch.autograd.backward
    calls: list[int] = []
    ends: list[fx.Node] = []  # the last graph node of each backward call

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        roots = [t.grad_fn for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor)]
        mode = get_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        if ends and graph is not None:
            # Another backward: what ran since the last one is the next micro-batch's forward.
            for n in _nodes_after(graph, ends[-1]):
                n.meta.setdefault(_CUSTOM, {})[_PHASE_KEY] = Phase.FORWARD
        seq_modules = _seq_nr_modules(graph) if graph is not None else {}
        handles = []
        for fn in _autograd_nodes(roots):
            path = seq_modules.get(fn._sequence_nr())
            if path is not None:

                def prehook(grad_outputs: Any, path: str = path) -> None:
                    _annotate(**{_MODULE_KEY: path})

                handles.append(fn.register_prehook(prehook))
        _annotate(**{_PHASE_KEY: Phase.BACKWARD, _MODULE_KEY: ""})
        try:
            return real_backward(tensors, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
            if graph is not None:
                ends.append(next(reversed(graph.nodes)))
            # Until another backward shows that a micro-batch follows, the optimizer runs.
            _annotate(**{_PHASE_KEY: Phase.OPTIMIZER, _MODULE_KEY: "", _MICROBATCH_KEY: len(calls)})

    torch.autograd.backward = backward  # type: ignore[assignment]
    try:
        yield calls
    finally:
        torch.autograd.backward = real_backward  # type: ignore[assignment]


@contextlib.contextmanager
def _grad_tags(
    params: dict[str, torch.Tensor],
    got_grad: set[str],
    old_grads: dict[str, torch.Tensor] | None = None,
    after_reduce: bool = False,
) -> Iterator[None]:
    """Wrap each parameter's gradient in ``spmd::tag_grad`` once autograd has accumulated it.

    The tag goes on ``p.grad`` after accumulation, so a step that runs several
    micro-batches (several ``backward`` calls before ``optimizer.step``) tags the
    running sum each time; the partitioner reduces only the last tag of a parameter,
    the fully accumulated gradient (DDP's ``no_sync`` for all but the last micro-batch).

    A parameter's gradient from before the step (``old_grads``, lifted as an input) is
    ``p.grad`` when the step starts, as in eager. Autograd adds the new gradient to it
    before the tag (DDP reduces the accumulated gradient); with ``after_reduce`` it is
    held out of ``p.grad`` during ``backward`` and added after the tag (FSDP2 reduces the
    new gradient and adds it to the sharded ``p.grad``).
    """
    old_grads = old_grads or {}
    for name, g in old_grads.items():
        params[name].grad = g
    held: dict[str, torch.Tensor] = {}  # old gradients kept out of p.grad during a backward
    restore: dict[str, torch.Tensor] = {}  # what p.grad was before that backward
    bare: dict[str, torch.Tensor] = {}  # the tagged new gradient (without the old one)
    combined: dict[str, torch.Tensor] = {}  # old + tagged new: what p.grad holds between backwards
    handles = []
    for name, p in params.items():
        if not p.requires_grad:
            continue

        def hook(p: torch.Tensor, name: str = name) -> None:
            got_grad.add(name)
            p.grad = tag_grad(p.grad, name)
            old = held.pop(name, None)
            if old is not None:
                restore.pop(name)
                bare[name] = p.grad
                p.grad = combined[name] = old + p.grad

        handles.append(p.register_post_accumulate_grad_hook(hook))
    real_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        # Micro-batches accumulate onto the new gradient alone (reduced once, at the last tag).
        for name, g in old_grads.items():
            now = params[name].grad
            if now is g or (name in combined and now is combined[name]):
                held[name], restore[name] = g, now  # type: ignore[assignment]
                params[name].grad = bare.get(name) if now is not g else None
        try:
            return real_backward(*args, **kwargs)
        finally:
            for name in list(restore):  # no gradient came: p.grad stays as it was
                params[name].grad = restore.pop(name)
                held.pop(name)

    if after_reduce and old_grads:
        torch.autograd.backward = backward  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autograd.backward = real_backward  # type: ignore[assignment]
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- the traced step


@dataclasses.dataclass
class TracedStep:
    gm: fx.GraphModule
    slots: list[Slot]  # state slots, then one per tensor argument
    out_spec: pytree.TreeSpec
    out_constants: list[Any]  # non-tensor output leaves (TENSOR_OUT where a tensor goes)
    grads: list[str]  # parameters that received a gradient
    trace_s: float
    # Parameters whose .grad the step leaves set (the graph outputs them after the step's
    # own outputs, in this order), and those that had a gradient and end without one.
    grad_outs: list[str] = dataclasses.field(default_factory=list)
    grad_cleared: list[str] = dataclasses.field(default_factory=list)


def _trace_error_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    from torch._subclasses import fake_tensor
    from torch.fx.experimental import symbolic_shapes

    data_dependent = (
        fake_tensor.DataDependentOutputException,
        symbolic_shapes.GuardOnDataDependentSymNode,
    )
    untraceable = (
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.UnsupportedOperatorException,
        NotImplementedError,
    )
    return data_dependent, untraceable


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback that is the user's code (not torch, not spmd)."""
    root = os.path.dirname(os.path.dirname(__file__))
    skip = (
        os.path.dirname(torch.__file__),
        root + os.sep + "spmd",
        root + os.sep + "passes",
        sys.prefix + os.sep + "lib",
        # the standard library (contextlib, functools) sits outside a virtualenv's prefix
        sysconfig.get_paths()["stdlib"],
    )
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        f = fr.filename
        if f.startswith(skip):
            continue
        if "<" in f:  # generated code
            continue
        return fr
    return None


def _module_at_frame(exc: BaseException, names: dict[int, str]) -> str | None:
    tb = exc.__traceback__
    found = None
    while tb is not None:
        self_ = tb.tb_frame.f_locals.get("self")
        if isinstance(self_, nn.Module) and id(self_) in names:
            found = names[id(self_)]
        tb = tb.tb_next
    return found


def _raise_trace_error(exc: BaseException, module: nn.Module) -> None:
    data_dependent, untraceable = _trace_error_types()
    frame = _user_frame(exc)
    where = f" at {frame.filename}:{frame.lineno} ({frame.line!r})" if frame else ""
    mod_names = {id(m): (n or type(module).__name__) for n, m in module.named_modules()}
    mod = _module_at_frame(exc, mod_names)
    in_mod = f" in module {mod!r}" if mod else ""
    op = getattr(exc, "func", None)
    op_txt = f" (op {op})" if op is not None else ""
    if isinstance(exc, data_dependent):
        raise DataDependentControlFlowError(
            f"spmd.compile: the train step reads a tensor's value in Python{in_mod}{where}{op_txt}: "
            "`.item()`, `if tensor:`, `int(tensor)` and the like cannot be traced into one graph, because "
            "the value is not known at compile time. Rewrite it with tensor ops (e.g. torch.where), move it "
            "out of the step, or wrap the submodule with an spmd.Override that supplies a traceable stand-in."
        ) from exc
    if isinstance(exc, untraceable):
        raise UntraceableOpError(
            f"spmd.compile: an operation cannot be traced{in_mod}{where}{op_txt}: {exc}. It has no fake/meta "
            "implementation or its output shape depends on data. Wrap this submodule with an spmd.Override "
            "(module_override=[...]) whose replacement is traceable, or register a fake kernel for the op."
        ) from exc
    raise TraceError(f"spmd.compile: tracing the train step failed{in_mod}{where}: {exc!r}") from exc


def compute_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` computes on in the traced step: its own, except for an offloaded
    DTensor (local tensor on the CPU, mesh on an accelerator), which computes on the mesh's."""
    if isinstance(t, DTensor):
        loc, mesh_type = t._local_tensor.device, t.device_mesh.device_type
        if loc.type == mesh_type:
            return loc
        handle = getattr(torch, mesh_type, None)
        if handle is not None and getattr(handle, "is_available", lambda: False)():
            return torch.device(mesh_type, handle.current_device())
        # No such device here (fake tensors under the fake process group): fake tensors say index 0.
        return torch.device(mesh_type, 0)
    return t.device


def _holds_tensor(obj: Any, depth: int = 3) -> bool:
    """Whether ``obj`` reaches a tensor through its attributes or items, ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth == 0 or isinstance(obj, str | bytes | int | float | bool | type(None) | nn.Module):
        return False
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, list | tuple | set | frozenset):
        items = obj
    else:
        attrs = getattr(obj, "__dict__", None)
        items = attrs.values() if isinstance(attrs, dict) else ()
    return any(_holds_tensor(x, depth - 1) for x in items)


def _check_opaque_outputs(out: Any) -> None:
    """Refuse a step output spmd would hand back as traced: a leaf that is not a pytree node
    but holds tensors (Hugging Face's ``DynamicCache`` in ``out.past_key_values``). The graph
    cannot return what it cannot see; the object would carry the trace's fake tensors."""
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, torch.Tensor) and _holds_tensor(leaf):
            where = f"output{pytree.keystr(path)}"
            raise TraceError(
                f"spmd.compile: the step returns a {type(leaf).__name__} at {where} that holds tensors "
                "spmd cannot flatten. Return its tensors (or None) instead, or register the type with "
                "torch.utils._pytree.register_pytree_node; for a Hugging Face model, call it with "
                "use_cache=False or return only the fields you need (out.loss, out.logits)."
            )


def _trace_input(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """The fake stand-in of a real input: full (global) shape, even for a sharded DTensor.

    The traced graph has single-device semantics; partitioners make it local.
    """
    if isinstance(t, DTensor):
        with mode:
            # An offloaded shard (local tensor on the CPU) is traced where it computes: the mesh's device.
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=compute_device(t))
        return fake.requires_grad_(t.requires_grad)
    return mode.from_tensor(t)


def trace_step(
    fn: Callable[..., Any],
    step_args: StepArgs,
    state: LiftedState,
    casts: ComputeCasts | None = None,
    *,
    accumulate_after_reduce: bool = False,
) -> TracedStep:
    """Trace ``fn`` over the lifted state and the argument tensors; see the module docstring.

    With ``casts`` (mixed precision) modules compute with cast copies of the parameters,
    buffers and forward inputs; the optimizer still reads and updates the stored
    (fp32) parameters, and autograd gives each of them the gradient of its copy cast
    back to its dtype.

    Gradients are left as eager leaves them: a parameter's ``.grad`` from before the step
    is an input (``Role.PARAM_GRAD``) that backward accumulates onto (see
    :func:`_grad_tags` for the order), and a ``.grad`` still set when the step returns is
    an output (``TracedStep.grad_outs``).
    """
    casts = casts or ComputeCasts()
    module, optimizer = step_args.module, step_args.optimizer
    check_devices(fn, step_args, state)
    state_slots = state.slots()
    n_params, n_buffers = len(state.params), len(state.buffers)
    n_states, n_lrs, n_grads = len(state.optim_states), len(state.lr_groups), len(state.grads)
    got_grad: set[str] = set()
    leaves = list(step_args.leaves)
    out_box: dict[str, Any] = {}
    fqns = param_fqns(module)

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        it = iter(flat)
        params = {n: next(it) for n, _ in state.params}
        buffers = {n: next(it) for n, _ in state.buffers}
        states: dict[str, dict[str, Any]] = defaultdict(dict)
        for n, k, _ in state.optim_states:
            states[n][k] = next(it)
        lrs = {g: next(it) for g in state.lr_groups}
        old_grads = {n: next(it) for n, _ in state.grads}
        call_leaves = list(leaves)
        for pos in step_args.tensor_positions:
            call_leaves[pos] = next(it)
        args, kwargs = pytree.tree_unflatten(call_leaves, step_args.spec)

        with contextlib.ExitStack() as stack:
            _annotate(**{_PHASE_KEY: Phase.FORWARD, _MODULE_KEY: ""})
            compute = {
                **_compute_copies(params, casts.param_dtype),
                **_compute_copies(buffers, casts.buffer_dtype),
            }
            stack.enter_context(_reparametrize_module(module, compute, tie_weights=True))
            if optimizer is not None:
                by_id = {id(p): params[fqns[id(p)]] for g in optimizer.param_groups for p in g["params"]}
                st = {
                    id(p): dict(states.get(fqns[id(p)], {}))
                    for g in optimizer.param_groups
                    for p in g["params"]
                }
                # Non-tensor state entries stay as they are (constants of the graph).
                for g in optimizer.param_groups:
                    for p in g["params"]:
                        for k, v in optimizer.state.get(p, {}).items():
                            if not isinstance(v, torch.Tensor):
                                st[id(p)][k] = v
                stack.enter_context(_swapped_optimizer(optimizer, by_id, st, lrs))
            stack.enter_context(_grad_tags(params, got_grad, old_grads, accumulate_after_reduce))
            stack.enter_context(_module_paths(module))
            stack.enter_context(_cast_forward_io(module, casts))
            calls = stack.enter_context(_backward_phases())
            _annotate(**{_PHASE_KEY: Phase.FORWARD, _MODULE_KEY: "", _MICROBATCH_KEY: 0})
            out = fn(*args, **kwargs)
            out_box["backward_calls"] = len(calls)
        out_leaves, out_spec = pytree.tree_flatten(out)
        _check_opaque_outputs(out)
        out_box["spec"] = out_spec
        out_box["constants"] = [TENSOR_OUT if isinstance(x, torch.Tensor) else x for x in out_leaves]
        # Gradients the step leaves behind; one it did not touch stays as it is (no output).
        grad_outs = [n for n, p in params.items() if p.grad is not None and p.grad is not old_grads.get(n)]
        out_box["grad_outs"] = grad_outs
        out_box["grad_cleared"] = [n for n in old_grads if params[n].grad is None]
        end_grads = [pg for n in grad_outs if (pg := params[n].grad) is not None]
        return [x for x in out_leaves if isinstance(x, torch.Tensor)] + end_grads

    # A fake mode without a ShapeEnv, so that reading a tensor's value (`.item()`, `if tensor:`)
    # or an op whose output shape depends on data (`nonzero`) raises at the user's line. make_fx's
    # own fake mode has a ShapeEnv that turns both into unbacked symbols and traces on, into a
    # graph whose shapes no partitioner can reason about (tests/unit/test_errors.py).
    fake_mode = FakeTensorMode()
    inputs = [_trace_input(t, fake_mode) for t in state.tensors(optimizer) + step_args.tensors]
    t0 = time.perf_counter()
    try:
        with fx_traceback.preserve_node_meta(), optim_utils.traceable_optimizers():
            gm = make_fx(step, tracing_mode="fake", record_stack_traces=True)(*inputs)
    except SpmdError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to a precise SpmdError below
        _raise_trace_error(exc, module)
        raise  # unreachable
    trace_s = time.perf_counter() - t0

    input_slots = [Slot(Role.INPUT, f"input.{i}") for i in range(len(step_args.tensor_positions))]
    slots = state_slots + input_slots
    assert len(slots) == n_params + n_buffers + n_states + n_lrs + n_grads + len(input_slots)
    # make_fx names the class after its varargs wrapper, "<lambda>", which makes the dumped
    # stage invalid Python; every other stage is a plain GraphModule.
    gm = fx.GraphModule(gm, gm.graph, class_name="GraphModule")
    _finish_metadata(gm, slots)
    return TracedStep(
        gm=gm,
        slots=slots,
        out_spec=out_box["spec"],
        out_constants=out_box["constants"],
        grads=sorted(got_grad),
        trace_s=trace_s,
        grad_outs=out_box["grad_outs"],
        grad_cleared=out_box["grad_cleared"],
    )


# ----------------------------------------------------------------------------- metadata


_PROFILER_OPS = {
    "profiler._record_function_enter_new",
    "profiler._record_function_exit._RecordFunction",
    "profiler._record_function_exit",
    "profiler._record_function_enter",
}


def _finish_metadata(gm: fx.GraphModule, slots: list[Slot]) -> None:
    """Strip profiler nodes and turn the tracing annotations into ``passes.meta`` keys."""
    graph = gm.graph
    # Optimizer.step's record_function markers: exits first, they use the enters.
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and str(n.target).rsplit(".default", 1)[0] in _PROFILER_OPS:
            graph.erase_node(n)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(slots), (len(placeholders), len(slots))
    prefixes = {
        Role.PARAM: "p",
        Role.BUFFER: "b",
        Role.OPTIM_STATE: "s",
        Role.HYPERPARAM: "h",
        Role.INPUT: "x",
        Role.PARAM_GRAD: "g",
    }
    for n, slot in zip(placeholders, slots):
        # Readable placeholder names in dumps: p_layers_0_weight, s_layers_0_weight_exp_avg, x_input_0,
        # g_layers_0_weight (its .grad).
        readable = slot.key if slot.role is Role.PARAM_GRAD else slot.name
        n._rename(prefixes[slot.role] + "_" + re.sub(r"\W", "_", readable))
        n.target = n.name
        n.meta[ROLE] = slot.role
        n.meta[PHASE] = Phase.FORWARD
        n.meta[STATE_NAME] = slot.name
        n.meta[MODULE] = slot.name.rsplit(".", 1)[0] if slot.role is Role.PARAM else ""
    param_nodes = {n.meta[STATE_NAME]: n for n in placeholders if n.meta[ROLE] is Role.PARAM}
    phase, micro = Phase.FORWARD, 0
    for n in graph.nodes:
        if n.op == "placeholder":
            n.meta[MICROBATCH] = 0
            continue
        custom = n.meta.get(_CUSTOM, {})
        phase = custom.get(_PHASE_KEY, phase)
        micro = custom.get(_MICROBATCH_KEY, micro)
        n.meta[PHASE] = phase
        n.meta[MODULE] = custom.get(_MODULE_KEY, "")
        n.meta[MICROBATCH] = micro
        if n.op == "output":
            n.meta[ROLE] = Role.ACTIVATION
        elif n.target is TAG_GRAD:
            n.meta[ROLE] = Role.GRAD
            n.meta[GRAD_OF] = n.args[1]
            # A gradient belongs to its parameter's module.
            pn = param_nodes.get(n.args[1])
            n.meta[MODULE] = pn.meta[MODULE] if pn is not None else n.meta[MODULE]
        elif phase is Phase.OPTIMIZER:
            n.meta[ROLE] = Role.UPDATE
        else:
            n.meta[ROLE] = Role.ACTIVATION
        if _CAST_KEY in custom:
            n.meta[CAST_OF] = custom[_CAST_KEY]
    buffer_nodes = {n.meta[STATE_NAME]: n for n in placeholders if n.meta[ROLE] is Role.BUFFER}
    _write_back_buffer_casts(graph, buffer_nodes)
    # With gradient accumulation a parameter's gradient is tagged after every backward;
    # only the last tag, on the fully accumulated gradient, is the one to reduce.
    last_tag = {n.args[1]: n for n in graph.nodes if n.target is TAG_GRAD}
    for n in [n for n in graph.nodes if n.target is TAG_GRAD and last_tag[n.args[1]] is not n]:
        strip_grad_tag(graph, n)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _write_back_buffer_casts(graph: fx.Graph, buffers: dict[str, fx.Node]) -> None:
    """Copy a buffer's compute copy (``buffer_dtype``) back into the buffer after the step writes it.

    BatchNorm updates its running statistics in place, on the copy the module computed
    with; without this the update would be lost. The copy follows the copy's last
    in-place writer. Buffers nobody writes are left alone (a round trip through a lower
    precision would change them).
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        name = n.meta.get(CAST_OF)
        if name not in buffers:
            continue
        writers = [u for u in n.users if n in mutated_nodes(u)]
        if not writers:
            continue
        last = max(writers, key=order.__getitem__)
        buf = buffers[name]
        with graph.inserting_after(last):
            back = graph.call_function(torch.ops.aten.copy_.default, (buf, n))
        back.meta.update({k: last.meta[k] for k in (PHASE, MODULE, MICROBATCH) if k in last.meta})
        back.meta[ROLE] = Role.ACTIVATION
        if "val" in buf.meta:
            back.meta["val"] = buf.meta["val"]
