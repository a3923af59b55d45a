"""``spmd.compile``: the decorator, its graph cache, and the call path.

The first call traces the whole step (:mod:`spmd.frontend.tracing`), lets the parallel mode
partition it (:mod:`spmd.parallel`), runs the pass pipeline (:mod:`spmd.pipeline`)
and caches the result under the call's signature; every call then runs the cached
graph on the real tensors (:mod:`spmd.backend.runtime`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx as fx

from passes.stages import Stages
from spmd.backend import shm
from spmd.backend.carry import CarriedGathers
from spmd.backend.carry import install as carry_install
from spmd.backend.lastcall import LastCall
from spmd.backend.lowering import check_backend, check_gemm, check_optimizer_lowering, compile_graph
from spmd.backend.optimizer_checks import check_fused_optimizer_shapes
from spmd.backend.runtime import (
    build_eager_alternative,
    check_final_graph,
    make_executable,
    weak_hook,
)
from spmd.backend.step_aside import check_fallback
from spmd.backend.teardown import warn_at_exit_if_alive
from spmd.entry import Entry as _Entry
from spmd.errors import CacheLimitError, ConfigError
from spmd.frontend import guards, step_inputs, tracing
from spmd.frontend import optim as optim_utils
from spmd.frontend.data_checks import data_checks_collective
from spmd.frontend.signature import same_trace, signature
from spmd.options import OPTIONS, check_chunked_loss
from spmd.override import Override, apply_overrides
from spmd.parallel import DataParallel, ParallelMode
from spmd.parallel.agreement import check_rank_agreement
from spmd.parallel.sharding import local
from spmd.pipeline import backend_pipeline, build_trace_pipeline, check_remat, chunk_loss
from spmd.reporting.dump import dump_entry
from spmd.reporting.report import StepReport, describe_mode, entry_report

log = logging.getLogger("spmd")


def compile(
    module_override: Sequence[Override] | None = None,
    gm_transformation: Callable[[fx.GraphModule], fx.GraphModule] | None = None,
    parallel_mode: ParallelMode | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], CompiledStep]:
    """Compile a whole train step (forward, backward, optimizer) into one SPMD graph.

    Args:
        module_override: :class:`Override` objects applied before tracing.
        gm_transformation: ``gm -> gm`` run once on the graph after the built-in passes.
        parallel_mode: how to parallelise; ``None`` means ``DataParallel("replicate")``.
        **options: see ``spmd.options.OPTIONS`` (``dump_dir``, ``cache_size_limit``, ...).
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        valid = ", ".join(sorted(OPTIONS))
        raise ConfigError(f"spmd.compile: unknown option(s) {unknown}; valid options are: {valid}.")
    if parallel_mode is not None and not isinstance(parallel_mode, ParallelMode):
        raise ConfigError(
            f"spmd.compile: parallel_mode must be a ParallelMode such as spmd.DataParallel('fully_shard'), "
            f"got {type(parallel_mode).__name__}."
        )
    if module_override is not None:
        if isinstance(module_override, Override):
            module_override = [module_override]
        for o in module_override:
            if not isinstance(o, Override):
                raise ConfigError(f"spmd.compile: module_override items must be spmd.Override, got {o!r}.")
    check_backend(options.get("backend", "eager"))
    check_optimizer_lowering(options.get("inductor_optimizer", "opaque"))
    check_gemm(options.get("inductor_gemm", "auto"))
    check_fallback(options.get("inductor_fallback", "measure"))
    check_chunked_loss(options.get("chunked_loss", "auto"), parallel_mode)
    check_remat(options.get("remat"))

    def decorate(fn: Callable[..., Any]) -> CompiledStep:
        return CompiledStep(
            fn,
            module_override=list(module_override or []),
            gm_transformation=gm_transformation,
            parallel_mode=parallel_mode or DataParallel("replicate"),
            options=options,
        )

    return decorate


class CompiledStep:
    """The decorated train step. Call it like the original function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        module_override: list[Override],
        gm_transformation: Callable[[fx.GraphModule], fx.GraphModule] | None,
        parallel_mode: ParallelMode,
        options: dict[str, Any],
    ):
        functools.update_wrapper(self, fn)
        self.__name__: str = getattr(fn, "__name__", "train_step")
        self.fn = fn
        self.module_override = module_override
        self.gm_transformation = gm_transformation
        self.parallel_mode = parallel_mode
        self.dump_dir: str | None = options.get("dump_dir") or os.environ.get("SPMD_DUMP_DIR") or None
        self.cache_size_limit: int = int(options.get("cache_size_limit", 8))
        self.disabled_passes: tuple[str, ...] = tuple(options.get("disabled_passes", ()))
        self.check_invariants: bool = bool(
            options.get("check_invariants", os.environ.get("SPMD_DEBUG", "") not in ("", "0"))
        )
        self.backend: str = check_backend(options.get("backend", "eager"))
        self.inductor_config: dict[str, Any] = dict(options.get("inductor_config") or {})
        self.inductor_optimizer: str = check_optimizer_lowering(options.get("inductor_optimizer", "opaque"))
        self.inductor_gemm: str = check_gemm(options.get("inductor_gemm", "auto"))
        self.inductor_fallback: str = check_fallback(options.get("inductor_fallback", "measure"))
        self.chunked_loss = check_chunked_loss(options.get("chunked_loss", "auto"), parallel_mode)
        self.remat: str | float | None = check_remat(options.get("remat"))
        self.share_compile: bool = bool(
            options.get("share_compile", os.environ.get("SPMD_SHARE_COMPILE", "0") not in ("", "0"))
        )
        self.cross_step_prefetch: bool = bool(
            options.get(
                "cross_step_prefetch", os.environ.get("SPMD_CROSS_STEP_PREFETCH", "") not in ("", "0")
            )
        )
        # The gathers the last call issued for the next (cross_step_prefetch); drained when this
        # step is garbage collected or the interpreter exits, so none is left unwaited.
        self._carry = CarriedGathers(verify=self.check_invariants)
        if self.cross_step_prefetch:
            carry_install()
        weakref.finalize(self, self._carry.drain_quietly)
        # signature -> the graphs traced for it, each valid while its attribute guards hold
        self._cache: dict[Hashable, list[_Entry]] = {}
        self._last: _Entry | None = None
        self._last_call: LastCall | None = None
        guards.install()
        self._overridden: set[int] = set()
        # Traces shared between configurations of one spmd.plan (see _trace); None: off.
        self._trace_cache: dict[Hashable, Any] | None = None
        self._keep_stages = True  # record the graph after every pass (spmd.plan turns it off)
        # Record each node's user stack while tracing (error messages, dumps); spmd.plan, which
        # shows neither, turns it off: a Python stack summary per traced op.
        self._stack_traces = True
        # Whether the step is lowered for an accelerator, where that is not the device it traces
        # on: spmd.plan and spmd.simulate trace on the CPU for a device profile and set it from
        # the profile (passes that choose by device, the chunked loss head's chunks, then choose
        # as they would there). None: each pass reads the traced graph's devices.
        self._target_accelerator: bool | None = None
        # The device profile the step is lowered for (spmd.plan, spmd.simulate): what the
        # automatic tensor-parallel placements are priced on. None: the local device's.
        self._target_profile: Any = None
        # Whether a compile hands the final graph to the backend (inductor) and builds the eager
        # candidate of spmd.backend.step_aside. spmd.plan and spmd.simulate turn it off: they read
        # the graph and its cost model and never run the step, and inductor's compile of one
        # configuration took minutes (the graph before inductor is what they price anyway).
        self._lower_backend = True

    # ------------------------------------------------------------------ inspection

    @property
    def graphs(self) -> Stages:
        """The stages of the most recently run graph: ``traced``, ``partitioned``, one per pass,
        ``final`` (the graph that runs). With ``backend="inductor"``, once the measurement
        (:mod:`spmd.backend.step_aside`) keeps the eager backend's graph, ``final`` is that graph
        and the inductor pipeline's graph, which no longer runs, is the stage before it,
        ``inductor_graph``."""
        if self._last is None:
            raise RuntimeError("spmd: the step has not been called yet; graphs exist after the first call.")
        return self._last.graphs

    def report(self, stage: str = "final") -> StepReport:
        """The static report of the most recently run graph (``stage``: any name in ``graphs``)."""
        if stage not in self.graphs:
            raise ConfigError(
                f"spmd: report(stage={stage!r}): no such stage; the stages are {list(self.graphs)}."
            )
        assert self._last is not None
        return entry_report(self._last, stage)

    @property
    def lowered_code(self) -> str | None:
        """The backend's generated code for the most recently run graph (None with backend='eager')."""
        if self._last is None:
            raise RuntimeError("spmd: the step has not been called yet; code exists after the first call.")
        return self._last.lowered_code

    @property
    def num_graphs(self) -> int:
        return sum(len(es) for es in self._cache.values())

    # ------------------------------------------------------------------ call path

    def __call__(self, *args: Any, last_train_step: bool = False, **kwargs: Any) -> Any:
        fast = self._last_call
        if fast is not None:
            flat = fast.inputs(args, kwargs)
            if flat is not None:
                self._last = fast.entry
                out = fast.run(flat)
                if last_train_step:
                    self._carry.drain()  # no next step to use it
                return out
        self._last_call = None
        step_args = step_inputs.split_args(args, kwargs)
        entry = self._entry(step_args)
        grad_key = [p.grad is None for p in step_args.module.parameters()]
        out = entry.exe.run(step_args)
        self._last_call = LastCall.build(entry, step_args, args, kwargs, grad_key)
        if last_train_step:
            self._carry.drain()
        return out

    def invalidate_prefetch(self) -> None:
        """Drop the all-gather carried to the next call (``cross_step_prefetch``): the next call
        gathers again. Call it on every rank after writing parameters in a way spmd cannot see
        (through ``p.to_local()`` or ``.data``); see :mod:`spmd.backend.carry`."""
        self._carry.drain()

    def lower(self, *args: Any, **kwargs: Any) -> Stages:
        """Compile for these arguments without running the step; returns the graph stages.

        The model and optimizer are put in their distributed form (as on a first call),
        but no parameter is updated.
        """
        return self._entry(step_inputs.split_args(args, kwargs)).graphs

    def _entry(self, step_args: step_inputs.StepArgs) -> _Entry:
        module, optimizer = step_args.module, step_args.optimizer
        if id(module) not in self._overridden:
            apply_overrides(self.module_override, module)
            self._overridden.add(id(module))
        if self.parallel_mode.needs_trace_before_prepare(module):
            self._choose_from_trace(step_args)
        self.parallel_mode.prepare(module, optimizer, step_args)
        key = signature(step_args)
        candidates = self._cache.get(key, [])
        entry = next((e for e in candidates if guards.first_failing(e.attr_guards) is None), None)
        if entry is None:
            if candidates:
                changed = guards.first_failing(candidates[-1].attr_guards)
                log.info(
                    "spmd: %s: %s since the step was traced; retracing",
                    self.__name__,
                    changed.describe() if changed is not None else "a module attribute changed",
                )
            entry, key = self._compile(step_args)
            self._cache.setdefault(key, []).append(entry)
        self._last = entry
        return entry

    def _choose_from_trace(self, step_args: step_inputs.StepArgs) -> None:
        """The mode's choice from the step traced on the undistributed model. With
        ``_trace_cache`` (``spmd.plan``'s copies of one model), the choice is made once per
        forward (mixed precision) and :meth:`~spmd.parallel.ParallelMode.choice_key` (the tp
        degree) and reused by the other configurations: one trace and one DTensor check instead of one per
        configuration (an 80-layer 70B: about a minute each on 2 cores)."""
        mode, cache = self.parallel_mode, self._trace_cache
        mode_key = mode.choice_key()
        # The choice reads the forward and the state's shapes: the trace key less
        # accumulate_after_reduce (where backward accumulates gradients), so replicate and the
        # sharded styles share it.
        key = ("choice", repr(mode.trace_casts()), mode.trace_args(step_args) is step_args, mode_key)
        if cache is not None and mode_key is not None and key in cache:
            mode.reuse_choice(step_args.module, cache[key])
            return
        gm = self._trace_undistributed(step_args)
        choice = mode.choose_from_trace(step_args.module, gm, self._target_profile)
        if cache is not None and mode_key is not None and choice is not None:
            cache[key] = choice

    def _trace_undistributed(self, step_args: step_inputs.StepArgs) -> fx.GraphModule:
        """The step traced on the model as it is, before ``prepare`` distributes it, for a mode
        that chooses from the graph (automatic tensor-parallel placements). The step is traced
        again on the distributed state afterwards: its placeholders are other tensors then."""
        module, optimizer = step_args.module, step_args.optimizer
        if optimizer is not None:
            optim_utils.ensure_state(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
        state = step_inputs.lift_state(module, optimizer)
        mode = self.parallel_mode
        traced = tracing.trace_step(
            self.fn,
            mode.trace_args(step_args),
            state,
            casts=mode.trace_casts(),
            accumulate_after_reduce=mode.accumulate_after_reduce(),
            stack_traces=self._stack_traces,
        )
        return traced.gm

    def _compile(self, step_args: step_inputs.StepArgs) -> tuple[_Entry, Hashable]:
        if self.num_graphs >= self.cache_size_limit:
            raise CacheLimitError(
                f"spmd.compile: {self.__name__} has traced {self.num_graphs} graphs, the limit "
                f"(cache_size_limit={self.cache_size_limit}). Each new input shape/dtype, Python argument "
                "value, module attribute the step reads (Dropout.p, a flag), model structure or (for "
                "optimizers without a tensor learning rate, e.g. SGD "
                "without fused=True) learning-rate value traces a new graph. Pad inputs to fixed shapes, "
                "use fused=True optimizers, or raise cache_size_limit."
            )
        t0 = time.perf_counter()
        warn_at_exit_if_alive()
        module, optimizer = step_args.module, step_args.optimizer
        fresh: list[torch.Tensor] = []
        if optimizer is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            fresh = optim_utils.ensure_state(optimizer, params)
        if self._cache:
            log.info(
                "spmd: new input signature for %s, tracing graph #%d", self.__name__, self.num_graphs + 1
            )
        state = step_inputs.lift_state(module, optimizer)
        # With spmd.plan's cache, a configuration whose partition is cached needs the trace only for
        # its slots and outputs: its graph is shared (not copied), and the passes over it and the
        # partitioner are skipped (the cached partition is what they would give).
        partitioned = self._cached_partition(step_args)
        traced, read, trace_key = self._trace(step_args, state, copy=partitioned is None)
        if guards.first_failing(read) is not None:
            read = self._guards_after_first_call(step_args, state, traced, read)
        unused_fresh = tracing.forget_unused_state(traced, optimizer, fresh, module)
        if unused_fresh:
            state = step_inputs.lift_state(module, optimizer)
        log.info(
            "spmd: traced %s in %.2f s (%d nodes)", self.__name__, traced.trace_s, len(traced.gm.graph.nodes)
        )
        # Stages keeps a cheap copy per stage and builds its GraphModule when looked up. A plan
        # keeps only the final graph: a copy per stage is a third of its time.
        graphs = Stages()
        record = graphs.record if self._keep_stages else None
        traced_passes = build_trace_pipeline(remat=self.remat)
        before = {p.name for p in traced_passes.passes}
        if partitioned is not None:
            gm = partitioned
        else:
            if record is not None:
                record("traced", traced.gm)
            chunked = chunk_loss(
                traced.gm, self.chunked_loss, self.parallel_mode, accelerator=self._target_accelerator
            )
            if chunked and record is not None:
                record("chunk_loss_heads", traced.gm)
            # Passes over the traced graph (single-device semantics), before partitioning.
            gm = traced_passes.run(
                traced.gm, disabled=[d for d in self.disabled_passes if d in before], record=record
            )
            gm = self._partition(gm, state, step_args, trace_key)
        flat_state = state.tensors(optimizer) + step_args.tensors
        for o in self.module_override:
            res = o.transform(gm, flat_state)
            if isinstance(res, fx.Graph):
                res = fx.GraphModule(gm, res)
            gm = res
        if record is not None:
            record("partitioned", gm)
        pipeline = backend_pipeline(
            self.parallel_mode,
            gm,
            backend=self.backend,
            cross_step_prefetch=self.cross_step_prefetch,
            accelerator=self._target_accelerator,
            shm_groups=shm.candidate_groups(gm),
        )
        to_backend = self.backend != "eager" and self._lower_backend
        measure = to_backend and self.inductor_fallback == "measure"
        fallback = self.inductor_fallback
        if measure and self.gm_transformation is not None:
            # The eager candidate would need the transformation run a second time, on another
            # pipeline's graph: with one, inductor's code runs unmeasured, as under "never".
            log.info(
                "spmd: %s: gm_transformation given: inductor's code runs without measuring the eager "
                "backend's graph against it (as inductor_fallback='never'); the transformation runs "
                "once, on the graph inductor compiles",
                self.__name__,
            )
            measure, fallback = False, "never"
        # The eager candidate of spmd.backend.step_aside starts from the same partitioned graph.
        partitioned = tracing.copy_graph_module(gm) if measure else None
        disabled = [d for d in self.disabled_passes if d not in before]
        gm = pipeline.run(gm, disabled=disabled, check=self.check_invariants, record=record)
        check_fused_optimizer_shapes(gm, self.__name__)
        if self.gm_transformation is not None:
            gm = self.gm_transformation(gm)
            graphs.record("gm_transformation", gm)
        graphs["final"] = gm
        check_final_graph(gm, "the pass pipeline" if self.gm_transformation is None else "gm_transformation")
        check_rank_agreement(gm, step_name=self.__name__, before=data_checks_collective(traced.data_checks))
        shm.settle(gm)  # the ranks run the same graph: their shared memory can be made now
        exe = make_executable(gm, traced, state)
        exe.carry = self._carry
        lowered = None
        if to_backend:
            flat = [local(t) for t in exe.inputs(step_args)]
            lowered = compile_graph(
                gm,
                flat,
                self.backend,
                inductor_config=self.inductor_config,
                optimizer=self.inductor_optimizer,
                gemm=self.inductor_gemm,
                share=self.share_compile,
            )
            alt = None
            if partitioned is not None:  # measure: the eager backend's graph of the step too
                eager = backend_pipeline(
                    self.parallel_mode,
                    partitioned,
                    backend="eager",
                    accelerator=self._target_accelerator,
                    shm_groups=shm.candidate_groups(partitioned),
                )
                options = (disabled, self.check_invariants, self.__name__)
                alt = build_eager_alternative(partitioned, gm, eager, traced, state, *options)
            exe.use_compiled(lowered.fn, alt=alt, label=self.__name__)
        style, world = describe_mode(self.parallel_mode)
        entry = _Entry(
            exe=exe,
            graphs=graphs,
            world_size=world,
            parallel_style=style,
            trace_s=traced.trace_s,
            compile_s=time.perf_counter() - t0,
            backend=self.backend,
            lower_s=lowered.lower_s if lowered else None,
            lowered_code=lowered.code if lowered else None,
            lower_role=lowered.role if lowered else None,
            lower_wait_s=lowered.wait_s if lowered else None,
            remat=self.remat,
            inductor_fallback=fallback if lowered else None,
            attr_guards=read,
        )
        # Weak: the entry holds the Executable, and a cycle would keep the model's state
        # allocated after `del step, model, optim` until Python's cycle collector runs.
        exe.on_layout_fix = weak_hook(self, entry, lambda s, e, gm: s._record_layout_fix(e, gm))
        if exe.alt is not None:  # the dump shows the eager candidate's fix-ups and the decision
            exe.alt.on_layout_fix = weak_hook(self, entry, lambda s, e, _: s._dump(e, stages=False))
            exe.on_decide = weak_hook(self, entry, lambda s, e, kept: s._decided(e, kept))
        self._dump(entry)
        return entry, signature(step_args)

    def _trace_key(self, step_args: step_inputs.StepArgs) -> Hashable:
        """The key of this step's trace in ``_trace_cache`` (see :meth:`_trace`)."""
        mode = self.parallel_mode
        trace_args = mode.trace_args(step_args)
        return ("trace", repr(mode.trace_casts()), mode.accumulate_after_reduce(), trace_args is step_args)

    def _partition_key(self, trace_key: Hashable) -> Hashable | None:
        """The key of this step's partition in ``_trace_cache`` (None: never shared)."""
        mode_key = self.parallel_mode.partition_key()
        if mode_key is None:
            return None
        options = (repr(self.chunked_loss), self._target_accelerator, repr(self.remat))
        return ("partition", trace_key, mode_key, *options)

    def _cached_partition(self, step_args: step_inputs.StepArgs) -> fx.GraphModule | None:
        """A copy of the cached partition for this configuration, if ``_trace_cache`` holds one."""
        cache = self._trace_cache
        if cache is None:
            return None
        key = self._partition_key(self._trace_key(step_args))
        if key is None or key not in cache:
            return None
        return tracing.copy_graph_module(cache[key], lazy=True)

    def _trace(
        self, step_args: step_inputs.StepArgs, state: step_inputs.LiftedState, *, copy: bool = True
    ) -> tuple[tracing.TracedStep, list[guards.Guard], Hashable]:
        """The traced step, the module attributes it read, and its key in ``_trace_cache``.

        With ``_trace_cache`` (a dict; :func:`spmd.plan` sets one on its copies of the step)
        a trace is reused by every configuration that traces the same graph: the traced
        graph has single-device semantics on full-size state whatever the placements, and
        depends on the parallel mode only through its compute casts (mixed precision),
        ``accumulate_after_reduce`` and ``trace_args``. Each reuse gets its own copy of the
        graph (partitioning rewrites it in place). The cache is only valid for calls with
        structurally identical arguments (what ``spmd.plan`` makes); the guards of a reused
        trace are not recorded (a plan never runs its steps). ``copy=False``: the cached trace
        itself, for a caller that reads it and never changes it.
        """
        mode = self.parallel_mode
        casts = mode.trace_casts()
        acc = mode.accumulate_after_reduce()
        trace_args = mode.trace_args(step_args)
        cache = self._trace_cache
        key = self._trace_key(step_args)
        if cache is not None and key in cache:
            return (tracing.copy_traced(cache[key]) if copy else cache[key]), [], key
        with guards.record_reads(step_args.module) as read:
            traced = tracing.trace_step(
                self.fn,
                trace_args,
                state,
                casts=casts,
                accumulate_after_reduce=acc,
                stack_traces=self._stack_traces,
            )
        if cache is not None:
            cache[key] = tracing.copy_traced(traced)
        return traced, read, key

    def _partition(
        self,
        traced_gm: fx.GraphModule,
        state: step_inputs.LiftedState,
        step_args: step_inputs.StepArgs,
        trace_key: Hashable,
    ) -> fx.GraphModule:
        """The parallel mode's partition of ``traced_gm`` (the traced graph after the passes over
        it: the chunked loss head, remat); with ``_trace_cache``, shared by the modes whose
        ``partition_key`` is equal (they differ only in pass options) and whose traced-graph
        passes are configured alike."""
        cache = self._trace_cache
        key = self._partition_key(trace_key)
        if cache is not None and key is not None and key in cache:
            return tracing.copy_graph_module(cache[key], lazy=True)
        gm = self.parallel_mode.partition(traced_gm, state, step_args)
        if cache is not None:
            # spmd.plan analyses the graphs and never runs them: no pass needs their Python, so
            # each recompile waits until the code is read (see tracing.copy_graph_module).
            gm = tracing.copy_graph_module(gm, lazy=True)
            if key is not None:
                cache[key] = tracing.copy_graph_module(gm, lazy=True)
        return gm

    def _guards_after_first_call(
        self,
        step_args: step_inputs.StepArgs,
        state: step_inputs.LiftedState,
        traced: tracing.TracedStep,
        read: list[guards.Guard],
    ) -> list[guards.Guard]:
        """The trace changed an attribute it read (HF classifiers set ``config.problem_type``
        in their first forward), so its guards fail at once and the next call would trace
        again. Trace once more, from the values the first call left: if that gives the same
        graph and changes nothing it reads, the graph is right for the state after the first
        call too, and that trace's guards (those values) replace the first one's. Otherwise the
        attributes are put back as the first trace left them and the guards stay (the next
        call retraces, as before).
        """
        changed = guards.first_failing(read)
        saved = guards.snapshot(read)
        again, reread, _ = self._trace(step_args, state)
        if guards.first_failing(reread) is None and same_trace(traced, again):
            log.info(
                "spmd: %s: %s by the traced step itself; a second trace from the new values gives the "
                "same graph: guarding the values after the first call",
                self.__name__,
                changed.describe() if changed is not None else "a module attribute",
            )
            return reread
        guards.restore(saved)
        return read

    def _record_layout_fix(self, entry: _Entry, gm: fx.GraphModule) -> None:
        entry.record_layout_fix(gm)
        self._dump(entry)

    def _decided(self, entry: _Entry, kept: str) -> None:
        entry.decided(kept)
        self._dump(entry)

    def _dump(self, entry: _Entry, *, stages: bool = True) -> None:
        """Write the entry's stages, code and report if dumping (``spmd.reporting.dump.dump_entry``)."""
        if self.dump_dir:
            dump_entry(self.dump_dir, self.__name__, entry, stages=stages)
