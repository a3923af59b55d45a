"""Validation of the cost model behind ``spmd.plan``: predicted vs measured, on 2 gloo ranks.

    python benchmarks/plan_check.py              # calibrate, then one torchrun job (~3 min on 2 cores)
    python benchmarks/plan_check.py --quick      # small models, few steps

``make bench`` runs it after the DDP/FSDP2 comparison (``run.py``) and adds its records to
``bench.json``. Per configuration (the bench models of ``models.py`` x five spmd data-parallel
configurations): the step time measured here (median over steps of the slower rank) against
the one ``passes.cost_model`` predicts from the step's final graph on the ``cpu-local`` profile
calibrated in the run (``spmd.calibrate``; the compute constants again on both ranks at once
at the start of the job, as the steps will share the machine), and the peak memory ``MemTracker``
measures against the report's prediction (``passes.memory``). Printed: a table, Spearman's
rank correlation and the median absolute error of the step times, the worst peak error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

_PREFETCH_0 = {"forward_prefetch": 0, "backward_prefetch": 0}
_PREFETCH_2 = {"forward_prefetch": 2, "backward_prefetch": 2}
# (label, DataParallel keyword arguments)
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("replicate", {"parallel_style": "replicate"}),
    ("fully_shard", {"parallel_style": "fully_shard"}),
    ("fully_shard no reshard", {"parallel_style": "fully_shard", "reshard_after_forward": False}),
    ("fully_shard prefetch 0", {"parallel_style": "fully_shard", **_PREFETCH_0}),
    ("fully_shard prefetch 2", {"parallel_style": "fully_shard", **_PREFETCH_2}),
]
MODELS = ("overhead", "gpt")


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties; Pearson's r of the ranks)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


# ----------------------------------------------------------------------------- one rank (torchrun)


def worker(args: argparse.Namespace) -> None:
    import models
    import torch
    import torch.distributed as dist

    from spmd.calibrate import measure_compute
    from spmd.profiles import get_profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    # The compute constants again, on both ranks at once: what one rank gets of the machine
    # while the other rank computes too (spmd.calibrate measured them in one process). Once, not
    # before each configuration: on a loaded machine that re-measurement moved by up to 1.7x
    # between configurations, more than the configurations differ.
    dist.barrier()
    prof = dataclasses.replace(get_profile(args.profile), **measure_compute())
    records = []
    for model_name in args.models.split(","):
        spec = models.get(model_name, quick=args.quick)
        gen = torch.Generator().manual_seed(1000 + rank)
        batches = [spec.batch(gen) for _ in range(4)]
        for label, opts in CONFIGS:
            rec = {"model": model_name, "config": label, "options": opts}
            rec.update(measure_one(spec, batches, opts, prof, steps=args.steps, warmup=args.warmup))
            if rank == 0:
                records.append(rec)
                print(
                    f"  plan check {model_name}/{label}: measured {rec['measured_step_ms']:.1f} ms, "
                    f"predicted {rec['predicted_step_ms']:.1f} ms",
                    flush=True,
                )
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def measure_one(
    spec: Any, batches: list[Any], opts: dict[str, Any], prof: Any, *, steps: int, warmup: int
) -> dict[str, Any]:
    """One configuration on this rank: measured step time (the slower rank's, median over steps)
    and MemTracker peak, and the cost model's and the report's predictions."""
    import measure
    import torch
    import torch.distributed as dist

    import spmd
    from passes.cost_model import GroupInfo, estimate_step_time

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = spec.build()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

    def train_step(model, optim, x, y):  # noqa: ANN001, ANN202
        loss = spec.loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    step = spmd.compile(parallel_mode=spmd.DataParallel(**opts))(train_step)
    it = [0]

    def run() -> Any:
        x, y = batches[it[0] % len(batches)]
        it[0] += 1
        return step(model, optim, x, y)

    for _ in range(1 + warmup):
        run()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    every: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(every, times)
    per_step = [max(t[i] for t in every) for i in range(len(times))]
    peak = measure.peak_memory(run, model, optim)
    gm = step.graphs["final"]
    groups = {name: GroupInfo(size=world, spans_nodes=False) for name in _group_names(gm)}
    cost = estimate_step_time(gm, prof, groups)
    # The same graph on the profile without what issue 22 added (one matmul and one add
    # roofline, no curves, no allocation or collective host cost): the model before.
    plain = dataclasses.replace(
        prof, op_curves={}, fresh_alloc_curve=(), view_overhead_s=None, per_tensor_s=0.0,
        collective_host_s=0.0,
    )  # fmt: skip
    before = estimate_step_time(gm, plain, groups)
    return {
        "predicted_step_ms_roofline": before.step_s * 1e3,
        "measured_step_ms": statistics.median(per_step) * 1e3,
        "predicted_step_ms": cost.step_s * 1e3,
        "predicted_compute_ms": cost.compute_s * 1e3,
        "predicted_comm_ms": cost.comm_s * 1e3,
        "predicted_exposed_comm_ms": cost.exposed_comm_s * 1e3,
        "measured_peak_bytes": peak,
        "predicted_peak_bytes": step.report().peak_memory_bytes,
    }


def _group_names(gm: Any) -> set[str]:
    from passes import collectives as C

    return {C.group_of(n) for n in C.collectives(gm.graph)}


# ----------------------------------------------------------------------------- driver


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Spearman's rho and errors over the records (each with measured and predicted numbers)."""
    ok = [r for r in records if r.get("measured_step_ms") and r.get("predicted_step_ms")]
    meas = [r["measured_step_ms"] for r in ok]
    pred = [r["predicted_step_ms"] for r in ok]
    step_err = [abs(p - m) / m for p, m in zip(pred, meas)]
    peak_err = [
        abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        for r in ok
        if r.get("measured_peak_bytes")
    ]
    before = [r.get("predicted_step_ms_roofline") for r in ok]
    before_err = [abs(p - m) / m for p, m in zip(before, meas) if p]
    return {
        "configurations": len(ok),
        # The model before issue 22's measured costs, on the same graphs and run.
        "spearman_step_time_roofline": spearman([p or 0.0 for p in before], meas) if len(ok) > 1 else None,
        "median_abs_step_error_roofline": statistics.median(before_err) if before_err else None,
        "spearman_step_time": spearman(pred, meas) if len(ok) > 1 else None,
        "median_abs_step_error": statistics.median(step_err) if step_err else None,
        "max_abs_step_error": max(step_err) if step_err else None,
        "spearman_peak": spearman(
            [r["predicted_peak_bytes"] for r in ok], [r["measured_peak_bytes"] for r in ok]
        )
        if len(ok) > 1
        else None,
        "median_abs_peak_error": statistics.median(peak_err) if peak_err else None,
        "max_abs_peak_error": max(peak_err) if peak_err else None,
    }


def table(records: list[dict[str, Any]], summ: dict[str, Any]) -> str:
    lines = [
        "| model | configuration | measured ms | predicted ms | error | roofline-only ms | error "
        "| exposed comm ms (pred) | peak MiB (MemTracker) | predicted MiB | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for r in records:
        e = (r["predicted_step_ms"] - r["measured_step_ms"]) / r["measured_step_ms"]
        pe = (r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        rl = r.get("predicted_step_ms_roofline") or float("nan")
        re_ = (rl - r["measured_step_ms"]) / r["measured_step_ms"]
        lines.append(
            f"| {r['model']} | {r['config']} | {r['measured_step_ms']:.1f} | {r['predicted_step_ms']:.1f} "
            f"| {e:+.0%} | {rl:.1f} | {re_:+.0%} | {r['predicted_exposed_comm_ms']:.1f} "
            f"| {r['measured_peak_bytes'] / mib:.1f} "
            f"| {r['predicted_peak_bytes'] / mib:.1f} | {pe:+.1%} |"
        )

    def fmt(x: float | None, pct: bool = False) -> str:
        if x is None:
            return "-"
        return f"{x:.1%}" if pct else f"{x:.3f}"

    lines.append("")
    lines.append(
        f"step time over {summ['configurations']} configurations: Spearman {fmt(summ['spearman_step_time'])} "
        f"(target >= 0.9), median |error| {fmt(summ['median_abs_step_error'], True)} (target <= 20%), "
        f"max {fmt(summ['max_abs_step_error'], True)}; peak: median |error| "
        f"{fmt(summ['median_abs_peak_error'], True)}, max {fmt(summ['max_abs_peak_error'], True)} "
        "(target <= 3%); the roofline-only model on the same graphs: Spearman "
        f"{fmt(summ.get('spearman_step_time_roofline'))}, median |error| "
        f"{fmt(summ.get('median_abs_step_error_roofline'), True)}"
    )
    return "\n".join(lines)


def run(*, quick: bool, log_path: str, timeout: int = 1500) -> dict[str, Any]:
    """Calibrate, run the job, and return ``{"records", "summary", "profile"}`` (or ``{"error"}``)."""
    from spmd.calibrate import calibrate

    t0 = time.perf_counter()
    prof = calibrate(threads=1)
    fd, prof_path = tempfile.mkstemp(suffix=".json", prefix="spmd_cpu_local_")
    with os.fdopen(fd, "w") as f:
        json.dump(prof.to_dict(), f)
    fd, out = tempfile.mkstemp(suffix=".json", prefix="plan_check_")
    os.close(fd)
    os.unlink(out)
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        os.path.abspath(__file__),
        "--worker",
        f"--profile={prof_path}",
        f"--out={out}",
        f"--steps={4 if quick else 10}",
        f"--warmup={1 if quick else 2}",
    ]
    if quick:
        cmd.append("--quick")
    # A rank that dies of a signal prints its Python stacks into the log (issue 23).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        try:
            subprocess.run(cmd, cwd=ROOT, env=env, stderr=log, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            log.write(f"\nplan check: timed out after {timeout} s\n")
    os.unlink(prof_path)
    if not os.path.exists(out):
        return {"error": f"the plan-check job wrote no records; see {log_path}"}
    with open(out) as f:
        records = json.load(f)
    os.unlink(out)
    return {
        "records": records,
        "summary": summary(records),
        "profile": prof.to_dict(),
        "took_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    log_path = os.path.join(tempfile.gettempdir(), f"spmd_plan_check_{os.getpid()}.log")
    res = run(quick=args.quick, log_path=log_path)
    if "error" in res:
        sys.exit(res["error"])
    print(table(res["records"], res["summary"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
