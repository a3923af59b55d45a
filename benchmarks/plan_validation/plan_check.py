"""Validation of the cost model behind ``spmd.plan``: predicted vs measured, on 2 gloo ranks.

    python benchmarks/plan_validation/plan_check.py     # calibrate, then one torchrun job (~4 min on 2 cores)
    python benchmarks/plan_validation/plan_check.py --quick           # small models, few steps
    python benchmarks/plan_validation/plan_check.py --malloc system   # glibc's default allocator settings
    python benchmarks/plan_validation/plan_check.py --group default   # the job's group as a new user makes it

``make bench`` runs it after the DDP/FSDP2 comparison (``run.py``) and adds its records to
``bench.json``. Per configuration (the bench models of ``models.py`` x five spmd data-parallel
configurations, and two of the ``encoder`` model, labelled apart): the step time measured here
against the one ``passes.cost_model`` predicts from the step's final graph on the ``cpu-local``
profile calibrated in the run (``spmd.calibrate``; the compute constants again on both ranks at
once at the start of the job, as the steps will share the machine), and the peak memory
``MemTracker`` measures against the report's prediction (``passes.memory``).

How the step time is measured, so that it holds still on a shared machine: every configuration
of a model is built and warmed up first, then timed in interleaved rounds (each round gives
every configuration, in turn, one untimed step after the switch and its share of the timed
steps), so load that drifts during the run falls on every row alike; a step's time is the
slower rank's; a row's time is the median over its steps, printed with the interquartile range
(IQR, over the median) so a reader sees which orderings are within the noise. The calibration
and the job run with glibc's allocator kept from returning memory to the system
(``MALLOC_KEEP``: without it every large buffer is mapped anew and page-faults on each step,
10-17% of a GPT step, and the per-step IQR was 6-16% instead of 3-6%); ``--malloc system``
runs both with the plain environment instead.

A row measures what a run of that configuration alone would, on the machine as it was during the
rounds: interleaving was measured not to change a step (2026-11-25, world size 1 on one core: the
GPT replicate step alone 510 ms, among the other four configurations 508 ms; 606 / 602 ms in a
busier run), nor was the barrier before each timed step (the bench has none). What does change a
step is the machine (the same GPT step took 490-600 ms on one core within 15 minutes), so the
check prints what shows it: per row the 25th percentile and the slower rank's main-thread CPU
time beside the median; per model the share of the cores other processes used during its rounds
and the hypervisor's steal (``/proc/stat``), and ``spmd.calibrate``'s matmul and add probe run
at the start of each round over the same two measurements in the job's calibration (1.00: as fast
as when the predictions' constants were measured; with rank 0's absolute readings).

The process group: by default made under ``spmd.gloo_threads(1)``, as ``make bench`` makes it.
``--group default`` makes it as a new user's script does, ``init_process_group("gloo")`` (torch's
two worker threads): spmd then runs its collectives on one-thread groups of its own
(``spmd.parallel.gloo_group``), so the overlap the cost model prices (a prefetched gather beside
a reduce-scatter) is what runs. Before that, spmd kept one collective in flight on such a group
and the prefetch rows measured 24-35% slower than predicted (issue 39, item 7). Each record says
the job's group (``group``), the worker threads of the groups its collectives ran on
(``spmd_gloo_threads``) and the most collectives its final graph keeps in flight.

Printed: a table, Spearman's rank correlation and the median absolute error of the step times
(over the ten rows of the overhead and GPT models, and over all rows; on the median and on the
25th percentile), the machine lines, the worst peak error.
"""

from __future__ import annotations

import argparse
import contextlib
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
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from benchmarks.bench.malloc_keep import MALLOC_KEEP  # noqa: E402 (one dict, shared with run.py)
from benchmarks.plan_validation.plan_check_report import ORIGINAL, spearman, summaries, summary, table  # noqa: E402,F401 (re-exported)

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
# The configurations of each model: the ten rows of the original check (overhead, gpt), and
# two rows of the encoder (torch's nn.TransformerEncoder), reported apart from the ten as well.
MODELS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "overhead": CONFIGS,
    "gpt": CONFIGS,
    "encoder": CONFIGS[:2],
}


# ----------------------------------------------------------------------------- one rank (torchrun)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.bench import models
    from spmd.calibrate import measure_compute
    from spmd.profiles import get_profile

    torch.set_num_threads(1)
    from spmd.backend.gloo_threads import gloo_threads

    # one-thread: as make bench (benchmarks/results/crashes.md); default: as a new user's script.
    with gloo_threads(1) if args.group == "one-thread" else contextlib.nullcontext():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    # The compute constants again, on both ranks at once: what one rank gets of the machine
    # while the other rank computes too (spmd.calibrate measured them in one process). Once, not
    # before each configuration: on a loaded machine that re-measurement moved by up to 1.7x
    # between configurations, more than the configurations differ.
    dist.barrier()
    compute = measure_compute()
    prof = dataclasses.replace(get_profile(args.profile), **compute)
    # What the rounds' probes are compared with: this rank's own constants, measured just now by
    # the probe's two functions (measure_compute's fp32 matmul rate and add bandwidth). Not a
    # separate probe taken after measure_compute: on the idle machine (2026-11-25, two runs) the
    # rounds' probes read 1.7-2.2x that one's matmul rate, while measure_compute's own rate on the
    # same rank was 87-89 GFLOP/s -- 1.7-2.2x of it would exceed one core's fp32 peak, so that
    # probe was the slow reading (cause not found;
    # benchmarks/results/plan-validation.md, "Validation on this machine").
    reference = (compute["peak_flops"]["fp32"], compute["memory_bandwidth"])
    records = []
    for model_name in args.models.split(","):
        spec = models.get(model_name, quick=args.quick)
        gen = torch.Generator().manual_seed(1000 + rank)
        batches = [spec.batch(gen) for _ in range(4)]
        rows = [Row(model_name, label, opts, spec, batches, args.group) for label, opts in MODELS[model_name]]
        for row in rows:
            row.build(warmup=args.warmup)
        time_rows(rows, steps=args.steps, rounds=args.rounds, min_time_s=args.min_time, reference=reference)
        for row in rows:
            rec = row.finish(prof)
            if rank == 0:
                records.append(rec)
                print(
                    f"  plan check {model_name}/{row.label}: measured {rec['measured_step_ms']:.1f} ms "
                    f"(IQR {rec['measured_iqr']:.0%}, {rec['timed_steps']} steps), "
                    f"predicted {rec['predicted_step_ms']:.1f} ms",
                    flush=True,
                )
        del rows
    if rank == 0:
        # The profile the predictions used (the calibration's, with the compute constants this
        # job measured on both ranks): ``cost_breakdown.py --profile`` takes it.
        with open(args.out + ".profile.json", "w") as f:
            json.dump(prof.to_dict(), f)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


class Row:
    """One configuration of one model on this rank: its compiled step, and the slower rank's
    time of each timed step."""

    def __init__(
        self, model: str, label: str, opts: dict[str, Any], spec: Any, batches: list[Any], group: str
    ) -> None:
        self.model, self.label, self.opts, self.spec, self.batches = model, label, opts, spec, batches
        self.group = group
        self.times: list[float] = []  # this rank's
        self.cpu: list[float] = []  # this rank's main-thread CPU time of each timed step
        self.machine: dict[str, float] = {}  # what else ran during this model's timed rounds
        self.it = 0
        self.warm_s = 0.0  # the last warm-up step's time
        self.per_round = 0  # timed steps per round

    def build(self, *, warmup: int) -> None:
        import torch

        import spmd

        spec = self.spec
        torch.manual_seed(0)
        self.net = spec.build()
        self.optim = torch.optim.AdamW(self.net.parameters(), lr=1e-3, weight_decay=0.1, fused=True)

        self.step = spmd.compile(parallel_mode=spmd.DataParallel(**self.opts))(spec.train_step())
        for _ in range(1 + warmup):
            t0 = time.perf_counter()
            self.run()
        self.warm_s = time.perf_counter() - t0

    def run(self) -> Any:
        x, y = self.batches[self.it % len(self.batches)]
        self.it += 1
        return self.step(self.net, self.optim, x, y)

    def finish(self, prof: Any) -> dict[str, Any]:
        """The record: measured (the slower rank's step, median and IQR over steps) and MemTracker
        peak, against the cost model's and the report's predictions."""
        import torch.distributed as dist

        from benchmarks.bench import measure
        from passes.cost_model import GroupInfo, estimate_step_time

        world = dist.get_world_size()
        every: list[list[float]] = [[] for _ in range(world)]
        dist.all_gather_object(every, self.times)
        per_step = [max(t[i] for t in every) for i in range(len(self.times))]
        q1, med, q3 = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else [per_step[0]] * 3
        cpus: list[list[float]] = [[] for _ in range(world)]
        dist.all_gather_object(cpus, self.cpu)
        cpu_step = [max(c[i] for c in cpus) for i in range(len(self.cpu))]
        dist.barrier()
        peak = measure.peak_memory(self.run, self.net, self.optim)
        gm = self.step.graphs["final"]
        groups = {name: GroupInfo(size=world, spans_nodes=False) for name in _group_names(gm)}
        cost = estimate_step_time(gm, prof, groups)
        # The same graph on the profile without what issue 22 added (one matmul and one add
        # roofline, no curves, no allocation, call or collective host costs): the model before.
        plain = dataclasses.replace(
            prof, op_curves={}, fresh_alloc_curve=(), view_overhead_s=None, per_tensor_s=0.0,
            collective_host_s=0.0, call_costs={}, mixed_call_factor=1.0, mixed_call_curve=(),
        )  # fmt: skip
        before = estimate_step_time(gm, plain, groups)
        return {
            "model": self.model,
            "config": self.label,
            "options": self.opts,
            "group": self.group,
            **_collective_shape(gm),
            "predicted_step_ms_roofline": before.step_s * 1e3,
            "measured_step_ms": statistics.median(per_step) * 1e3,
            "measured_iqr": (q3 - q1) / med,
            "measured_step_ms_p25": q1 * 1e3,
            # The slower rank's main-thread CPU time per step (median): below the wall time by
            # what the rank waited (collectives, gloo's threads) or was preempted.
            "measured_cpu_ms": statistics.median(cpu_step) * 1e3,
            "machine": self.machine,
            "timed_steps": len(per_step),
            "predicted_step_ms": cost.step_s * 1e3,
            "predicted_compute_ms": cost.compute_s * 1e3,
            "predicted_comm_ms": cost.comm_s * 1e3,
            "predicted_exposed_comm_ms": cost.exposed_comm_s * 1e3,
            "measured_peak_bytes": peak,
            "predicted_peak_bytes": self.step.report().peak_memory_bytes,
        }


def _probe() -> tuple[float, float]:
    """(fp32 matmul FLOP/s, add bandwidth): ``spmd.calibrate``'s two roofline measurements, each
    the median of ``spmd.calibrate.READINGS`` calls (one call varied 2x from call to call), as
    ``measure_compute`` now takes them; about 1.5 s; run on every rank at once (after a barrier),
    as the job's calibration was."""
    import torch.distributed as dist

    from spmd.calibrate import probe

    dist.barrier()
    return probe()


def time_rows(
    rows: list[Row],
    *,
    steps: int,
    rounds: int,
    min_time_s: float,
    reference: tuple[float, float] | None = None,
) -> None:
    """Time every row in ``rounds`` interleaved rounds: per round, each row in turn gets one
    untimed step (the first after switching from another row) and its share of the timed steps,
    at least ``steps`` in all and enough for ``min_time_s`` of timed steps (short steps get more:
    the same share of the run's noise). With ``reference`` (the job's calibration: this rank's
    fp32 matmul rate and add bandwidth as ``measure_compute`` measured them), each round starts
    with a probe: how the machine's speed moved since."""
    import gc
    import math

    import torch.distributed as dist

    warm = [r.warm_s for r in rows]
    every: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, warm)  # the ranks must agree on the number of steps
    for i, row in enumerate(rows):
        slowest = max(w[i] for w in every)
        row.per_round = math.ceil(max(steps, min_time_s / max(slowest, 1e-6)) / rounds)
    before = _machine_counters()
    probes = []
    for _ in range(rounds):
        if reference is not None:
            probes.append(_probe())
        for row in rows:
            gc.collect()
            dist.barrier()
            row.run()  # untimed: the first step after switching rows
            for _ in range(row.per_round):
                dist.barrier()
                c0 = time.thread_time()
                t0 = time.perf_counter()
                row.run()
                row.times.append(time.perf_counter() - t0)
                row.cpu.append(time.thread_time() - c0)
    machine = _machine_share(before, _machine_counters())
    if reference is not None and probes:
        # This rank's probes against its own at the calibration; the slower rank's ratio.
        ratio = (
            statistics.median(p[0] for p in probes) / reference[0],
            statistics.median(p[1] for p in probes) / reference[1],
        )
        every_ratio: list[tuple[float, float]] = [(0.0, 0.0)] * dist.get_world_size()
        dist.all_gather_object(every_ratio, ratio)
        machine["matmul_vs_calibration"] = min(r[0] for r in every_ratio)
        machine["bandwidth_vs_calibration"] = min(r[1] for r in every_ratio)
        # This rank's absolute readings, so that a ratio away from 1 shows which side moved.
        machine["matmul_flops_calibration"] = reference[0]
        machine["matmul_flops_rounds"] = statistics.median(p[0] for p in probes)
        machine["bandwidth_calibration"] = reference[1]
        machine["bandwidth_rounds"] = statistics.median(p[1] for p in probes)
    for row in rows:
        row.machine = machine


def _machine_counters() -> tuple[float, float, list[int] | None]:
    """(wall clock, this process's CPU seconds, ``/proc/stat``'s CPU line in clock ticks or None)."""
    try:
        with open("/proc/stat") as f:
            ticks: list[int] | None = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        ticks = None
    return time.perf_counter(), time.process_time(), ticks


def _machine_share(
    before: tuple[float, float, list[int] | None], after: tuple[float, float, list[int] | None]
) -> dict[str, float]:
    """What else the machine did between two :func:`_machine_counters` of every rank (a
    collective: every rank calls it): the share of all cores' time that other processes used
    (busy CPU time less the ranks' own) and that the hypervisor gave to other machines (steal),
    from ``/proc/stat`` (Linux; empty elsewhere). The ranks' step times are only as steady as
    this is small."""
    import torch.distributed as dist

    own = [0.0] * dist.get_world_size()
    dist.all_gather_object(own, after[1] - before[1])
    if before[2] is None or after[2] is None:
        return {}
    d = [a - b for a, b in zip(after[2], before[2])]
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal
    busy = (d[0] + d[1] + d[2] + d[5] + d[6]) / tick
    total = (after[0] - before[0]) * (os.cpu_count() or 1)
    return {
        "others_cpu_share": max(busy - sum(own), 0.0) / total,
        "steal_share": d[7] / tick / total,
    }


def _collective_shape(gm: Any) -> dict[str, Any]:
    """The worker threads of the gloo groups the final graph's collectives run on, and the most
    collectives it keeps in flight at once (1: spmd serialised them on a several-thread group)."""
    from passes import collectives as C
    from passes import torch_compat

    threads = sorted(
        {torch_compat.gloo_threads(torch_compat.resolve_process_group(g)) for g in _group_names(gm)}
    )
    outstanding: set[Any] = set()
    most = 0
    for n in gm.graph.nodes:
        if C.is_collective(n):
            outstanding.add(n)
            most = max(most, len(outstanding))
        elif C.is_wait(n):
            outstanding.discard(C.collective_of(n))
    return {"spmd_gloo_threads": threads, "most_in_flight": most}


def _group_names(gm: Any) -> set[str]:
    from passes import collectives as C

    return {C.group_of(n) for n in C.collectives(gm.graph)}


# ----------------------------------------------------------------------------- driver


def run(
    *,
    quick: bool,
    log_path: str,
    timeout: int = 1500,
    malloc: str = "keep",
    group: str = "one-thread",
    models: str | None = None,
) -> dict[str, Any]:
    """Calibrate, run the job, and return ``{"records", "summary", "profile"}`` (or ``{"error"}``).

    ``malloc="keep"``: the calibration and the job run with :data:`MALLOC_KEEP`; ``"system"``:
    with the environment as it is. ``group``: the job's process group (see the module doc);
    ``models``: a comma-separated subset of :data:`MODELS` (None: all)."""
    t0 = time.perf_counter()
    # A rank that dies of a signal prints its Python stacks into the log (issue 23).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if malloc == "keep":
        env.update(MALLOC_KEEP)
    fd, prof_path = tempfile.mkstemp(suffix=".json", prefix="spmd_cpu_local_")
    os.close(fd)
    # In its own process: glibc reads the allocator's environment when a process starts.
    cal = [sys.executable, "-m", "spmd.calibrate", "--threads=1", f"--out={prof_path}"]
    fd, out = tempfile.mkstemp(suffix=".json", prefix="plan_check_")
    os.close(fd)
    os.unlink(out)
    steps, rounds = (4, 2) if quick else (20, 4)
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        os.path.abspath(__file__),
        "--worker",
        f"--profile={prof_path}",
        f"--out={out}",
        f"--steps={steps}",
        f"--rounds={rounds}",
        f"--warmup={1 if quick else 2}",
        f"--min-time={0.5 if quick else 2.0}",
        f"--group={group}",
        *([f"--models={models}"] if models else []),
    ]
    if quick:
        cmd.append("--quick")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    with open(log_path, "a") as log:
        for c in (cal, cmd):
            log.write(f"$ {' '.join(c)}\n")
            log.flush()
            try:
                rc = subprocess.run(
                    c, cwd=ROOT, env=env, stdout=log, stderr=log, timeout=timeout, check=False
                )
            except subprocess.TimeoutExpired:
                log.write(f"\nplan check: timed out after {timeout} s\n")
                break
            if rc.returncode != 0:
                break
    if not os.path.exists(out):
        os.unlink(prof_path)
        return {"error": f"the plan-check job wrote no records; see {log_path}"}
    with open(prof_path) as f:
        prof = json.load(f)
    os.unlink(prof_path)
    with open(out) as f:
        records = json.load(f)
    os.unlink(out)
    job_prof = None
    if os.path.exists(out + ".profile.json"):
        with open(out + ".profile.json") as f:
            job_prof = json.load(f)
        os.unlink(out + ".profile.json")
    return {
        "records": records,
        "summary": summaries(records),
        "profile": prof,
        "job_profile": job_prof,  # what the predictions used: compute constants of both ranks at once
        "malloc": malloc,
        "group": group,
        "took_s": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration, at least")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds the timed steps are split into")
    p.add_argument(
        "--min-time", type=float, default=2.0, help="seconds of timed steps per configuration, at least"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--malloc",
        choices=("keep", "system"),
        default="keep",
        help="keep (as run.py --malloc): glibc keeps freed memory (MALLOC_KEEP); system: its defaults",
    )
    p.add_argument(
        "--group",
        choices=("one-thread", "default"),
        default="one-thread",
        help="the job's gloo group: one-thread (spmd.gloo_threads(1), as make bench) or default "
        '(init_process_group("gloo") as a new user writes it: two worker threads)',
    )
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    log_path = os.path.join(tempfile.gettempdir(), f"spmd_plan_check_{os.getpid()}.log")
    res = run(quick=args.quick, log_path=log_path, malloc=args.malloc, group=args.group, models=args.models)
    if "error" in res:
        sys.exit(res["error"])
    print(table(res["records"], res["summary"]))
    print(f"({res['took_s']:.0f} s, malloc {res['malloc']}, group {res['group']}; log: {log_path})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        if res.get("job_profile"):
            with open(args.out + ".profile.json", "w") as f:
                json.dump(res["job_profile"], f)


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
