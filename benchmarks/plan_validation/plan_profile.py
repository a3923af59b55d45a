"""Where the time of ``spmd.plan`` goes: cProfile of one plan, summed by stage.

    python benchmarks/plan_validation/plan_profile.py --preset llama3.1-70b --world-size 1024 \
        --batch 2 --seq 8192 --mixed-precision bf16 --styles fully_shard \
        --prefetch 1 --min-unit-mb 1 --reshard true
    python benchmarks/plan_validation/plan_profile.py --hf-config 70b-8-layers.json --world-size 1024 \
        --batch 1 --seq 8192 --mixed-precision bf16 --remat full --tp 8 --tp-plan auto --exact

Takes the model options of ``python -m spmd.plan`` and a narrowed search (default: one
configuration, no remat), runs the plan under cProfile and prints the cumulative time of each
stage (trace, partition, each pass, memory estimate, cost model, checks), the plan's own timing,
and the top functions by cumulative time. A profile slows Python by a factor of about 1.5-2 and
the machine may be shared: read the shares, not the seconds. ``--out`` keeps the raw profile.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# (stage, (file suffix, function name)): the functions whose cumulative time is the stage's.
STAGES: list[tuple[str, tuple[str, str]]] = [
    ("fake copy of the arguments", ("spmd/simulate/__init__.py", "fake_copy")),
    ("distribute the fake state (prepare)", ("spmd/parallel/data_parallel.py", "prepare")),
    ("trace (make_fx)", ("spmd/frontend/tracing.py", "trace_step")),
    ("copy of the cached trace", ("spmd/frontend/tracing.py", "copy_traced")),
    ("automatic tp placements (choose)", ("spmd/parallel/auto_tp.py", "choose")),
    ("  of which the DTensor check", ("spmd/parallel/auto_tp_check.py", "dirty_nodes")),
    ("tp expansion (expand_tp)", ("spmd/parallel/tensor_parallel.py", "expand_tp")),
    ("chunked loss head", ("spmd/pipeline.py", "chunk_loss")),
    ("remat", ("passes/remat.py", "rematerialize")),
    ("partition", ("spmd/parallel/data_parallel.py", "partition")),
    ("copy of the cached partition", ("spmd/frontend/tracing.py", "copy_graph_module")),
    ("pass dedup_collectives", ("passes/dedup.py", "dedup_collectives")),
    ("pass assign_units", ("passes/units.py", "assign_units")),
    ("pass prefetch_all_gathers", ("passes/prefetch.py", "prefetch_all_gathers")),
    ("pass bucket_collectives", ("passes/bucketing.py", "bucket_collectives")),
    ("pass inplace_all_reduce", ("passes/inplace.py", "inplace_all_reduce")),
    ("pass sink_waits", ("passes/scheduling.py", "sink_waits")),
    ("pass limit_inflight", ("passes/scheduling.py", "limit_inflight")),
    ("pass reduce_scatter_as_all_to_all", ("passes/gloo_collectives.py", "reduce_scatter_as_all_to_all")),
    ("pass overlap_optimizer", ("passes/optimizer_overlap.py", "overlap_optimizer")),
    ("pass strip_grad_tags", ("passes/cleanup.py", "strip_grad_tags")),
    ("pass reuse_dead_buffers", ("passes/reuse.py", "reuse_dead_buffers")),
    ("  of which GraphModule.recompile", ("torch/fx/graph_module.py", "recompile")),
    ("  of which Graph.lint", ("torch/fx/graph.py", "lint")),
    ("invariant checks (check_invariants)", ("passes/invariants.py", "check_invariants")),
    ("final-graph check (collective buffers)", ("spmd/backend/runtime.py", "check_final_graph")),
    ("executable (make_executable)", ("spmd/backend/runtime.py", "make_executable")),
    ("memory estimate + report", ("spmd/reporting/report.py", "build_report")),
    ("cost model", ("passes/cost_model.py", "estimate_step_time")),
]


def stage_table(stats: pstats.Stats) -> list[tuple[str, float, int]]:
    """(stage, cumulative seconds, calls) for every stage that ran."""
    raw = stats.stats  # type: ignore[attr-defined]
    out = []
    for label, (suffix, name) in STAGES:
        cum, calls = 0.0, 0
        for (path, _line, func), (_cc, nc, _tt, ct, _callers) in raw.items():
            if func == name and path.replace(os.sep, "/").endswith(suffix):
                cum += ct
                calls += nc
        if calls:
            out.append((label, cum, calls))
    return out


def main() -> int:
    from spmd import models
    from spmd.plan import plan

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models.add_model_arguments(p)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--device", default="h100-80gb")
    p.add_argument("--styles", default="fully_shard")
    p.add_argument("--prefetch", default="1")
    p.add_argument("--min-unit-mb", default="1")
    p.add_argument("--reshard", default="true")
    p.add_argument("--remat", default="none", help="remat policies, comma-separated (none, selective, full)")
    p.add_argument("--exact", action="store_true", help="no folded search: every row on the full model")
    p.add_argument("--tp", default="", help="tp sizes searched, e.g. 8 or 1,2,4,8 (default: none)")
    p.add_argument("--tp-plan", default="auto", help="with --tp: auto, llama or llama-sp")
    p.add_argument("--out", default=None, help="write the raw profile here")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("-v", "--verbose", action="store_true", help="log spmd's progress (each pass's time)")
    args = p.parse_args()
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import spmd

    fn, (model, optim, idx, targets), mp = models.build_from_args(args)
    step = spmd.compile()(fn)
    remat = [None if r == "none" else r for r in args.remat.split(",")]
    tp_kw = {}
    if args.tp:
        from spmd.plan.__main__ import default_tp_plan

        tp_kw = {"tp_plan": default_tp_plan(args), "tp": tuple(int(x) for x in args.tp.split(","))}
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    result = plan(
        step,
        model,
        optim,
        idx,
        targets,
        world_size=args.world_size,
        device=args.device,
        mixed_precision=mp,
        styles=args.styles.split(","),
        prefetch=[int(x) for x in args.prefetch.split(",")],
        min_unit_mb=[float(x) for x in args.min_unit_mb.split(",")],
        reshard=[x.strip().lower() == "true" for x in args.reshard.split(",")],
        remat=remat,
        exact=args.exact,
        **tp_kw,
    )
    prof.disable()
    wall = time.perf_counter() - t0
    if args.out:
        prof.dump_stats(args.out)
    print(result)
    print(f"\nwall {wall:.1f} s under cProfile, load average {os.getloadavg()[0]:.1f}")
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    print("\n| stage | calls | cumulative s | share |\n|---|---|---|---|")
    for label, cum, calls in stage_table(stats):
        print(f"| {label} | {calls} | {cum:.1f} | {100 * cum / total:.0f}% |")
    print()
    stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
