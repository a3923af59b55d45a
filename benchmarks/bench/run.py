"""spmd against DDP and FSDP2: step time, peak memory, communication and compile time, in one run.

    python benchmarks/bench/run.py            # = make bench: every model, every variant (~20 min on 2 cores)
    python benchmarks/bench/run.py --quick    # = make bench-quick: small models, few steps (smoke)
    python benchmarks/bench/run.py --models gpt --variants no_comm,fsdp2,spmd_fully_shard

Each model runs as one ``torchrun --standalone --nproc_per_node=2`` job (gloo, OMP_NUM_THREADS=1 and
one torch thread per rank) that builds every variant with the same initial weights and per-rank
data and times them in interleaved rounds (``worker.py``; how each number is measured:
``measure.py``). Variants:

    no_comm                     each rank trains alone, eager: the lower bound
    no_comm_compiled            each rank alone, torch.compile(model), eager fused AdamW
    no_comm_compiled_tuned      the same with max-autotune and spmd's per-shape GEMM library choice
    ddp                         DistributedDataParallel, defaults
    fsdp2                       fully_shard on every block, then the root, defaults
    spmd_replicate              spmd.DataParallel("replicate")
    spmd_fully_shard            spmd.DataParallel("fully_shard", reshard_after_forward=True)
    spmd_fully_shard_noreshard  spmd.DataParallel("fully_shard", reshard_after_forward=False)
    spmd_replicate_inductor     spmd_replicate with backend="inductor"
    spmd_fully_shard_inductor   spmd_fully_shard with backend="inductor"

The inductor variants run with the defaults, so their first steps time inductor's code against
the eager backend's graph of the same step and keep the faster (``inductor_fallback="measure"``,
``spmd.backend.step_aside``); those steps are untimed warm-up here (as many as the measurement
takes), and the table's ``kept`` column shows the callable kept, with the eager candidate's median
step over inductor's and the timed pairs it took.

``--malloc keep`` (the default) runs every job (each row, peers and spmd alike, and the plan
check) with glibc's allocator told to keep freed memory instead of returning it to the kernel
(:data:`MALLOC_KEEP`); ``--malloc system`` with glibc's defaults (those variables unset). On
this machine fresh mmap'd pages cost 10-17% of a step and most of the noise
(benchmarks/results/performance.md).

Ablations (only when named in --variants): ``spmd_replicate_no_optoverlap`` and
``spmd_fully_shard_no_optoverlap`` run with the ``overlap_optimizer`` pass disabled;
``spmd_replicate_no_reuse``, ``spmd_fully_shard_no_reuse`` and ``spmd_fully_shard_noreshard_no_reuse``
with ``reuse_dead_buffers`` disabled (peak memory before/after in one run);
``spmd_fully_shard_xstep`` runs with ``cross_step_prefetch=True``; ``spmd_fully_shard_rs`` with
``reduce_scatter_as_all_to_all`` disabled (gloo's reduce-scatter instead of all-to-all + local sum).
Rematerialization (issue 21): ``spmd_fully_shard_remat_selective``, ``spmd_fully_shard_remat_half``
(``remat=0.5``) and ``spmd_fully_shard_remat_full``, against ``fsdp2_ckpt`` (FSDP2 with
``torch.utils.checkpoint`` around every block) and ``no_comm_compiled_budget`` (one rank's
``torch.compile`` with ``activation_memory_budget=0.5``); ``spmd_fully_shard_chunked``,
``spmd_fully_shard_remat_selective_chunked`` and ``spmd_fully_shard_remat_full_chunked`` add
``chunked_loss=True`` (the loss head in chunks of tokens).

Then ``plan_check.py``: the cost model of ``spmd.plan`` predicted vs measured over 10 spmd
configurations (``--no-plan-check`` skips it).

Prints one table per model with ratios to fsdp2 and to no_comm, the issue's targets, and (for
spmd_fully_shard) the predicted comparison with inductor's overlap scheduler (``overlap.py``);
writes every record to ``bench.json``. A variant that fails is shown as ``error: <line>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
from benchmarks.bench.malloc_keep import MALLOC_KEEP  # noqa: E402 (one dict, shared with plan_check.py)
from benchmarks.bench.worker import ABLATIONS, OPTION_VARIANTS, REFERENCES, VARIANTS  # noqa: E402

MODELS = ("overhead", "gpt", "encoder")
# --malloc keep: glibc serves no allocation by mmap (each fresh mmap'd page faults in as it is
# first written, ~1 ms per MiB here), never trims the heap, and grows it by 256 MiB at a time, so
# a step's large buffers reuse pages that earlier steps faulted in. Measured (2026-11-25, GPT,
# --steps 12): no_comm 598 -> 497 ms, spmd fully_shard 628 -> 571, IQRs 6-16% -> 3-6%. torch's
# CPU performance tuning guide recommends a caching allocator (jemalloc, tcmalloc) for the same
# reason: https://pytorch.org/tutorials/recipes/recipes/tuning_guide.html (MALLOC_KEEP)
INDUCTOR = ("spmd_replicate_inductor", "spmd_fully_shard_inductor")
NPROC = 2
MiB = 1024 * 1024

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--quick", action="store_true", help="small models, few steps: a smoke run")
p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 24, quick 4)")
p.add_argument("--out", default=os.path.join(ROOT, "bench.json"), help="where to write the records")
p.add_argument("--timeout", type=int, default=None, help="seconds per torchrun job (default 1500, quick 600)")
p.add_argument("--no-plan-check", action="store_true", help="skip the cost-model check (plan_check.py)")
p.add_argument(
    "--gloo-threads",
    type=int,
    default=1,
    help="worker threads of each job's gloo group, every variant alike (default 1, spmd.gloo_threads(1): "
    "torch's gloo can corrupt the heap running two collectives at once, benchmarks/results/crashes.md; "
    "0: torch's default of two, beside which spmd makes one-thread groups of its own)",
)
p.add_argument(
    "--hunt-minutes",
    type=float,
    default=None,
    help="minutes of benchmarks/diagnostics/crash_hunt.sh MODE=steps at the end (glibc's heap checks on, "
    "two copies of each config compared bit for bit; default 6, quick 1; 0 skips)",
)
p.add_argument(
    "--malloc",
    choices=("keep", "system"),
    default="keep",
    help="keep: every job runs with glibc keeping freed memory (MALLOC_KEEP: less noise, faster for "
    "every variant); system: glibc's defaults",
)
args = p.parse_args()
steps = args.steps or (4 if args.quick else 24)  # the median is over at least 20
rounds = 2 if args.quick else 4  # interleaved rounds the timed steps are split into
warmup = 1 if args.quick else 3  # untimed steps after each variant's first call
timeout = args.timeout or (600 if args.quick else 1500)  # inductor variants compile for minutes


def torchrun(
    model: str, variants: list[str], log_path: str, limit: int = timeout
) -> tuple[list[dict[str, Any]] | None, str]:
    """Run one worker job; return (its records or None, the tail of its stderr)."""
    fd, out = tempfile.mkstemp(suffix=".json", prefix=f"bench_{model}_")
    os.close(fd)
    os.unlink(out)
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        f"--nproc_per_node={NPROC}",
        os.path.join(HERE, "worker.py"),
        f"--model={model}",
        f"--variants={','.join(variants)}",
        f"--steps={steps}",
        f"--rounds={rounds}",
        f"--warmup={warmup}",
        f"--out={out}",
        f"--gloo-threads={args.gloo_threads}",
    ]
    if args.quick:
        cmd.append("--quick")
    if "spmd_fully_shard" in variants:
        cmd.append("--overlap")
    # A rank that dies of a signal prints its Python stacks into the log (issue 23).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=log)
        try:
            job.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            stop(job)
            log.write(f"\nbench: timed out after {limit} s\n")
    with open(log_path) as f:
        tail = f.read()[-20000:]
    if not os.path.exists(out):
        return None, tail
    with open(out) as f:
        records = json.load(f)
    os.unlink(out)
    return records, tail


def _descendants(pid: int) -> list[int]:
    """The processes started by ``pid``, transitively (read from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stop(job: subprocess.Popen) -> None:
    """End a timed-out torchrun and its ranks: SIGTERM (torchrun stops its workers), then SIGKILL.

    Ranks left behind by a killed torchrun hang on its store forever, burning a core.
    """
    ranks = _descendants(job.pid)
    job.terminate()
    try:
        job.wait(timeout=20)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def last_error(stderr: str) -> str:
    """The last exception line of a log, without torchrun's ``[rankN]:`` prefix."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in stderr.splitlines()]
    errs = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt|Failure)\b", ln)]
    errs += [ln for ln in lines if "timed out" in ln]
    return "error: " + (errs[-1] if errs else "job failed (see log)")[:160]


def run_model(model: str, variants: list[str], log_path: str) -> list[dict[str, Any]]:
    print(f"== {model}: {', '.join(variants)}", flush=True)
    records, tail = torchrun(model, variants, log_path)
    if records is not None:
        return records
    # The job died (a crash that took a rank down, or a hang): isolate each variant in its own job.
    print(f"   the {model} job failed ({last_error(tail)}); running each variant alone", flush=True)
    out = []
    for v in variants:
        recs, tail = torchrun(model, [v], log_path, limit=max(timeout // 2, 60))
        if recs:
            out.extend(recs)
        else:
            out.append({"model": model, "variant": v, "error": last_error(tail), "step_ms": None})
            out[-1].update(peak_mem_bytes=None, comm_bytes=None, collectives=None, compile_s=None)
    return out


# ----------------------------------------------------------------------------- report


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _spread(r: dict[str, Any]) -> str:
    """Interquartile range of the step times, relative to the median: the noise of that number."""
    if r.get("step_ms_p75") is None or not r.get("step_ms"):
        return "-"
    return f"{100 * (r['step_ms_p75'] - r['step_ms_p25']) / r['step_ms']:.0f}%"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def min_comm_bytes(rec: dict[str, Any]) -> int | None:
    """The least a variant's semantics must communicate per rank per step (larger-side bytes).

    P = parameter bytes, B = bytes of the parameters autograd saves for backward. replicate:
    all-reduce every gradient (P). FULL_SHARD: gather every parameter for forward, gather
    again those backward reads, reduce-scatter every gradient (2P + B). SHARD_GRAD_OP: 2P.
    FSDP2 as configured here keeps the root's parameters from forward to backward:
    2P + B - (B of the root); spmd keeps the unit forward needs last (passes.last_unit):
    2P + B - (B of that unit).
    """
    P, B = rec.get("param_bytes"), rec.get("bwd_param_bytes")
    if P is None or B is None:
        return None
    kept = rec.get("bwd_last_unit_param_bytes", 0)
    return {
        "no_comm": 0,
        "no_comm_compiled": 0,
        "no_comm_compiled_tuned": 0,
        "ddp": P,
        "spmd_replicate": P,
        "spmd_replicate_inductor": P,
        "fsdp2": 2 * P + B - rec.get("bwd_root_param_bytes", 0),
        "spmd_fully_shard": 2 * P + B - kept,
        "spmd_fully_shard_rs": 2 * P + B - kept,
        "spmd_fully_shard_inductor": 2 * P + B - kept,
        "spmd_fully_shard_noreshard": 2 * P,
    }.get(rec["variant"])


def table(records: list[dict[str, Any]]) -> str:
    by = {r["variant"]: r for r in records}
    fsdp2, base = by.get("fsdp2", {}).get("step_ms"), by.get("no_comm", {}).get("step_ms")
    head = (
        "variant",
        "step ms",
        "IQR",
        "x fsdp2",
        "x no_comm",
        "peak MiB",
        "pred MiB",
        "comm MiB",
        "min MiB",
        "wire MiB",
        "colls",
        "compile s",
        "kept",
    )
    rows = []
    for r in records:
        if r.get("error"):
            rows.append((r["variant"], r["error"][:120]))
            continue
        rows.append(
            (
                r["variant"],
                f"{r['step_ms']:.1f}",
                _spread(r),
                _ratio(r["step_ms"], fsdp2),
                _ratio(r["step_ms"], base),
                _mib(r.get("peak_mem_bytes")),
                _mib(r.get("report", {}).get("predicted_peak_bytes")),
                _mib(r.get("comm_bytes")),
                _mib(min_comm_bytes(r)),
                _mib(r.get("wire_bytes")),
                str(r.get("collectives")),
                _compile_cell(r),
                _kept_cell(r),
            )
        )
    return markdown(head, rows)


def _kept_cell(r: dict[str, Any]) -> str:
    """backend="inductor": the callable kept, the eager candidate's median step over inductor's,
    and the timed pairs the choice took."""
    rep = r.get("report", {})
    kept, ms = rep.get("kept"), rep.get("measured_ms") or {}
    if not kept:
        return "-"
    pairs = (rep.get("measured_steps") or {}).get("eager")
    return f"{kept} ({ms['eager'] / ms['inductor']:.2f}, {pairs} pairs)" if ms.get("inductor") else kept


def _compile_cell(r: dict[str, Any]) -> str:
    lower = r.get("report", {}).get("lower_s")
    return f"{r['compile_s']:.1f}" + (f" (inductor {lower:.1f})" if lower else "")


def markdown(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    full = [r for r in rows if len(r) == len(head)]
    w = [max([len(h)] + [len(r[i]) for r in full]) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |"]
    out.append(
        "|" + "|".join("-" * (x + 2) if i == 0 else "-" * (x + 1) + ":" for i, x in enumerate(w)) + "|"
    )
    for r in rows:
        if len(r) == len(head):
            cells = [r[0].ljust(w[0])] + [c.rjust(w[i]) for i, c in enumerate(r) if i > 0]
            out.append("| " + " | ".join(cells) + " |")
        else:  # an error: the variant, then the message across the row
            out.append(f"| {r[0].ljust(w[0])} | {r[1]} |" + " |" * (len(head) - 2))
    return "\n".join(out)


def overlap_table(rec: dict[str, Any]) -> str:
    ov = rec.get("overlap")
    if not ov:
        return ""
    if "error" in ov:
        return f"overlap vs inductor: {ov['error']}"
    head = ("graph", "colls", "comm MiB", "compute ms", "comm ms", "exposed ms", "step ms", "peak MiB")
    rows = []
    for key, label in (
        ("spmd_partitioned", "spmd partitioned (no passes)"),
        ("spmd_final", "spmd final"),
        ("inductor", "inductor schedule_overlap_bucketing(partitioned)"),
    ):
        pr = ov.get(key, {})
        if "error" in pr:
            rows.append((label, pr["error"]))
            continue
        rows.append(
            (
                label,
                str(pr["collectives"]),
                _mib(pr["comm_bytes"]),
                f"{pr['compute_ms']:.1f}",
                f"{pr['comm_ms']:.1f}",
                f"{pr['exposed_comm_ms']:.1f}",
                f"{pr['step_ms']:.1f}",
                _mib(pr["peak_mem_bytes"]),
            )
        )
    text = "predicted by the cost model of benchmarks/bench/overlap.py (spmd_fully_shard):\n"
    text += markdown(head, rows)
    for failure in ov.get("inductor", {}).get("failed_first", []):
        text += f"\n(inductor first failed with {failure})"
    return text


def targets(model: str, records: list[dict[str, Any]]) -> list[str]:
    """The targets of issues 13, 14 and 25 for this model, each with the measured value."""
    by = {r["variant"]: r for r in records if not r.get("error")}
    step = lambda v: by.get(v, {}).get("step_ms")  # noqa: E731
    checks: list[tuple[str, float | None, float]] = []
    if model == "overhead":
        checks += [("spmd_fully_shard / fsdp2 step", _div(step("spmd_fully_shard"), step("fsdp2")), 0.2)]
        checks += [("spmd_fully_shard / no_comm step", _div(step("spmd_fully_shard"), step("no_comm")), 1.3)]
        checks += [("spmd_replicate / no_comm step", _div(step("spmd_replicate"), step("no_comm")), 1.2)]
        checks += [
            (
                "spmd_fully_shard_inductor / no_comm step",
                _div(step("spmd_fully_shard_inductor"), step("no_comm")),
                1.0,
            )
        ]
    if model == "gpt":
        checks += [("spmd_fully_shard / no_comm step", _div(step("spmd_fully_shard"), step("no_comm")), 1.03)]
        checks += [("spmd_replicate / no_comm step", _div(step("spmd_replicate"), step("no_comm")), 1.02)]
        for v in ("spmd_fully_shard_inductor", "spmd_replicate_inductor"):
            checks += [(f"{v} / no_comm step", _div(step(v), step("no_comm")), 0.95)]
    if model == "encoder":
        for v in ("spmd_fully_shard_inductor", "spmd_replicate_inductor"):
            checks += [(f"{v} / no_comm step", _div(step(v), step("no_comm")), 0.95)]
            checks += [
                (f"{v} / no_comm_compiled_tuned step", _div(step(v), step("no_comm_compiled_tuned")), 1.0)
            ]
    # issue 25: the inductor backend is never slower than the eager backend on the same graph.
    for v in INDUCTOR:
        checks += [
            (
                f"{v} / {v.removesuffix('_inductor')} step",
                _div(step(v), step(v.removesuffix("_inductor"))),
                1.0,
            )
        ]
    mem = lambda v: by.get(v, {}).get("peak_mem_bytes")  # noqa: E731
    checks += [("spmd_fully_shard / fsdp2 peak memory", _div(mem("spmd_fully_shard"), mem("fsdp2")), 0.9)]
    lines = []
    for name, val, bound in checks:
        verdict = "n/a" if val is None else ("met" if val <= bound else "NOT met")
        lines.append(
            f"  {name:<42} {'-' if val is None else f'{val:.2f}':>6}  (target <= {bound})  {verdict}"
        )
    for v in ("spmd_replicate", "spmd_fully_shard", "spmd_fully_shard_noreshard", *INDUCTOR):
        if v in by:
            got, least = by[v].get("comm_bytes"), min_comm_bytes(by[v])
            verdict = "met" if got == least else "NOT met"
            lines.append(
                f"  {v + ' comm bytes = minimum':<42} {_mib(got):>6}  (minimum {_mib(least)} MiB)  {verdict}"
            )
    return lines


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def crash_hunt(minutes: float) -> dict[str, Any] | None:
    """A standing hunt for the rare native crash of a gloo rank (benchmarks/results/crashes.md): a few
    minutes of ``benchmarks/diagnostics/crash_hunt.sh`` in its ``steps`` mode -- every config (the passes that
    free, reuse or write buffers around collectives, and tensor parallelism) trained as two copies
    compared bit for bit, glibc's heap checks on, ``MALLOC_PERTURB_`` varied per run. No CPU load is
    added and core dumps stay as the machine has them (``STRESS=0 CORES=0``): ``make bench`` runs it
    on every machine it measures, so a crash is counted wherever the bench runs."""
    if minutes <= 0:
        return None
    out_dir = tempfile.mkdtemp(prefix="spmd_crash_hunt_")
    env = {**os.environ, "MODE": "steps", "STEPS": "40", "STRESS": "0", "CORES": "0", "OUT_DIR": out_dir}
    for k in MALLOC_KEEP:  # the hunt wants glibc to reuse freed memory, as it does by default
        env.pop(k, None)
    print(f"== crash hunt: {minutes:g} min of benchmarks/diagnostics/crash_hunt.sh MODE=steps", flush=True)
    # MINUTES is whole minutes; a run that starts before the end finishes (a few minutes at most).
    hunt = os.path.join(ROOT, "benchmarks", "diagnostics", "crash_hunt.sh")
    cmd = ["bash", hunt, str(max(1, round(minutes)))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    total = next((ln for ln in done.stdout.splitlines() if ln.startswith("TOTAL ")), None)
    if total is None:
        return {
            "minutes": minutes,
            "runs": 0,
            "failed": 1,
            "crashes": 0,
            "out_dir": out_dir,
            "error": last_error(done.stderr or done.stdout),
        }
    fields = dict(kv.split("=", 1) for kv in total.split()[1:])
    return {
        "minutes": minutes,
        "out_dir": out_dir,
        **{k: int(fields[k]) for k in ("runs", "failed", "crashes")},
    }


def main() -> None:
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    known = (*VARIANTS, *ABLATIONS, *OPTION_VARIANTS, *REFERENCES)
    bad = [m for m in models if m not in MODELS] + [v for v in variants if v not in known]
    if bad:
        sys.exit(f"unknown model/variant {bad}; models: {', '.join(MODELS)}; variants: {', '.join(VARIANTS)}")
    log_path = os.path.join(tempfile.gettempdir(), f"spmd_bench_{os.getpid()}.log")
    # Every job inherits it (torchrun's ranks, plan_check's jobs): no variant runs on other terms.
    for k, val in MALLOC_KEEP.items():
        if args.malloc == "keep":
            os.environ[k] = val
        else:
            os.environ.pop(k, None)
    started = datetime.datetime.now()
    run_info = {
        "date": started.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, {platform.system()}",
        "ranks": NPROC,
        "backend": "gloo",
        "threads_per_rank": 1,
        "steps": steps,
        "quick": args.quick,
        "malloc": args.malloc,
        "malloc_env": {k: os.environ[k] for k in MALLOC_KEEP if k in os.environ},
    }
    try:
        import torch

        run_info["torch"] = torch.__version__
    except ImportError:
        pass
    all_records: list[dict[str, Any]] = []
    for model in models:
        recs = run_model(model, variants, log_path)
        for r in recs:
            r["run"] = run_info
        all_records.extend(recs)
    check: dict[str, Any] | None = None
    if not args.no_plan_check:
        from benchmarks.plan_validation import plan_check

        print("== plan check: the cost model of spmd.plan, predicted vs measured", flush=True)
        check = plan_check.run(quick=args.quick, log_path=log_path, timeout=timeout, malloc=args.malloc)
        rec = {"model": "plan_check", "variant": "predicted_vs_measured", **check, "run": run_info}
        all_records.append(rec)
    hunt = crash_hunt(args.hunt_minutes if args.hunt_minutes is not None else (1 if args.quick else 6))
    if hunt is not None:
        all_records.append({"model": "crash_hunt", "variant": "steps", **hunt, "run": run_info})
    with open(args.out, "w") as f:
        json.dump(all_records, f, indent=1)

    took = (datetime.datetime.now() - started).total_seconds()
    print()
    print(
        f"spmd bench, {run_info['date']}: {NPROC} ranks (gloo, 1 thread each) on {run_info['machine']}, "
        f"torch {run_info.get('torch', '?')}; median of {steps} timed steps{' (quick)' if args.quick else ''}"
    )
    env = " ".join(f"{k}={v}" for k, v in run_info["malloc_env"].items())
    print(f"malloc: {args.malloc}" + (f" ({env})" if env else " (glibc's defaults)"))
    for model in models:
        recs = [r for r in all_records if r["model"] == model]
        desc = next((r["description"] for r in recs if r.get("description")), model)
        print(f"\n### {model}: {desc}\n")
        print(table(recs))
        print("\ntargets:")
        print("\n".join(targets(model, recs)))
        fs = next((r for r in recs if r["variant"] == "spmd_fully_shard" and r.get("overlap")), None)
        if fs:
            print()
            print(overlap_table(fs))
    print(
        "\nIQR: interquartile range of the step times over the median; "
        "peak MiB: MemTracker over one step (DDP's C++ gradient buckets and inductor's buffers not seen: "
        "benchmarks/profiles/backend_memory.py measures the inductor backend); "
        "pred MiB: spmd report(); "
        "comm MiB: per rank per step, larger side of each collective (profiler); min MiB: least the "
        "variant's semantics need; wire MiB: bytes written to sockets (/proc/self/io); colls: collective "
        "launches per step; compile s: first call minus a step (of it, inductor's lowering); kept: the "
        "inductor rows' choice between inductor's code and the eager backend's graph of the same step "
        "(eager / inductor median step over the first steps, and the timed pairs; spmd.backend.step_aside)."
    )
    if check is not None:
        from benchmarks.plan_validation import plan_check

        print("\n### plan check: spmd.plan's cost model (cpu-local, calibrated in this run) vs measured\n")
        if "error" in check:
            print(f"error: {check['error']}")
        else:
            print(plan_check.table(check["records"], check["summary"]))
    if hunt is not None:
        print(
            f"\n### crash hunt (issue 23): {hunt['runs']} runs of "
            f"benchmarks/diagnostics/crash_hunt_steps.py in "
            f"{hunt['minutes']:g} min, glibc heap checks on: {hunt['crashes']} native crashes or mismatches, "
            f"{hunt['failed']} failed runs"
            + (f"; logs in {hunt['out_dir']}" if hunt["crashes"] or hunt["failed"] else "")
        )
    errors = [r for r in all_records if r.get("error")]
    print(f"\nwrote {args.out} ({len(all_records)} records) in {took:.0f} s; worker log: {log_path}")
    if errors:
        print(f"{len(errors)} variant(s) failed; tracebacks in {log_path}")


if __name__ == "__main__":
    main()
