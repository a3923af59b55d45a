"""``spmd.plan``: search the data-parallel configurations of a train step at any scale, on one process.

    >>> p = spmd.plan(train_step, model, optim, x, y, world_size=1024, device="h100-80gb",
    ...               memory_per_rank="80GiB")
    >>> print(p)            # one row per configuration, fitting ones first, fastest first
    >>> p.best.expression   # 'spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", ...))'

Each configuration is lowered as :func:`spmd.simulate` lowers it (fake process group,
fake copies of the state: nothing runs, no memory for the weights), and its final graph
is priced twice: peak memory per rank (:mod:`passes.memory`, the report's number) and
step time (:mod:`passes.cost_model` on a device profile, :mod:`spmd.profiles`).

The configurations (each axis can be narrowed by an argument):

- ``replicate`` (DDP);
- ``fully_shard`` with and without resharding after forward (FSDP FULL_SHARD /
  SHARD_GRAD_OP), for each prefetch depth (``forward_prefetch = backward_prefetch``) and
  each ``min_unit_mb``;
- ``hybrid_shard`` (shard within a node of ``gpus_per_node`` ranks, replicate across
  nodes) when the world spans more than one node, for each prefetch depth;
- each ``remat`` policy, when ``spmd.compile`` accepts a ``remat`` option (sharded styles);
- the user's mixed precision (the step's own ``DataParallel(mixed_precision=...)`` or
  ``mixed_precision=``) in every one.

One trace serves every configuration that traces the same graph (the traced graph has
single-device semantics whatever the placements; see ``CompiledStep._trace``): at most
two traces per model (replicate and the sharded styles differ in where a step that keeps
gradients accumulates them), then one partition per style and pass-independent setting and
one pass pipeline per configuration.

A deep model of identical blocks (a Llama's ``model.layers``) is searched folded
(:mod:`spmd.plan.fold`): every configuration is lowered on copies with ``FOLD_DEPTHS``
blocks and its predictions extrapolated in depth; then the best row, and each row whose
extrapolated peak is within ``FOLD_MARGIN`` of the budget, are lowered on the full model
(the table's ``lowered`` column). ``exact=True`` lowers every row on the full model.
:meth:`Plan.with_budget` re-judges the rows as they are (no new exact lowering).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from passes import collectives as C
from passes.cost_model import CostEstimate, DeviceProfile, GroupInfo, estimate_step_time
from spmd import api, options
from spmd.api import CompiledStep
from spmd.errors import ConfigError, SpmdError
from spmd.frontend import step_inputs
from spmd.parallel import DataParallel, MixedPrecision
from spmd.parallel.auto_tp import AUTO
from spmd.plan import fold, search
from spmd.plan.search import REFINE
from spmd.plan.space import (
    NamedPlan,
    _label,
    _mesh_words,
    configurations,
    expression,
    parse_bytes,
    tp_sizes,
    tp_summary,
)
from spmd.plan.table import Plan, PlanRow
from spmd.profiles import get_profile
from spmd.reporting.report import build_report
from spmd.simulate import check_call, fake_copy, fake_world, fresh_copy, given_keywords, step_keywords

log = logging.getLogger("spmd")

__all__ = ["NamedPlan", "Plan", "PlanRow", "REFINE", "plan", "parse_bytes", "tp_summary"]

_GiB = 2**30
# The folded search's block counts (benchmarks/results/plan-validation.md, "What a plan costs":
# measured against exact lowerings of Llama 3.1 8B and 70B shapes at 1,024 ranks; 2 and 4 blocks were
# off by up to 20% in peak where prefetch or the peak's phase depends on the first blocks).
FOLD_DEPTHS = (3, 6)
# An extrapolated peak this close to the budget (a fraction of it) is checked exactly.
FOLD_MARGIN = 0.05
# confirm=None lowers the best folded row on the full model up to this many blocks (Llama 3.1
# 8B's 32; 70B's 80 blocks take 2-5 minutes a row here, more than the whole folded search).
CONFIRM_BLOCKS = 32


def _scaled_batch(example_args: tuple[Any, ...], kwargs: dict[str, Any], tp: int) -> tuple[Any, Any]:
    """The step's arguments with each top-level tensor (the batch: token ids, targets) repeated
    ``tp`` times along dim 0: the ``tp`` ranks of a tensor-parallel group share one batch, so a
    data group takes ``tp`` ranks' sequences and the global batch stays the same."""

    def scale(x: Any) -> Any:
        return x.repeat(tp, *([1] * (x.dim() - 1))) if isinstance(x, torch.Tensor) and x.dim() else x

    return tuple(scale(a) for a in example_args), {k: scale(v) for k, v in kwargs.items()}


def _group_info(gpus_per_node: int) -> Any:
    from passes.torch_compat import resolve_process_group as _resolve_process_group

    cache: dict[str, GroupInfo] = {}

    def info(name: str) -> GroupInfo:
        if name not in cache:
            pg = _resolve_process_group(name)  # type: ignore[arg-type]
            ranks = dist.get_process_group_ranks(pg)
            nodes = {r // gpus_per_node for r in ranks}
            cache[name] = GroupInfo(size=len(ranks), spans_nodes=len(nodes) > 1)
        return cache[name]

    return info


def _tokens(example_args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tokens per rank per step: the element count of the first integer tensor argument."""
    leaves = step_inputs.split_args(example_args, kwargs).leaves
    for x in leaves:
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex():
            return int(x.numel())
    raise ConfigError(
        "spmd.plan: no integer tensor (token ids) among the step's arguments to count tokens per step; "
        "pass tokens_per_step= (tokens each rank processes per step)."
    )


def _remat_axis(remat: Iterable[Any] | None) -> list[Any]:
    if "remat" not in options.OPTIONS:
        if remat:
            raise ConfigError(
                "spmd.plan: remat= was given but spmd.compile has no remat option yet; leave remat unset."
            )
        return []
    return list(remat) if remat is not None else [None, "selective", "full"]


def plan(
    train_step: CompiledStep,
    *example_args: Any,
    world_size: int,
    device: str | DeviceProfile = "h100-80gb",
    memory_per_rank: int | str | None = None,
    tokens_per_step: int | None = None,
    gpus_per_node: int | None = None,
    mixed_precision: MixedPrecision | None = None,
    styles: Sequence[str] = ("replicate", "fully_shard", "hybrid_shard"),
    prefetch: Sequence[int] = (0, 1, 2),
    min_unit_mb: Sequence[float] = (1.0, 64.0),
    reshard: Sequence[bool] = (True, False),
    remat: Sequence[Any] | None = None,
    tp_plan: Any = None,
    tp: Sequence[int] | None = None,
    efficiency: float | None = None,
    exact: bool = False,
    fold_depths: tuple[int, int] = FOLD_DEPTHS,
    fold_margin: float = FOLD_MARGIN,
    refine: int | None = REFINE,
    confirm: bool | None = None,
    jobs: int = 1,
    step_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Plan:
    """Search data-parallel configurations of ``train_step`` at ``world_size`` ranks (module docstring).

    Args:
        train_step: a function decorated with ``spmd.compile(...)`` (its options are kept;
            its parallel mode gives the mixed precision unless ``mixed_precision=``).
        *example_args, **kwargs: one call's arguments as rank 0 passes them (build big models
            under ``FakeTensorMode``: see ``spmd.models``). Copied, never changed.
        step_kwargs: the call's keyword arguments as a dict, instead of ``**kwargs``: the way to
            pass one named like a keyword of ``plan`` (``world_size``, ``device``, ...). A step
            whose function takes a parameter named like a keyword given to ``plan`` must get its
            keywords this way (``step_kwargs={}`` for none): :class:`~spmd.ConfigError` otherwise.
        world_size: ranks to plan for.
        device: a profile name (``"h100-80gb"``, ``"a100-80gb"``, ``"cpu-local"``), a profile
            json path or a :class:`~passes.cost_model.DeviceProfile`.
        memory_per_rank: the budget a configuration must fit (bytes, or ``"80GiB"``/``"80GB"``).
        tokens_per_step: tokens each rank processes per step (default: the size of the first
            integer tensor argument, the token ids).
        gpus_per_node: ranks per node (default: the profile's); decides hybrid_shard's groups
            and which collectives cross nodes.
        styles, prefetch, min_unit_mb, reshard, remat: the axes searched (``remat``: default all
            policies when ``spmd.compile`` has the option, else none).
        tp_plan: a tensor-parallel plan (``DataParallel(tp_plan=...)``, e.g.
            ``spmd.parallel.tp_plans.llama()``): the search adds each size of ``tp`` above 1 on a
            ``(dp_shard, tp)`` mesh of consecutive ranks per tp group (hybrid_shard on a
            ``(dp_replicate, dp_shard, tp)`` mesh where a node holds two tp groups or more).
            The arguments are rank 0's batch without tensor parallelism: a tp group's data rank
            gets ``tp`` times it (the
            same global batch and tokens per GPU). A :class:`NamedPlan` writes itself as its
            code in the expressions; any other plan as ``tp_plan``, the variable to define.
            ``"auto"``: automatic placements (``DataParallel(style, tp_size=t, tp_plan="auto")``,
            chosen from the graph as each row lowers, :mod:`spmd.parallel.auto_tp`), for any
            model; the table names what each tp size sharded (:attr:`PlanRow.tp_choices`).
        tp: the tensor-parallel sizes searched with ``tp_plan`` (default 1, 2, 4, 8), each
            within a node (``gpus_per_node``) and dividing ``world_size``.
        efficiency: the profile's ``compute_efficiency`` for this plan (fraction of peak FLOP/s).
        exact: lower every configuration on the full model (default: a model of identical
            blocks is searched folded, :mod:`spmd.plan.fold`; the best row, and every row whose
            extrapolated peak is within ``fold_margin`` of ``memory_per_rank``, are lowered exactly).
        fold_depths: the two block counts ``(L1, L2)`` of the folded copies.
        fold_margin: the fraction of ``memory_per_rank`` around it where an extrapolated peak is
            checked exactly.
        refine: configurations that differ only in pass options (prefetch depth, ``min_unit_mb``)
            partition alike; each such group is lowered once with DataParallel's defaults, and
            the pass options searched (one axis at a time) in the ``refine`` best groups of each
            tensor-parallel size only (default 1); the remat policies of a partitioning are tried
            from the least recompute until one fits. ``None``: every configuration lowered.
        confirm: lower the best row and the rows near the budget on the full model after a
            folded search: ``True`` always, ``False`` never, ``None`` (default) for a model of
            at most ``CONFIRM_BLOCKS`` (32) blocks (the table says when the best row was not,
            and about what it would cost).
        jobs: processes to search in (forked from this one; the grid split by tensor-parallel
            size; the same rows as one process). The command line's default: the cores here.
    """
    t_start = time.perf_counter()
    kwargs = step_keywords(
        "spmd.plan", train_step, example_args, step_kwargs, kwargs, given_keywords(plan, locals())
    )
    check_call("spmd.plan", train_step, world_size, example_args, kwargs)
    prof = get_profile(device, gpus_per_node=gpus_per_node, compute_efficiency=efficiency)
    budget = parse_bytes(memory_per_rank)
    tokens = tokens_per_step if tokens_per_step is not None else _tokens(example_args, kwargs)
    if mixed_precision is None:
        mixed_precision = getattr(train_step.parallel_mode, "mixed_precision", None)
    if tp_plan is not None and tp_plan != AUTO and not isinstance(tp_plan, NamedPlan):
        tp_plan = NamedPlan(tp_plan, "tp_plan")
    configs = configurations(
        tp_plan=tp_plan,
        tp=tp_sizes(world_size, prof.gpus_per_node, tp) if tp_plan is not None else (1,),
        world_size=world_size,
        gpus_per_node=prof.gpus_per_node,
        mixed_precision=mixed_precision,
        styles=styles,
        prefetch=prefetch,
        min_unit_mb=min_unit_mb,
        reshard=reshard,
        remat=_remat_axis(remat),
    )
    if not configs:
        raise ConfigError(f"spmd.plan: no configuration to try with styles={list(styles)!r}.")
    layers = None if exact else _foldable(train_step, example_args, kwargs, fold_depths)
    gpn = prof.gpus_per_node
    configs, skipped = search.within_budget(configs, example_args, kwargs, budget, world_size, gpn)
    if not configs:
        raise ConfigError(
            f"spmd.plan: no configuration fits {(budget or 0) / _GiB:.1f} GiB per rank: "
            + "; ".join(f"{label}: {why}" for label, why in skipped)
            + ". Give more ranks, a larger memory_per_rank, or a smaller model."
        )
    cold: dict[tuple[int, int], float] = {}  # (depth, tp) -> seconds of its first lowering
    unconfirmed: list[tuple[str, float]] = []  # rows left extrapolated: (label, estimated exact s)
    # trace cache per (block count (0: the full model), tp size): a tp size has its own batch
    caches: dict[tuple[int, int], dict[Any, Any]] = {}
    rows: list[PlanRow] = []
    failed: list[tuple[str, str]] = []  # (configuration, why it did not lower)
    saved_local = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(prof.gpus_per_node)  # hybrid_shard's node (plan.hybrid_mesh_shape)
    try:
        with fake_world(world_size):
            group_info = _group_info(prof.gpus_per_node)

            def lower(opts: dict[str, Any], depth: int | None) -> PlanRow:
                row = _lower(opts, depth)
                key = (depth or 0, int(opts.get("tp_size") or 1))
                cold.setdefault(key, row.lower_s)  # the first lowering of a copy traces and partitions
                return row

            def _lower(opts: dict[str, Any], depth: int | None) -> PlanRow:
                t = int(opts.get("tp_size") or 1)
                ex, exkw = (example_args, kwargs) if t == 1 else _scaled_batch(example_args, kwargs, t)
                if depth is None:
                    return _one(
                        train_step,
                        opts,
                        ex,
                        exkw,
                        caches.setdefault((0, t), {}),
                        prof,
                        group_info,
                        tokens,
                    )
                assert layers is not None
                a, kw = fold.truncated_args(ex, exkw, layers, depth)
                return _one(
                    train_step,
                    opts,
                    a,
                    kw,
                    caches.setdefault((depth, t), {}),
                    prof,
                    group_info,
                    tokens,
                    after_copy=lambda a, kw: fold.set_config_depth(a, kw, layers.count, depth),
                )

            def lower_all(batch: list[dict[str, Any]]) -> list[PlanRow]:
                # A configuration spmd cannot lower is left out of the table and named under it.
                out: list[PlanRow] = []
                for opts in batch:
                    try:
                        if layers is None:
                            out.append(lower(opts, None))
                        else:
                            out += fold.folded_search([opts], layers, fold_depths, lower, tokens)
                    except SpmdError as e:
                        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        log.warning("spmd.plan: %s: not lowered: %s", _label(opts), first)
                        failed.append((_label(opts), first))
                return out

            def traced() -> int:
                return sum(1 for c in caches.values() for k in c if k[0] == "trace")

            def share_of(part: list[dict[str, Any]]) -> Any:
                def run() -> tuple[list[PlanRow], list[tuple[str, str]], dict[tuple[int, int], float], int]:
                    got = search.refined_search(part, lower_all, budget, refine)
                    return got, list(failed), dict(cold), traced()

                return run

            parts = search.shares(configs, jobs)
            if len(parts) > 1:
                log.info("spmd.plan: searching in %d processes", len(parts))
            rows = []
            traces = 0
            for got, why, times, n in search.in_processes([share_of(part) for part in parts]):
                rows += got
                traces += n if len(parts) > 1 else 0
                failed[:] = list(dict.fromkeys([*failed, *why]))
                cold.update({k: v for k, v in times.items() if k not in cold})
            if not rows:
                raise ConfigError(
                    "spmd.plan: no configuration could be lowered: "
                    + "; ".join(f"{label}: {why}" for label, why in failed)
                    + ". Narrow the search to configurations that lower (styles=, remat=, tp=)."
                )
            if layers is not None:

                def affordable(r: PlanRow) -> bool:
                    ok = confirm is True or (confirm is None and layers.count <= CONFIRM_BLOCKS)
                    if not ok:
                        # the full model's lowering, estimated from the deeper copy's first one
                        t = int(r.options.get("tp_size") or 1)
                        est = cold.get((fold_depths[1], t), 0.0) * layers.count / fold_depths[1]
                        unconfirmed.append((r.label, est))
                    return ok

                rows = fold.confirm(
                    rows, budget, fold_margin, lambda r: lower(r.options, None), fold.LINEAR, affordable
                )
    finally:
        if saved_local is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved_local
    result = Plan(
        rows=rows,
        world_size=world_size,
        device=prof.name,
        tokens_per_step=tokens,
        memory_per_rank=None,
        plan_s=time.perf_counter() - t_start,
        traces=traces + traced(),
        profile=prof.to_dict(),
        failed=failed,
        skipped=skipped,
        unsearched=len(configs) - len(rows) - len(failed) if refine is not None else 0,
        refine=refine,
        unconfirmed=unconfirmed,
        fold=None
        if layers is None
        else {"layers": layers.path, "depth": layers.count, "folded": list(fold_depths)},
    ).with_budget(budget)
    log.info("spmd.plan: %d configurations in %.1f s", len(rows), result.plan_s)
    return result


def _foldable(
    train_step: CompiledStep, example_args: tuple[Any, ...], kwargs: dict[str, Any], depths: tuple[int, int]
) -> fold.Layers | None:
    """The blocks to fold, or None: exact everywhere (no identical blocks, too few of them to
    gain from folding, or module overrides, which swap submodules by name)."""
    l1, l2 = depths
    if not 0 < l1 < l2:
        raise ConfigError(f"spmd.plan: fold_depths must be two block counts 0 < L1 < L2, got {depths!r}.")
    if train_step.module_override:
        log.info("spmd.plan: module overrides: every configuration lowered exactly")
        return None
    model = step_inputs.split_args(example_args, kwargs).module
    layers = fold.find_layers(model, min_layers=2 * l2)
    if layers is None:
        log.info(
            "spmd.plan: no %d or more identical blocks to fold: every configuration lowered exactly", 2 * l2
        )
    else:
        log.info(
            "spmd.plan: folded search on %d and %d of the %d blocks of %s", l1, l2, layers.count, layers.path
        )
    return layers


def _set_remat(sim: CompiledStep, remat: Any) -> None:
    """Give ``sim`` the settings ``spmd.compile(remat=remat)`` makes, whatever attributes hold them."""
    plain = api.compile(parallel_mode=sim.parallel_mode)(sim.fn)
    with_remat = api.compile(parallel_mode=sim.parallel_mode, remat=remat)(sim.fn)
    simple = (str, int, float, bool, tuple, type(None))
    for k, v in vars(with_remat).items():
        if isinstance(v, simple) and (k not in vars(plain) or vars(plain)[k] != v):
            setattr(sim, k, v)


def _one(
    train_step: CompiledStep,
    opts: dict[str, Any],
    example_args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trace_cache: dict[Any, Any],
    prof: DeviceProfile,
    group_info: Any,
    tokens: int,
    after_copy: Any = None,
) -> PlanRow:
    t0 = time.perf_counter()
    sim = fresh_copy(train_step)
    dp_opts = {k: v for k, v in opts.items() if k != "remat"}
    sim.parallel_mode = DataParallel(**dp_opts)
    if "remat" in opts:
        _set_remat(sim, opts["remat"])
    sim._trace_cache = trace_cache
    sim._target_accelerator = prof.accelerator  # lowered as for the profile's device
    sim._target_profile = prof  # and its automatic tp placements priced on it
    sim._keep_stages = False
    sim._stack_traces = False
    # Configurations that partition alike (they differ only in pass options) place the state
    # alike: the fake copy of the arguments distributed by the first one serves the rest (a
    # deepcopy and a distribution of hundreds of parameters each time otherwise). Not with
    # module overrides, which swap submodules of the copy they are given.
    part_key = sim.parallel_mode.partition_key()
    args_key = ("args", part_key) if part_key is not None and not sim.module_override else None
    if args_key is not None and args_key in trace_cache:
        args, kw = trace_cache[args_key]
    else:
        args, kw = fake_copy(example_args, kwargs)
        if after_copy is not None:
            after_copy(args, kw)
        if args_key is not None:
            trace_cache[args_key] = (args, kw)
    stages = sim.lower(*args, **kw)
    gm = stages["final"]
    report = build_report(
        gm, world_size=dist.get_world_size(), parallel_style=opts["parallel_style"], backend=sim.backend
    )
    cost: CostEstimate = estimate_step_time(gm, prof, group_info)
    lower_s = time.perf_counter() - t0
    log.info("spmd.plan: %s: %.2f s", _label(opts), lower_s)
    return PlanRow(
        label=_label(opts),
        expression=expression(opts),
        options=opts,
        peak_bytes=report.peak_memory_bytes,
        fits=None,
        step_s=cost.step_s,
        tokens_per_s=tokens / cost.step_s if cost.step_s > 0 else float("inf"),
        exposed_comm_s=cost.exposed_comm_s,
        comm_s=cost.comm_s,
        compute_s=cost.compute_s,
        flops=cost.flops,
        comm_bytes=sum(C.bytes_of(n) for n in C.collectives(gm.graph)),
        comm_bytes_by_dim=report.comm_bytes_by_dim(),
        mesh=_mesh_words(opts, dist.get_world_size(), prof.gpus_per_node),
        lower_s=lower_s,
        peak_site=fold.peak_site(gm, report.peak_node),
        loss_heads=report.loss_heads,
        peak_from=report.peak_from,
        tp_choices=list(report.tp_choices),
    )
