"""How :func:`spmd.plan` narrows its grid before and while it lowers.

- :func:`within_budget`: a configuration whose share of the parameters and optimizer state alone
  is over the memory budget is left out unlowered (:mod:`spmd.plan.bounds`).
- :func:`refined_search`: configurations that differ only in pass options (prefetch depth,
  ``min_unit_mb``) partition alike, into one *group*; each group is lowered once, with
  DataParallel's defaults (or the nearest values searched). The remat policies of one
  partitioning are tried from the most recompute ("full", the policies between, none), and
  where one does not fit, those that recompute less are not tried (they keep more). Then
  the ``refine`` best groups of each tensor-parallel size get their pass options searched, one
  axis at a time, each axis's best value kept for the next. ``refine=None`` lowers the whole grid.
- :func:`shares` and :func:`in_processes`: with ``jobs=`` above 1 the grid is split by
  tensor-parallel size over processes forked from the plan's (the same rows as one process:
  refinement is per tp size).
"""

from __future__ import annotations

import logging
from typing import Any

from spmd.frontend import step_inputs
from spmd.plan import bounds
from spmd.plan.space import _label

log = logging.getLogger("spmd")

__all__ = [
    "REFINE",
    "PASS_AXES",
    "within_budget",
    "refined_search",
    "skipped_words",
    "shares",
    "in_processes",
]

_GiB = 2**30
# Partitionings whose pass options (prefetch depth, min_unit_mb) are searched in full.
REFINE = 1


def within_budget(
    configs: list[dict[str, Any]],
    example_args: tuple[Any, ...],
    kwargs: dict[str, Any],
    budget: int | None,
    world: int,
    gpus_per_node: int,
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The configurations whose share of parameters and optimizer state fits ``budget``, and the
    others as (label, why) (:mod:`spmd.plan.bounds`: known without lowering)."""
    if budget is None:
        return configs, []
    split = step_inputs.split_args(example_args, kwargs)
    total = bounds.state_bytes(split.module, split.optimizer)
    keep, skipped = [], []
    for opts in configs:
        gathered = bounds.gathered_bytes(split.module, opts)
        need = bounds.floor_bytes(total, opts, world, gpus_per_node, gathered)
        if need > budget:
            what = "parameters and optimizer state" + (" and gathered parameters" if gathered else "")
            skipped.append((_label(opts), f"{what} alone need {need / _GiB:.1f} GiB per rank"))
        else:
            keep.append(opts)
    if skipped:
        log.info("spmd.plan: %d configurations over the budget on state alone: not lowered", len(skipped))
    return keep, skipped


def _group_key(opts: dict[str, Any]) -> str:
    """Configurations with one key partition alike: they differ only in pass options."""
    return repr(sorted((k, repr(v)) for k, v in opts.items() if k not in PASS_AXES))


def refined_search(
    configs: list[dict[str, Any]], search: Any, budget: int | None, refine: int | None
) -> list[Any]:
    """Rows for ``configs``: with ``refine``, one per partitioning group (DataParallel's default
    pass options, or the nearest ones searched), then the pass options of the ``refine`` best
    groups searched one axis at a time (the best value of each axis kept for the next)."""
    if refine is None:
        return search(configs)
    groups: dict[str, list[dict[str, Any]]] = {}
    for opts in configs:
        groups.setdefault(_group_key(opts), []).append(opts)

    def distance(opts: dict[str, Any]) -> int:
        return sum(opts.get(k, d) != d for k, d in PASS_AXES.items())

    # Remat policies of one partitioning, from the most recompute: recomputing less never needs
    # less memory, so where one does not fit, the ones that recompute less are not tried ("full"
    # first, the policies between, none last). Recomputing more never saves time either, so a
    # fitting policy does not end the chain: the next may fit and be faster.
    chains: dict[str, list[str]] = {}
    for key, members in groups.items():
        chains.setdefault(_group_key({k: v for k, v in members[0].items() if k != "remat"}), []).append(key)
    rows: list[Any] = []
    by_group: dict[str, Any] = {}
    for chain in chains.values():
        over: int | None = None  # the level that did not fit: less recompute is not tried
        for key in sorted(chain, key=lambda k: -_remat_level(groups[k][0])):
            level = _remat_level(groups[key][0])
            if budget is not None and over is not None and level < over:
                continue
            got = search([min(groups[key], key=distance)])
            rows += got
            if not got:
                continue
            by_group[key] = got[0]
            if budget is not None and got[0].peak_bytes > budget and over is None:
                over = level
    ranked = sorted(by_group, key=lambda k: _rank(by_group[k], budget))
    best_of_tp: dict[int, list[str]] = {}
    for key in ranked:
        best_of_tp.setdefault(int(groups[key][0].get("tp_size") or 1), []).append(key)
    for key in [k for keys in best_of_tp.values() for k in keys[:refine]]:
        members, best = groups[key], by_group[key]
        for axis in PASS_AXES:
            values = dict.fromkeys(m.get(axis) for m in members)
            for v in values:
                if v == best.options.get(axis):
                    continue
                want = {**best.options, axis: v}
                if axis == "forward_prefetch" and "backward_prefetch" in want:
                    want["backward_prefetch"] = v
                match = [m for m in members if m == want]
                if not match:
                    continue
                got = search(match)
                rows += got
                if got and _rank(got[0], budget) < _rank(best, budget):
                    best = got[0]
    return rows


def _remat_level(opts: dict[str, Any]) -> int:
    """0: no recompute; 2: ``remat="full"`` (the most); 1: any other policy or budget."""
    remat = opts.get("remat")
    return 0 if remat is None else 2 if remat == "full" else 1


def _rank(r: Any, budget: int | None) -> tuple[bool, float, int]:
    return (budget is not None and r.peak_bytes > budget, r.step_s, r.peak_bytes)


# pass-only options the plan searches, with DataParallel's defaults
PASS_AXES = {"forward_prefetch": 1, "backward_prefetch": 1, "min_unit_mb": 1.0}


def skipped_words(skipped: list[tuple[str, str]]) -> str:
    """``skipped`` (label, why) in a few words: the count per style and the least need."""
    styles: dict[str, int] = {}
    for label, _ in skipped:
        style = label.split(",", 1)[0]
        styles[style] = styles.get(style, 0) + 1
    least = min(skipped, key=lambda lw: float(lw[1].split(" need ")[-1].split()[0]))
    counts = ", ".join(f"{k} ({n})" for k, n in styles.items())
    return f"{counts}; the least: {least[0]}: {least[1]}"


def shares(configs: list[dict[str, Any]], jobs: int) -> list[list[dict[str, Any]]]:
    """``configs`` split into at most ``jobs`` shares for processes of their own, whole tensor-
    parallel sizes per share (a tp size's copies share their traces and automatic choice),
    balanced by the work: a tp row lowers at about 3.5 times a data-parallel row's cost (70B
    shapes here). Deterministic: the same split every run."""
    if jobs <= 1:
        return [list(configs)]
    by_tp: dict[int, list[dict[str, Any]]] = {}
    for opts in configs:
        by_tp.setdefault(int(opts.get("tp_size") or 1), []).append(opts)
    out: list[list[dict[str, Any]]] = [[] for _ in range(max(1, min(jobs, len(by_tp))))]
    load = [0.0] * len(out)
    for _tp, members in sorted(by_tp.items(), key=lambda kv: (-_work(kv[0], len(kv[1])), kv[0])):
        i = load.index(min(load))
        out[i] += members
        load[i] += _work(_tp, len(members))
    return [s for s in out if s]


def _work(tp: int, n: int) -> float:
    return n * (1.0 if tp == 1 else 3.5)


_JOBS: list[Any] = []  # the forked workers' work (a closure of the parent's, inherited by fork)


def _run_job(i: int) -> Any:
    return _JOBS[i]()


def in_processes(work: list[Any]) -> list[Any]:
    """Each callable of ``work`` run in a process forked from this one; their results, in order.
    The children inherit everything (the fake world, the model copies); what they return comes
    back pickled."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if len(work) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [w() for w in work]

    _JOBS[:] = work
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=len(work), mp_context=ctx) as ex:
            futures = [ex.submit(_run_job, i) for i in range(len(work))]
            return [f.result() for f in futures]
    finally:
        _JOBS.clear()
