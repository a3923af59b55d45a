"""Where the cost model's step time goes against where a real step's goes, per op class and per op.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmarks/plan_validation/cost_breakdown.py \
        --models overhead,gpt [--profile ~/.cache/spmd/cpu-local.json] [--steps 5] [--table 15] [--stamps]
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=2 \
        benchmarks/plan_validation/cost_breakdown.py --stamps --style replicate --models overhead

World size 1 (no process group, no collectives): each bench model's step is compiled with the
eager backend, timed, then profiled with ``torch.profiler`` for ``--steps`` steps. The CPU time
of every ATen op the graph calls (with its children) is summed by op class
(``passes.cost_model.op_class``; views apart) and set against the cost model's time for the same
nodes of the final graph on ``--profile``; "step - ops" is the rest of the profiled step (fx's
generated Python, the wrapper, the profiler's own cost).

``--stamps``: instead of the profiler (whose own cost per op inflates the small ops about 2x),
a copy of the final graph with a ``time.perf_counter_ns()`` call between every two nodes, run on
the step's real inputs: each node's time in place (cold caches, fx's ``del``s, what the profiler
does not see), median over ``--steps`` runs, summed per op against the cost model's per node.
The per-op table of issue 22 comes from this mode (``--table N``: the N ops with the most time);
it prints the same per op class first (collectives and waits apart: their host time in place, a
wait's with the exposed communication, against the model's launch and host charges).
``--stamps --style S`` under torchrun: the step compiled with ``spmd.DataParallel(S)`` on the
job's gloo ranks (rank r's batch from seed 1000 + r, as the bench's), every rank running the
stamped graph, rank 0 printing: where a 2-rank step's time goes (the two ranks share the
machine; the calibration's single-process curves may not).
Used to find what the calibration misses (issue 22), not a validation: ``plan_check.py`` is.
"""

from __future__ import annotations

import argparse
import collections
import operator
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import spmd  # noqa: E402
from benchmarks.bench import models  # noqa: E402
from passes import collectives as C  # noqa: E402
from passes import cost_model as cm  # noqa: E402
from spmd.profiles import get_profile  # noqa: E402


def predicted_by_class(gm: torch.fx.GraphModule, prof: cm.DeviceProfile) -> dict[str, list[float]]:
    """op class -> [seconds, ops] of the cost model's compute nodes (launches of free ops: "view")."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target.__class__.__name__ == "builtin_function_or_method":
            continue
        if cm._is_free(n):
            out["view"][0] += cm.free_time(n, prof)
            out["view"][1] += 1
            continue
        t, _ = cm.compute_time(n, prof)
        rec = out[cm.op_class(n)]
        rec[0] += t
        rec[1] += 1
    return out


def graph_op_classes(gm: torch.fx.GraphModule) -> dict[str, str]:
    """profiler event name (``aten::mm``) -> op class, for the ATen ops the graph calls."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and hasattr(n.target, "name"):
            out[n.target.name().split(".")[0]] = "view" if cm._is_free(n) else cm.op_class(n)
    return out


def outer_events(pr: torch.profiler.profile, cls_of: dict[str, str]) -> list:  # type: ignore[type-arg]
    """The profiler events of the graph's own calls: an ATen op not called from inside another
    op the graph calls (``aten::linear`` calling ``aten::t``), with its children's time."""
    return [
        ev
        for ev in pr.events()
        if ev.name in cls_of and not (ev.cpu_parent is not None and ev.cpu_parent.name in cls_of)
    ]


def stamped(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str]]:
    """A copy of ``gm`` that also returns a ``perf_counter_ns()`` before its first op and after
    each op, and the names of those ops in order (node ``i`` ran between stamps ``i`` and ``i+1``)."""
    import copy

    g = copy.deepcopy(gm.graph)
    stamps: list[torch.fx.Node] = []
    names: list[str] = []
    for n in list(g.nodes):
        if n.op in ("placeholder", "output"):
            continue
        if not stamps:
            with g.inserting_before(n):
                stamps.append(g.call_function(time.perf_counter_ns, ()))
        with g.inserting_after(n):
            stamps.append(g.call_function(time.perf_counter_ns, ()))
        names.append(n.name)
    out = g.output_node()
    out.args = ((out.args[0], stamps),)
    return torch.fx.GraphModule(gm, g), names


def _key(n: torch.fx.Node) -> str:
    return "getitem" if n.target is operator.getitem else str(n.target)


def _node_kind(n: torch.fx.Node) -> str:
    """The row of the per-class table a node goes to: its op class, "view", or the collective
    and wait rows (their host time in place; a wait's includes the exposed communication)."""
    if C.is_collective(n):
        return "collective"
    if C.is_wait(n):
        return "wait"
    return "view" if cm._is_free(n) else cm.op_class(n)


def stamps_table(
    step: object, args: tuple, prof: cm.DeviceProfile, runs: int, top: int,
    groups: dict[str, cm.GroupInfo] | None = None,
) -> None:  # fmt: skip
    """Per op class and per op: the time of its nodes in place in the step's graph (``stamped``)
    against the cost model's, printed (all ops, or the ``top`` with the most time). Under a
    process group (``groups``) every rank runs the stamped graph (its collectives too), the
    ranks meeting at a barrier before each run, and rank 0 prints."""
    exe = step._last.exe  # type: ignore[attr-defined]
    flat = [
        spmd.parallel.sharding.local(t) for t in exe.inputs(spmd.frontend.step_inputs.split_args(args, {}))
    ]
    gm, names = stamped(exe.gm)
    nodes = {n.name: n for n in exe.gm.graph.nodes}
    per: dict[str, list[float]] = collections.defaultdict(list)
    walls = []
    for _ in range(runs + 2):
        if groups:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            _, st = gm(*flat)
        walls.append(time.perf_counter() - t0)
        for i, name in enumerate(names):
            per[name].append((st[i + 1] - st[i]) * 1e-9)
    if groups and dist.get_rank() != 0:
        return
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    classes: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name in names:
        n = nodes[name]
        if n.op != "call_function":
            continue
        if C.is_collective(n) or C.is_wait(n):
            # The model's host charge on the compute stream (launch, and a collective's host cost);
            # its wire time and the exposed part are the critical path's, not a node's.
            pred = prof.op_overhead_s + (prof.collective_host_s if C.is_collective(n) else 0.0)
        else:
            pred = cm.free_time(n, prof) if cm._is_free(n) else cm.compute_time(n, prof)[0]
        meas = statistics.median(per[name][2:])
        for r in (rows[_key(n)], classes[_node_kind(n)]):
            r[0] += 1
            r[1] += meas
            r[2] += pred
    tot_m = sum(r[1] for r in rows.values())
    tot_p = sum(r[2] for r in rows.values())
    print(
        f"  in place (stamps, median of {runs} runs): graph {statistics.median(walls[2:]) * 1e3:.2f} ms, "
        f"ops {tot_m * 1e3:.2f} ms measured, {tot_p * 1e3:.2f} ms predicted"
    )
    print(f"    {'class':50s} {'n':>5s} {'meas ms':>8s} {'pred ms':>8s}")
    for k, (c, m, p_) in sorted(classes.items(), key=lambda kv: -kv[1][1]):
        print(f"    {k:50s} {c:5.0f} {m * 1e3:8.3f} {p_ * 1e3:8.3f}")
    print(f"    {'op':50s} {'n':>5s} {'meas ms':>8s} {'pred ms':>8s} {'us/op meas':>10s} {'us/op pred':>10s}")
    ordered = sorted(rows.items(), key=lambda kv: -kv[1][1])
    for k, (c, m, p_) in ordered[: top or None]:
        print(f"    {k:50s} {c:5.0f} {m * 1e3:8.3f} {p_ * 1e3:8.3f} {m / c * 1e6:10.1f} {p_ / c * 1e6:10.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="overhead,gpt")
    p.add_argument("--profile", default="cpu-local")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--table", type=int, default=0, help="also print the N ops with the most measured time")
    p.add_argument("--stamps", action="store_true", help="time each node in place instead of the profiler")
    p.add_argument(
        "--style",
        default=None,
        help="under torchrun (gloo): spmd.DataParallel(STYLE) on the job's ranks (with --stamps)",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    prof = get_profile(args.profile)
    mode = None
    if args.style:
        if not args.stamps:
            sys.exit("--style: only with --stamps (the profiler mode runs at world size 1)")
        dist.init_process_group("gloo")
        mode = spmd.DataParallel(args.style)
    for name in args.models.split(","):
        spec = models.get(name)
        torch.manual_seed(0)
        model = spec.build()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

        def train_step(model, optim, x, y):  # noqa: ANN001, ANN202
            loss = spec.loss(model(x), y)  # noqa: B023 - traced at once, in this iteration
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss

        step = spmd.compile(parallel_mode=mode)(train_step) if mode else spmd.compile()(train_step)
        gen = torch.Generator().manual_seed(1000 + (dist.get_rank() if mode else 0))
        x, y = spec.batch(gen)
        for _ in range(3):
            step(model, optim, x, y)
        gm = step.graphs["final"]
        times = []
        for _ in range(max(args.steps, 5)):
            if mode:
                dist.barrier()
            t0 = time.perf_counter()
            step(model, optim, x, y)
            times.append(time.perf_counter() - t0)
        wall = statistics.median(times)
        if args.stamps:
            world = dist.get_world_size() if mode else 1
            groups = {
                C.group_of(n): cm.GroupInfo(size=world, spans_nodes=False) for n in C.collectives(gm.graph)
            }
            est = cm.estimate_step_time(gm, prof, groups)
            if not mode or dist.get_rank() == 0:
                print(
                    f"\n{name} ({args.style or 'one process'}, world size {world}): step {wall * 1e3:.2f} ms "
                    f"(this rank), predicted {est.step_s * 1e3:.2f} ms on {prof.name} (compute "
                    f"{est.compute_s * 1e3:.2f}, exposed comm {est.exposed_comm_s * 1e3:.2f})"
                )
            stamps_table(
                step, (model, optim, x, y), prof, max(args.steps, 10), args.table, groups if mode else None
            )
            continue
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as pr:
            for _ in range(args.steps):
                step(model, optim, x, y)
        prof_wall = (time.perf_counter() - t0) / args.steps
        cls_of = graph_op_classes(gm)
        events = outer_events(pr, cls_of)
        meas: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for ev in events:
            rec = meas[cls_of[ev.name]]
            rec[0] += ev.cpu_time_total * 1e-6 / args.steps
            rec[1] += 1 / args.steps
        pred = predicted_by_class(gm, prof)
        est = cm.estimate_step_time(gm, prof, {})
        print(f"\n{name}: step {wall * 1e3:.2f} ms, under the profiler {prof_wall * 1e3:.2f} ms")
        print(f"  predicted {est.step_s * 1e3:.2f} ms on {prof.name} (compute {est.compute_s * 1e3:.2f} ms)")
        head = ("class", "ops", "profiled ms", "predicted ms", "us/op prof", "us/op pred")
        print("  {:12s} {:>6s} {:>12s} {:>13s} {:>11s} {:>11s}".format(*head))
        tot_m = tot_p = 0.0
        for k in sorted(set(meas) | set(pred), key=lambda k: -meas.get(k, [0.0])[0]):
            m, pr_ = meas.get(k, [0.0, 0]), pred.get(k, [0.0, 0])
            tot_m += m[0]
            tot_p += pr_[0]
            print(
                f"  {k:12s} {pr_[1]:6.0f} {m[0] * 1e3:12.2f} {pr_[0] * 1e3:13.2f} "
                f"{(m[0] / m[1] * 1e6 if m[1] else 0):11.1f} {(pr_[0] / pr_[1] * 1e6 if pr_[1] else 0):11.1f}"
            )
        print(f"  {'ops total':12s} {'':6s} {tot_m * 1e3:12.2f} {tot_p * 1e3:13.2f}")
        # The profiler's own cost per op inflates the small ops (the overhead model's step runs
        # about 2x slower under it): read the classes' shares, the unprofiled step for the total.
        print(f"  {'step - ops':12s} {'':6s} {(prof_wall - tot_m) * 1e3:12.2f}")
        if args.table:
            rows: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
            for ev in events:
                rows[ev.name][0] += ev.cpu_time_total * 1e-6 / args.steps
                rows[ev.name][1] += 1 / args.steps
            predn: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
            for n in gm.graph.nodes:
                if n.op == "call_function" and hasattr(n.target, "name"):
                    t = cm.free_time(n, prof) if cm._is_free(n) else cm.compute_time(n, prof)[0]
                    predn["aten::" + n.target.name().split("::")[1].split(".")[0]][0] += t
                    predn["aten::" + n.target.name().split("::")[1].split(".")[0]][1] += 1
            for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[: args.table]:
                pk = predn.get(k, [0.0, 0])
                print(f"    {k:50s} x{c:5.0f} profiled {t * 1e3:8.2f} ms  pred {pk[0] * 1e3:8.2f} ms")
    if mode:
        dist.destroy_process_group()


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
