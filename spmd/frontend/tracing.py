"""Trace a whole train step (forward, backward, optimizer update) into one fx graph.

The user's function runs once under ``make_fx`` in fake mode with the model's
parameters and buffers, the optimizer's state and (where liftable) its learning
rates swapped for graph inputs. The resulting graph mutates those inputs in place,
so running it on the real tensors under ``torch.no_grad()`` *is* the train step.

While tracing we record, once, what every node is and when it runs
(:mod:`passes.meta`): forward/backward/optimizer from the boundaries of
``torch.autograd.backward``; module paths from forward hooks (and, for backward
nodes, from the autograd node that produced them); gradients from a ``tag_grad``
op applied by a hook on every parameter. Those hooks and contexts live in
:mod:`spmd.frontend.trace_hooks`, the lifted inputs in :mod:`spmd.frontend.step_inputs`; this module runs
``make_fx`` and finishes the metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import sysconfig
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.fx.experimental.proxy_tensor import make_fx

from passes import torch_compat
from passes.cleanup import strip_grad_tag
from passes.graph_utils import mutated_nodes
from passes.meta import CAST_OF, GRAD_OF, MICROBATCH, MODULE, PHASE, ROLE, STATE_NAME, Phase, Role
from passes.ops import TAG_GRAD, keep_rnn_workspaces
from passes.stages import copy_graph, rebuilt
from passes.torch_compat import FakeTensorMode, pytree
from passes.torch_compat import reparametrize_module as _reparametrize_module
from spmd.errors import (
    DataDependentControlFlowError,
    SpmdError,
    TraceError,
    UntraceableOpError,
)
from spmd.frontend import kernel_layouts
from spmd.frontend import optim as optim_utils
from spmd.frontend.captured import captured_tensor_error, is_captured_tensor_failure
from spmd.frontend.ctc import fixed_shape_ctc
from spmd.frontend.data_checks import DataChecks, build_checks, data_branches
from spmd.frontend.hf_compat import hf_data_dependent_hint, hf_static_masks
from spmd.frontend.host_random import refuse_host_random
from spmd.frontend.step_inputs import (
    LiftedState,
    Slot,
    StepArgs,
    check_devices,
    compute_device,
    param_fqns,
)
from spmd.frontend.trace_hooks import (
    CAST_KEY,
    CUSTOM_KEY,
    MICROBATCH_KEY,
    MODULE_KEY,
    PHASE_KEY,
    BackwardState,
    ComputeCasts,
    annotate,
    backward_phases,
    cast_forward_io,
    compute_copies,
    grad_tags,
    module_paths,
    swapped_optimizer,
    traced_rng_state,
)

log = logging.getLogger("spmd")


TENSOR_OUT = object()  # marks where a graph output goes among the step's output leaves


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
    # Conditions of Python branches on the step's data, checked before every run (data_checks).
    data_checks: DataChecks | None = None


def copy_graph_module(gm: fx.GraphModule, *, lazy: bool = False) -> fx.GraphModule:
    """An independent copy of ``gm``'s graph (meta copied shallowly) over the same attributes.

    ``lazy``: a ``torch.fx`` lazy GraphModule, whose ``recompile()`` (generating and compiling the
    graph's Python) waits until its code is read or it is called: what ``spmd.plan`` wants of a
    graph it only analyses (each recompile of a 25k-node step takes seconds)."""
    if lazy:
        from passes.torch_compat import LazyGraphModule as _LazyGraphModule

        lazy_gm = _LazyGraphModule(gm, copy_graph(gm.graph), class_name="GraphModule")
        lazy_gm.meta = dict(gm.meta)
        return lazy_gm
    return rebuilt(gm, copy_graph(gm.graph))


def copy_traced(traced: TracedStep) -> TracedStep:
    """An independent copy of a trace (graph nodes and lists), for a partitioner to rewrite."""
    return dataclasses.replace(
        traced,
        gm=copy_graph_module(traced.gm),
        slots=list(traced.slots),
        out_constants=list(traced.out_constants),
        grads=list(traced.grads),
        grad_outs=list(traced.grad_outs),
        grad_cleared=list(traced.grad_cleared),
    )


def _trace_error_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    from torch.fx.experimental import symbolic_shapes

    from passes.torch_compat import fake_tensor

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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
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


def _module_at_frame(exc: BaseException, names: dict[int, str]) -> tuple[str, nn.Module] | None:
    """The innermost module of the traceback that belongs to the model: (its path, itself)."""
    tb = exc.__traceback__
    found = None
    while tb is not None:
        self_ = tb.tb_frame.f_locals.get("self")
        if isinstance(self_, nn.Module) and id(self_) in names:
            found = names[id(self_)], self_
        tb = tb.tb_next
    return found


def _library_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, spmd and the standard library: the line of a
    third-party model (``transformers``' modeling file) that called the failing op."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    skip = (
        os.path.dirname(torch.__file__),
        root + os.sep + "spmd",
        root + os.sep + "passes",
        sysconfig.get_paths()["stdlib"] + os.sep,
    )
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if not fr.filename.startswith(skip) and "<" not in fr.filename:
            return fr
    return None


def _cudnn_rnn(exc: BaseException) -> bool:
    """Whether the failure is inside an RNN module (LSTM/GRU/RNN) running on CUDA with cuDNN."""
    tb = exc.__traceback__
    while tb is not None:
        self_ = tb.tb_frame.f_locals.get("self")
        if isinstance(self_, nn.RNNBase) and torch.backends.cudnn.enabled:
            return any(p.is_cuda for p in self_.parameters())
        tb = tb.tb_next
    return False


def _raise_trace_error(exc: BaseException, module: nn.Module) -> None:
    data_dependent, untraceable = _trace_error_types()
    if is_captured_tensor_failure(exc):
        raise captured_tensor_error(exc, module) from exc
    frame = _user_frame(exc)
    where = f" at {frame.filename}:{frame.lineno} ({frame.line!r})" if frame else ""
    lib = _library_frame(exc)
    if lib is not None and (frame is None or (lib.filename, lib.lineno) != (frame.filename, frame.lineno)):
        # The op was called by a library's model code, below the user's line: name both.
        where = f" at {lib.filename}:{lib.lineno} ({lib.line!r})" + (f", called{where}" if where else "")
    mod_names = {id(m): (n or type(module).__name__) for n, m in module.named_modules()}
    found = _module_at_frame(exc, mod_names)
    mod = found[0] if found else None
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
        from passes.torch_compat import DynamicOutputShapeException

        fix = (
            " Wrap this submodule with an spmd.Override (module_override=[...]) whose replacement is "
            "traceable, or register a fake kernel for the op."
        )
        if _cudnn_rnn(exc):
            hint = (
                " cuDNN's fused RNN takes its weights as one flat storage, which cannot be traced: run the "
                "step under `with torch.backends.cudnn.flags(enabled=False):` (the RNN then runs PyTorch's "
                "own kernels; eager under the same flags matches bit for bit), or"
            )
        elif isinstance(exc, DynamicOutputShapeException):
            experts = hf_data_dependent_hint(found[1] if found else None)
            hint = (
                " Its output shape depends on the values of its input (nonzero, boolean-mask indexing, "
                "unique and the like return as many elements as the data selects), and a graph is "
                "traced once, for fixed shapes: compute it over fixed shapes instead (torch.where with "
                "a mask, a weighted sum, one_hot)." + experts
            )
            fix = (
                " Or wrap this submodule with an spmd.Override (module_override=[...]) whose replacement "
                "has fixed shapes" + (" (examples/override_moe.py)." if experts else ".")
            )
        else:
            hint = " It has no fake/meta implementation."
        raise UntraceableOpError(
            f"spmd.compile: an operation cannot be traced{in_mod}{where}{op_txt}: {exc}.{hint}{fix}"
        ) from exc
    raise TraceError(f"spmd.compile: tracing the train step failed{in_mod}{where}: {exc!r}") from exc


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
    stack_traces: bool = True,
) -> TracedStep:
    """Trace ``fn`` over the lifted state and the argument tensors; see the module docstring.

    With ``casts`` (mixed precision) modules compute with cast copies of the parameters,
    buffers and forward inputs; the optimizer still reads and updates the stored
    (fp32) parameters, and autograd gives each of them the gradient of its copy cast
    back to its dtype.

    ``stack_traces=False`` records no user stack on the nodes (``meta["stack_trace"]``), which
    only error messages and dumps read (``spmd.plan`` turns it off: it is a part of the trace's time).

    Gradients are left as eager leaves them: a parameter's ``.grad`` from before the step
    is an input (``Role.PARAM_GRAD``) that backward accumulates onto (see
    :func:`grad_tags` for the order), and a ``.grad`` still set when the step returns is
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
            annotate(**{PHASE_KEY: Phase.FORWARD, MODULE_KEY: ""})
            compute = {
                **compute_copies(params, casts.param_dtype),
                **compute_copies(buffers, casts.buffer_dtype),
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
                stack.enter_context(swapped_optimizer(optimizer, by_id, st, lrs))
            stack.enter_context(grad_tags(params, got_grad, old_grads, accumulate_after_reduce))
            in_backward = BackwardState()
            stack.enter_context(module_paths(module, in_backward))
            stack.enter_context(traced_rng_state())
            stack.enter_context(hf_static_masks())
            stack.enter_context(refuse_host_random(module))
            stack.enter_context(cast_forward_io(module, casts))
            calls = stack.enter_context(backward_phases(in_backward))
            annotate(**{PHASE_KEY: Phase.FORWARD, MODULE_KEY: "", MICROBATCH_KEY: 0})
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
    fake_mode = kernel_layouts.KernelLayoutFakeMode()
    inputs = [_trace_input(t, fake_mode) for t in state.tensors(optimizer) + step_args.tensors]
    first_input = len(inputs) - len(step_args.tensors)
    real_inputs = {first_input + i: t for i, t in enumerate(step_args.tensors) if not isinstance(t, DTensor)}
    t0 = time.perf_counter()
    try:
        with (
            fx_traceback.preserve_node_meta(),
            optim_utils.traceable_optimizers(optimizer),
            data_branches(real_inputs) as branches,
        ):
            gm = make_fx(step, tracing_mode="fake", record_stack_traces=stack_traces)(*inputs)
    except SpmdError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to a precise SpmdError below
        _raise_trace_error(exc, module)
        raise  # unreachable
    trace_s = time.perf_counter() - t0
    checks = build_checks(branches, first_input)  # before dead code goes: the conditions have no users

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
        data_checks=checks,
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
    keep_rnn_workspaces(graph)  # the graph runs under no_grad (passes.ops)
    fixed_shape_ctc(graph)  # the CTC loss's fixed-shape kernels (spmd.frontend.ctc)
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
        torch_compat.rename_node(n, prefixes[slot.role] + "_" + re.sub(r"\W", "_", readable))
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
        custom = n.meta.get(CUSTOM_KEY, {})
        phase = custom.get(PHASE_KEY, phase)
        micro = custom.get(MICROBATCH_KEY, micro)
        n.meta[PHASE] = phase
        n.meta[MODULE] = custom.get(MODULE_KEY, "")
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
        if CAST_KEY in custom:
            n.meta[CAST_OF] = custom[CAST_KEY]
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


def forget_unused_state(
    traced: TracedStep,
    optimizer: torch.optim.Optimizer | None,
    fresh: list[torch.Tensor],
    module: nn.Module,
) -> bool:
    """Drop state created for tracing for parameters that got no gradient (eager never creates it)."""
    if optimizer is None or not fresh:
        return False
    fqns = param_fqns(module)
    # A parameter with a .grad from an earlier call is stepped on it even without a new one.
    used = set(traced.grads) | {s.key for s in traced.slots if s.role.value == "param_grad"}
    unused = [p for p in fresh if fqns.get(id(p)) not in used]
    if not unused:
        return False
    unused_names = {fqns[id(p)] for p in unused}
    gm = traced.gm
    keep = []
    for node, slot in zip([n for n in gm.graph.nodes if n.op == "placeholder"], traced.slots):
        if slot.key is not None and slot.role.value == "optim_state" and slot.key[0] in unused_names:
            assert not node.users, f"state of unused parameter {slot.name} is read by the graph"
            gm.graph.erase_node(node)
        else:
            keep.append(slot)
    traced.slots[:] = keep
    gm.recompile()
    optim_utils.drop_state(optimizer, unused)
    return True
