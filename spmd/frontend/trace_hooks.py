"""What the tracer hooks into while ``make_fx`` runs the step: module paths and
phases recorded on every node, mixed-precision compute casts (per module, as FSDP2's
``cast_forward_inputs``), the optimizer swapped for its traceable form, and the
``tag_grad`` hooks that mark each parameter's gradient. :mod:`spmd.frontend.tracing` drives them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from passes import torch_compat
from passes.meta import INPUT_CAST, Phase
from passes.ops import get_device_rng_state, get_rng_state, set_device_rng_state, set_rng_state, tag_grad
from passes.prefetch import unit_path
from passes.torch_compat import pytree
from spmd.frontend import optim as optim_utils

log = logging.getLogger("spmd")

CUSTOM_KEY = "custom"  # node.meta key that make_fx copies from fx_traceback.current_meta
PHASE_KEY = "spmd_phase"
MODULE_KEY = "spmd_module"
MICROBATCH_KEY = "spmd_microbatch"
# Marks where a graph output goes among the step's (otherwise constant) output leaves.
TENSOR_OUT = object()
CAST_KEY = "spmd_cast_of"

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


# ----------------------------------------------------------------------------- tracing contexts


@contextlib.contextmanager
def traced_rng_state() -> Iterator[None]:
    """Record ``torch.get_rng_state`` / ``torch.set_rng_state`` as graph ops while tracing.

    Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's gradient checkpointing)
    saves the CPU generator's state in forward and restores it to recompute in backward, so
    recomputed dropout draws the forward's mask; ``fork_rng`` then puts the stream back. Those
    calls bypass the dispatcher: traced as they are, the graph would recompute with fresh
    random numbers and train differently from eager (passes.ops.get_rng_state). The CUDA
    generator's state, which checkpointing saves per device of its inputs, likewise
    (passes.ops.get_device_rng_state).
    """
    orig_get, orig_set = torch.get_rng_state, torch.set_rng_state
    cuda_get, cuda_set = torch.cuda.get_rng_state, torch.cuda.set_rng_state

    def _cuda(device: Any) -> torch.device:
        d = torch.device(device)
        return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())

    def cuda_get_(device: Any = "cuda") -> torch.Tensor:
        return get_device_rng_state(_cuda(device)) if get_proxy_mode() is not None else cuda_get(device)

    def cuda_set_(new_state: torch.Tensor, device: Any = "cuda") -> None:
        if get_proxy_mode() is not None:
            set_device_rng_state(new_state, _cuda(device))
        else:
            cuda_set(new_state, device)

    def get() -> torch.Tensor:
        return get_rng_state() if get_proxy_mode() is not None else orig_get()

    def set_(new_state: torch.Tensor) -> None:
        if get_proxy_mode() is not None:
            set_rng_state(new_state)
        else:
            orig_set(new_state)

    torch.get_rng_state, torch.set_rng_state = get, set_  # type: ignore[assignment]
    torch.cuda.get_rng_state, torch.cuda.set_rng_state = cuda_get_, cuda_set_  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = orig_get, orig_set  # type: ignore[assignment]
        torch.cuda.get_rng_state, torch.cuda.set_rng_state = cuda_get, cuda_set  # type: ignore[assignment]


def annotate(**kv: Any) -> dict[str, Any]:
    """Merge ``kv`` into the metadata make_fx copies onto new nodes; returns the old value."""
    old = fx_traceback.current_meta.get(CUSTOM_KEY, {})
    fx_traceback.current_meta[CUSTOM_KEY] = {**old, **kv}
    return old


@contextlib.contextmanager
def swapped_optimizer(
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


@dataclasses.dataclass
class BackwardState:
    """Shared by :func:`backward_phases` (which updates it) and :func:`module_paths` (which
    reads it): whether the trace is inside ``torch.autograd.backward`` now."""

    depth: int = 0  # nested backward calls running (a reentrant checkpoint's backward nests)

    @property
    def inside(self) -> bool:
        return self.depth > 0


@contextlib.contextmanager
def module_paths(module: nn.Module, backward: BackwardState | None = None) -> Iterator[None]:
    """Annotate every node made inside a submodule's forward with its module path.

    Outside backward, a forward pre-hook also switches the phase back to forward: after a
    backward has ended, a module's forward is the next micro-batch's. Inside backward
    (``backward.inside``) a forward is activation checkpointing's recomputation
    (``torch.utils.checkpoint`` re-runs the checkpointed module's forward while backward
    unpacks its saved tensors): its ops get the module's path and stay backward, so the
    partitioner feeds them the backward's gathers, units count them as the unit's backward,
    and resharding after forward holds.
    """
    handles = []
    stack: list[dict[str, Any]] = []

    def pre(path: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            if backward is not None and backward.inside:
                stack.append(annotate(**{MODULE_KEY: path}))
            else:
                stack.append(annotate(**{MODULE_KEY: path, PHASE_KEY: Phase.FORWARD}))

        return hook

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        if stack:
            old = stack.pop()
            # keep the phase, restore the enclosing module path
            annotate(**{MODULE_KEY: old.get(MODULE_KEY, "")})

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
    old = annotate(**{CAST_KEY: cast_of, MODULE_KEY: module})
    try:
        return t.to(dtype)
    finally:
        fx_traceback.current_meta[CUSTOM_KEY] = old


def compute_copies(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
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
def cast_forward_io(module: nn.Module, casts: ComputeCasts) -> Iterator[None]:
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
        mod = n.meta.get(CUSTOM_KEY, {}).get(MODULE_KEY)
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
def backward_phases(state: BackwardState | None = None) -> Iterator[list[int]]:
    """Mark nodes made inside ``torch.autograd.backward`` as backward (and after it as optimizer).

    Backward nodes inherit the module path of the forward op whose autograd node
    produced them (matched by autograd sequence number). ``state`` says, while the trace
    runs, whether it is inside a backward (:func:`module_paths` reads it). A backward
    called from inside another (a reentrant ``torch.utils.checkpoint`` runs one on its
    recomputed forward) is part of the outer one: same phase and micro-batch, not counted.
    """
    state = state if state is not None else BackwardState()
    real_backward = torch.autograd.backward
    calls: list[int] = []
    ends: list[fx.Node] = []  # the last graph node of each backward call

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        nested = state.inside
        roots = [t.grad_fn for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor)]
        mode = get_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        if not nested:
            calls.append(1)
            if ends and graph is not None:
                # Another backward: what ran since the last one is the next micro-batch's forward.
                for n in _nodes_after(graph, ends[-1]):
                    n.meta.setdefault(CUSTOM_KEY, {})[PHASE_KEY] = Phase.FORWARD
        seq_modules = _seq_nr_modules(graph) if graph is not None else {}
        handles = []
        for fn in _autograd_nodes(roots):
            path = seq_modules.get(torch_compat.autograd_sequence_nr(fn))
            if path is not None:

                def prehook(grad_outputs: Any, path: str = path) -> None:
                    annotate(**{MODULE_KEY: path})

                handles.append(fn.register_prehook(prehook))
        # A nested backward keeps the module path of the backward node that runs it.
        old = annotate(**{PHASE_KEY: Phase.BACKWARD}, **({} if nested else {MODULE_KEY: ""}))
        state.depth += 1
        try:
            return real_backward(tensors, *args, **kwargs)
        finally:
            state.depth -= 1
            for h in handles:
                h.remove()
            if nested:
                fx_traceback.current_meta[CUSTOM_KEY] = old
            else:
                if graph is not None:
                    ends.append(next(iter(reversed(graph.nodes))))
                # Until another backward shows that a micro-batch follows, the optimizer runs.
                annotate(**{PHASE_KEY: Phase.OPTIMIZER, MODULE_KEY: "", MICROBATCH_KEY: len(calls)})

    torch.autograd.backward = backward  # type: ignore[assignment]
    try:
        yield calls
    finally:
        torch.autograd.backward = real_backward  # type: ignore[assignment]


@contextlib.contextmanager
def grad_tags(
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
