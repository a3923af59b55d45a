"""Run a compiled graph on the real model, optimizer and batch.

Two checks guard the run. Before it, the model's module structure must still be the
one the graph was traced from: the cache key covers parameters, buffers, modes and
the optimizer, but a parameter-free submodule swapped for another (``ReLU`` ->
``GELU``) or a replaced ``forward`` leaves it unchanged, and running the old graph
would silently compute the old model (:class:`ModelChangedError`). During it, a
collective that fails or times out (a peer rank died, hung or diverged) surfaces
from the backend as a bare ``RuntimeError`` deep in generated code; it is re-raised
as :class:`CollectiveError` naming the collective and what to do.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor

from passes import collectives as C
from passes import cross_step, torch_compat
from passes.invariants import check_collective_buffers
from passes.layouts import FAILING_NODE, fix_layouts
from passes.meta import Role
from passes.torch_compat import pytree
from spmd.backend import shm
from spmd.backend.bound_ops import bind_ops
from spmd.backend.carry import CarriedGathers
from spmd.backend.step_aside import EAGER, INDUCTOR, StepAside, deciding_groups
from spmd.errors import CollectiveError, KernelError, ModelChangedError, PassError, SpmdError
from spmd.frontend import step_inputs, tracing
from spmd.frontend.data_checks import DataChecks
from spmd.parallel.agreement import check_rank_agreement
from spmd.parallel.sharding import local

# The dump's and the logs' name for the eager backend's graph of an inductor step (step_aside).
ALT_STAGE = "eager_alternative"
# The stage name of the inductor pipeline's graph once the measurement kept the eager backend's
# graph, which is then ``final`` (the graph that runs).
INDUCTOR_STAGE = "inductor_graph"

log = logging.getLogger("spmd")

# Backend errors of a broken or timed-out collective, where the failing op is not
# identifiable from the traceback (e.g. raised by a later op on a poisoned group).
_BACKEND_FAILURE = re.compile(r"gloo|nccl|c10d|ProcessGroup|Connection (reset|closed)|timed out", re.I)


def module_structure(module: nn.Module) -> tuple[tuple[str, type, Any, tuple[int, ...]], ...]:
    """What the graph bakes in about the module tree beyond its state: each submodule's
    path, its class, an instance-level ``forward`` override, if any, and the ids of its
    forward and backward hooks (a hook added or removed after the trace changes the step)."""
    return tuple(
        (name, type(m), m.__dict__.get("forward"), _hook_ids(m)) for name, m in module.named_modules()
    )


def _hook_ids(m: nn.Module) -> tuple[int, ...]:
    d = m.__dict__
    hooks = (d["_forward_pre_hooks"], d["_forward_hooks"], d["_backward_pre_hooks"], d["_backward_hooks"])
    if not any(hooks):
        return ()
    return tuple(k for h in hooks for k in h)


@dataclasses.dataclass
class Executable:
    """A final graph plus the recipe for feeding its placeholders."""

    gm: fx.GraphModule
    slots: list[step_inputs.Slot]
    out_spec: pytree.TreeSpec
    out_constants: list[Any]
    # The module structure the graph was traced from; recorded at the first run, which
    # follows the trace with nothing in between.
    structure: tuple[tuple[str, type, Any, tuple[int, ...]], ...] | None = None
    # Parameters whose .grad the graph outputs (after the step's outputs), and those it clears.
    grad_outs: list[str] = dataclasses.field(default_factory=list)
    grad_cleared: list[str] = dataclasses.field(default_factory=list)
    # The first run checks the real layouts against the traced ones (passes.layouts) and
    # fixes the graph; ``on_layout_fix(gm)`` is told when it inserted fix-ups.
    layouts_checked: bool = False
    on_layout_fix: Callable[[fx.GraphModule], None] | None = None
    # What runs instead of ``gm`` when a backend compiled it (spmd.backend.lowering); None: run ``gm``.
    # inductor retraced the graph on the real inputs, so the first-run layout check is not needed.
    compiled: Any = None
    # backend="inductor" with inductor_fallback="measure": the first calls time ``compiled``
    # against ``alt``, the eager backend's graph of the same step run by its own Executable
    # (spmd.backend.step_aside), then ``compiled`` is the faster. Kept for the report; ``on_decide``
    # is told the choice.
    aside: StepAside | None = None
    alt: Executable | None = None
    on_decide: Callable[[str], None] | None = None
    # cross_step_prefetch (passes.cross_step): the graph's last ``n_carried`` inputs are the
    # gathers the previous call issued, its last ``n_carried`` outputs those for the next;
    # ``carry`` (shared by the compiled step's graphs) keeps them, ``issue`` gathers them when
    # none can be used, from the inputs at ``carry_sources``.
    n_carried: int = 0
    carry: CarriedGathers | None = None
    issue: fx.GraphModule | None = None
    carry_sources: list[int] = dataclasses.field(default_factory=list)
    # Python branches on the step's data the trace followed: checked before every run.
    data_checks: DataChecks | None = None
    # ``gm``'s code with its operators bound once (spmd.backend.bound_ops), and the code it was
    # built from: built again when the first run's layout fix-ups (or anything else) recompile gm.
    bound: Callable[..., Any] | None = dataclasses.field(default=None, repr=False)
    bound_code: str | None = dataclasses.field(default=None, repr=False)

    def inputs(self, step_args: step_inputs.StepArgs) -> list[torch.Tensor]:
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
                flat.append(step_inputs.lr_tensor(optimizer.param_groups[slot.key]["lr"]))
            elif slot.role is Role.PARAM_GRAD:
                grad = params[slot.key].grad
                assert grad is not None, f"{slot.key}.grad is in the signature"
                flat.append(grad)
            else:
                flat.append(tensors[int(slot.name.rsplit(".", 1)[1])])
        return flat

    def check_structure(self, module: nn.Module) -> None:
        """Raise :class:`ModelChangedError` if the module tree is not the traced one."""
        now = module_structure(module)
        if self.structure is None:
            self.structure = now
            return
        if now == self.structure:
            return
        raise ModelChangedError(
            f"spmd: the model changed after this step was compiled: {_first_change(self.structure, now)}. "
            "The compiled graph would still compute the old model. spmd retraces by itself when "
            "parameters, buffers, requires_grad, train/eval mode, optimizer param_groups or input "
            "shapes change, but not when a submodule without parameters is swapped, a forward is "
            "replaced or module hooks are added or removed: compile a new step "
            "(spmd.compile(...)(train_step)) after such a change, or make "
            "the change before the first call."
        )

    def run(self, step_args: step_inputs.StepArgs) -> Any:
        self.check_structure(step_args.module)
        if self.data_checks is not None:
            self.data_checks.verify(step_args.tensors)
        flat = [local(t) for t in self.inputs(step_args)]
        grad_params: list[torch.Tensor] = []
        cleared: list[torch.Tensor] = []
        carry_params: list[torch.Tensor] = []
        if self.grad_outs or self.grad_cleared or self.n_carried:
            params = dict(step_args.module.named_parameters())
            grad_params = [params[n] for n in self.grad_outs]
            cleared = [params[n] for n in self.grad_cleared]
            carry_params = [params[n] for n in self.carry_param_names()]
        return self.call(flat, grad_params, cleared, carry_params)

    def step_arguments(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's tensor arguments among the graph's inputs ``flat``, in argument order."""
        return [t for t, slot in zip(flat, self.slots) if slot.role is Role.INPUT]

    def carry_param_names(self) -> list[str]:
        """The parameters whose shards the carried gathers read (``carry_sources``' slots)."""
        return [self.slots[i].name for i in self.carry_sources]

    def call(
        self,
        flat: list[torch.Tensor],
        grad_params: list[torch.Tensor],
        cleared: list[torch.Tensor],
        carry_params: list[torch.Tensor] | None = None,
    ) -> Any:
        """Run the graph on its local inputs; set ``.grad`` of ``grad_params`` (``grad_outs``
        order) from its gradient outputs and clear that of ``cleared``. ``carry_params``: the
        parameters of :meth:`carry_param_names` (with ``cross_step_prefetch``)."""
        if self.data_checks is not None:  # before anything runs: a failing check changes nothing
            self.data_checks.verify(self.step_arguments(flat))
        if self.n_carried:
            assert self.carry is not None and self.issue is not None and carry_params is not None
            flat = [*flat, *self.carry.take(self, flat, carry_params, self.carry_sources, self.issue)]
        try:
            with torch.no_grad():
                outs = self.compiled(*flat) if self.compiled is not None else self.run_graph(*flat)
        except RuntimeError as exc:
            gm = self._graph_that_ran()
            node = _failing_node(exc, gm)
            is_comm = node is not None and (C.is_collective(node) or C.is_wait(node))
            if not (is_comm or isinstance(exc, dist.DistError) or _BACKEND_FAILURE.search(str(exc))):
                if node is None or isinstance(exc, SpmdError):
                    raise
                raise KernelError(_kernel_message(exc, node)) from exc
            raise CollectiveError(_collective_message(exc, gm, node if is_comm else None)) from exc
        if self.n_carried:
            assert self.carry is not None
            outs = list(outs)
            assert carry_params is not None
            self.carry.keep(self, flat, carry_params, self.carry_sources, outs[-self.n_carried :])
            del outs[-self.n_carried :]
        it = iter(outs)
        leaves = [next(it) if c is tracing.TENSOR_OUT else c for c in self.out_constants]
        for p, g in zip(grad_params, it, strict=True):
            set_grad(p, g)
        for p in cleared:
            p.grad = None
        return pytree.tree_unflatten(leaves, self.out_spec)

    def run_graph(self, *flat: torch.Tensor) -> Any:
        """The eager runtime: run ``gm`` op by op (the first run checks and fixes layouts)."""
        if not self.layouts_checked:
            return self._first_run(list(flat))
        if self.bound is None or self.bound_code is not self.gm.code:
            self.bound, self.bound_code = bind_ops(self.gm), self.gm.code
        return self.bound(*flat)

    def _graph_that_ran(self) -> fx.GraphModule:
        """The graph whose code the current call runs: ``alt``'s where the eager candidate runs."""
        alt = self.alt
        if alt is not None and (
            self.compiled == alt.run_graph or (self.compiled is self.aside and self.aside.last == EAGER)
        ):
            return alt.gm
        return self.gm

    def use_compiled(self, fn: Any, *, alt: Executable | None = None, label: str = "train_step") -> None:
        """Run ``fn`` (the backend's compiled graph) instead of ``gm``; with ``alt`` (the eager
        backend's graph of the same step), only if it is faster than ``alt`` on the first calls
        (:class:`StepAside`), else ``alt``."""
        if alt is None:
            self.compiled = fn
            return
        self.alt = alt

        def keep(kept: str) -> None:
            self.compiled = fn if kept == INDUCTOR else alt.run_graph
            if self.on_decide is not None:
                self.on_decide(kept)

        self.aside = StepAside(
            fn, alt.run_graph, groups=deciding_groups(self.gm), on_decide=keep, label=label
        )
        self.compiled = self.aside

    def _first_run(self, flat: list[torch.Tensor]) -> Any:
        """Run the graph checking real against traced layouts, fixing it where they differ."""
        _, outs, fixes = fix_layouts(self.gm, flat)
        self.layouts_checked = True
        if fixes:
            # The fix-ups copy and write back in place: not into an in-flight collective's buffer
            # (checked after this first run, which ran the fixed graph; a violation stops the next).
            check_final_graph(self.gm, "the first run's layout fix-ups")
            if self.on_layout_fix is not None:
                self.on_layout_fix(self.gm)
        return outs


def check_final_graph(gm: fx.GraphModule, after: str = "the pass pipeline") -> None:
    """The check the final graph always gets, debug mode or not: no buffer of an issued
    collective is written in place or freed before the collective's wait
    (``collective-buffer`` in ``passes/invariants.py``). A violation is a memory-safety bug
    (the process group's thread would read or write freed or overwritten memory), so it
    never runs: :class:`PassError`."""
    found = check_collective_buffers(gm)
    if found:
        lines = "\n  ".join(msg for _, msg in found[:20])
        more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
        raise PassError(
            f"spmd: after {after}, the graph would touch buffers of in-flight collectives "
            f"({len(found)} violation(s) of the collective-buffer invariant):\n  {lines}{more}\n"
            "This is a bug in a pass (or in gm_transformation): disable the pass named in the "
            "message with disabled_passes=[...] and report it."
        )


def build_eager_alternative(
    partitioned: fx.GraphModule,
    final: fx.GraphModule,
    pipeline: Any,
    traced: tracing.TracedStep,
    state: step_inputs.LiftedState,
    disabled: list[str],
    check: bool,
    step_name: str,
) -> Executable:
    """The eager backend's graph of a step compiled for another backend, and its Executable:
    ``pipeline`` (the eager backend's, :func:`spmd.pipeline.backend_pipeline`) run on
    ``partitioned``, a copy of the partitioned graph (never built with a user's
    ``gm_transformation``: that runs once, on the other backend's graph), with the checks every
    final graph gets (collective buffers; the ranks' agreement on its collectives, under its own
    name). Its placeholders and outputs must be those
    of ``final`` (the other backend's graph): both are fed the same flat inputs and read back the
    same way (:class:`PassError` otherwise: a pass changed the step's signature)."""
    t0 = time.perf_counter()
    gm = pipeline.run(partitioned, disabled=disabled, check=check)
    check_final_graph(gm, "the eager alternative's pass pipeline")
    check_rank_agreement(gm, step_name=f"{step_name}:{ALT_STAGE}")
    shm.settle(gm)
    mine, theirs = _signature_of(gm), _signature_of(final)
    if mine != theirs:
        i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        raise PassError(
            f"spmd: the eager backend's graph of {step_name} does not take and return what the inductor "
            f"backend's does (first difference at placeholder/output #{i}: "
            f"{mine[i] if i < len(mine) else None} vs {theirs[i] if i < len(theirs) else None}); "
            "a pass changed the step's signature. Use inductor_fallback='never' and report it."
        )
    log.info("spmd: %s: the eager backend's graph built in %.2f s", step_name, time.perf_counter() - t0)
    return make_executable(gm, traced, state)


def _signature_of(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """Each placeholder's name, shape and dtype, then the number of outputs."""
    out: list[tuple[Any, ...]] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
            out.append((n.name, shape))
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out.append(("outputs", len(outputs) if isinstance(outputs, list | tuple) else 1))
    return out


def set_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Set ``param.grad`` from the graph's local gradient, as eager (DDP, FSDP2) leaves it:
    a DTensor with the parameter's placements (the local shard for a sharded parameter)."""
    if isinstance(param, DTensor) and not isinstance(grad, DTensor):
        grad = DTensor.from_local(
            grad,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    param.grad = grad


def _first_change(
    old: tuple[tuple[str, type, Any, tuple[int, ...]], ...],
    new: tuple[tuple[str, type, Any, tuple[int, ...]], ...],
) -> str:
    before, after = {n: (t, f) for n, t, f, _ in old}, {n: (t, f) for n, t, f, _ in new}
    hooks_before, hooks_after = {n: h for n, _, _, h in old}, {n: h for n, _, _, h in new}
    for name in [n for n, _, _, _ in old] + [n for n, _, _, _ in new]:
        where = f"module {name!r}" if name else "the root module"
        if name not in after:
            return f"{where} ({before[name][0].__name__}) was removed"
        if name not in before:
            return f"{where} ({after[name][0].__name__}) was added"
        (t0, f0), (t1, f1) = before[name], after[name]
        if t0 is not t1:
            return f"{where} is now {t1.__name__} (was {t0.__name__})"
        if f0 is not f1 and f0 != f1:
            return f"{where} ({t1.__name__}) has a different forward"
        if hooks_before[name] != hooks_after[name]:
            return f"{where} ({t1.__name__}) had forward or backward hooks added or removed"
    return "the module tree was reordered"


def _failing_node(exc: BaseException, gm: fx.GraphModule) -> fx.Node | None:
    """The graph node whose line of generated code raised ``exc``, if any."""
    if isinstance(node := getattr(exc, FAILING_NODE, None), fx.Node):  # raised in the first run
        return node
    nodes = {n.name: n for n in gm.graph.nodes}
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if not fr.filename.startswith("<eval_with_key>"):
            continue
        m = re.match(r"\s*(\w+)\s*=", fr.line or "")
        if m and m.group(1) in nodes:
            return nodes[m.group(1)]
    return None


def _kernel_message(exc: BaseException, node: fx.Node) -> str:
    from passes.invariants import describe
    from passes.layouts import where

    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    source = where(node)
    hint = ""
    if "expected scalar type" in first_line or "dtype" in first_line:
        hint = (
            " The inputs' dtypes disagree. With mixed precision this is typically a module that keeps "
            "buffers in another dtype than its cast parameters (BatchNorm's fp32 running statistics "
            "with bf16 weights, which this device's kernel refuses in eager too): cast the buffers "
            "as well, MixedPrecision(..., buffer_dtype=<the param_dtype>)."
        )
    return (
        f"spmd: {describe(node)}{f' at {source}' if source else ''} failed on real tensors: {first_line}. "
        "The trace accepted it on fake tensors, whose kernels check less than the real ones; eager "
        f"would raise the same error on this device.{hint}"
    )


def _collective_message(exc: BaseException, gm: fx.GraphModule, node: fx.Node | None) -> str:
    from passes.invariants import describe

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    what = "a collective"
    if node is not None:
        src = node.args[0] if C.is_wait(node) else None
        carried = isinstance(src, fx.Node) and src.op == "placeholder"  # waits on a carried gather
        coll = C.collective_of(node) if C.is_wait(node) and not carried else node
        order = C.collectives(gm.graph)
        num = f" (collective #{order.index(coll)} of {len(order)})" if coll in order else ""
        what = f"the collective {describe(coll)}{num}"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    now = _pg_timeout_s()
    current = f" (now {now:g} s)" if now is not None else ""
    return (
        f"spmd: rank {rank}: {what} failed or timed out while running the compiled step: "
        f"{first_line}. A peer rank probably died (look for its error, or an exit by a signal such as "
        "the out-of-memory killer) or diverged (skipped a step, or called a different compiled step "
        "or a different number of steps). The model and optimizer state on this rank may be partly "
        "updated: restart from the last checkpoint. If the peers are only slow (a long first compile, "
        f"a checkpoint, uneven work), raise the collective timeout{current}: "
        "torch.distributed.init_process_group(..., timeout=datetime.timedelta(seconds=...))."
    )


def _pg_timeout_s() -> float | None:
    """The default process group's collective timeout, when the backend exposes it."""
    try:
        pg = torch_compat.get_default_group()
        return torch_compat.pg_timeout_s(pg)
    except Exception:  # noqa: BLE001 - private API: the message just leaves the value out
        pass
    return None


def make_executable(
    gm: fx.GraphModule, traced: tracing.TracedStep, state: step_inputs.LiftedState
) -> Executable:
    carried = cross_step.carried_placeholders(gm)
    issue = cross_step.issue_module(gm) if carried else None
    sources: list[int] = []
    if issue is not None:
        index = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        sources = [index[n.name] for n in issue.graph.nodes if n.op == "placeholder" and n.users]
    return Executable(
        n_carried=len(carried),
        issue=issue,
        carry_sources=sources,
        gm=gm,
        slots=list(traced.slots),
        out_spec=traced.out_spec,
        out_constants=traced.out_constants,
        grad_outs=list(traced.grad_outs),
        grad_cleared=list(traced.grad_cleared),
        data_checks=traced.data_checks,
    )


def weak_hook(owner: Any, entry: Any, fn: Callable[[Any, Any, Any], None]) -> Callable[[Any], None]:
    """``fn(owner, entry, arg)`` as an Executable's hook that keeps neither alive (a no-op once
    either is gone): the hooks' owners hold the Executable, so strong ones would make a cycle."""
    owner_ref, entry_ref = weakref.ref(owner), weakref.ref(entry)

    def hook(arg: Any) -> None:
        o, e = owner_ref(), entry_ref()
        if o is not None and e is not None:
            fn(o, e, arg)

    return hook
