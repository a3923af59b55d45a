"""One rank of one benchmark model: every variant, timed in interleaved rounds. Run by run.py.

    torchrun --standalone --nproc_per_node=2 benchmarks/bench/worker.py --model gpt --out /tmp/gpt.json

Per variant: build the model (same seed), wrap it, make fused AdamW, and call the step once
(for spmd: trace + partition + passes + one step); then ``warmup`` steps. Timing runs in
rounds: each round gives every live variant, in turn, one untimed step (after the switch
from another variant) and ``steps / rounds`` timed ones, so machine noise falls on all
variants alike. Afterwards, per variant and outside the timed steps: one step under the
profiler (collectives) and one under MemTracker (peak memory); see ``measure.py``. Rank 0
writes the records as JSON to ``--out``.

A variant that raises is recorded as ``error: <line>`` (traceback on stderr) and dropped;
the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.bench import measure, models  # noqa: E402

VARIANTS = (
    "no_comm",
    "no_comm_compiled",
    "no_comm_compiled_tuned",
    "ddp",
    "fsdp2",
    "spmd_replicate",
    "spmd_fully_shard",
    "spmd_fully_shard_noreshard",
    "spmd_replicate_inductor",
    "spmd_fully_shard_inductor",
)
# Not run by default: a variant with one pass switched off, to measure what the pass buys
# (``--variants spmd_replicate,spmd_replicate_no_optoverlap``: the same run, interleaved rounds).
ABLATIONS = {
    "spmd_replicate_no_optoverlap": ("spmd_replicate", "overlap_optimizer"),
    "spmd_fully_shard_no_optoverlap": ("spmd_fully_shard", "overlap_optimizer"),
    "spmd_replicate_no_reuse": ("spmd_replicate", "reuse_dead_buffers"),
    "spmd_fully_shard_no_reuse": ("spmd_fully_shard", "reuse_dead_buffers"),
    "spmd_fully_shard_noreshard_no_reuse": ("spmd_fully_shard_noreshard", "reuse_dead_buffers"),
    # gloo's own reduce-scatter (an all-reduce of the whole input) instead of all-to-all + sum.
    "spmd_fully_shard_rs": ("spmd_fully_shard", "reduce_scatter_as_all_to_all"),
}
# Not run by default either: a variant with one compile option switched on
# (``--variants spmd_fully_shard,spmd_fully_shard_xstep``).
OPTION_VARIANTS = {
    "spmd_fully_shard_xstep": ("spmd_fully_shard", {"cross_step_prefetch": True}),
    # Rematerialization chosen by spmd (issue 21): against fsdp2_ckpt and no_comm_compiled_budget.
    "spmd_fully_shard_remat_selective": ("spmd_fully_shard", {"remat": "selective"}),
    "spmd_fully_shard_remat_half": ("spmd_fully_shard", {"remat": 0.5}),
    "spmd_fully_shard_remat_full": ("spmd_fully_shard", {"remat": "full"}),
    # The loss head in chunks (docs/loss-head.md; "auto" leaves this GPT's 32 MiB logits alone),
    # alone and under remat: on this GPT the unchunked head holds 64 MiB at the peak.
    "spmd_fully_shard_chunked": ("spmd_fully_shard", {"chunked_loss": True}),
    "spmd_fully_shard_remat_selective_chunked": (
        "spmd_fully_shard",
        {"remat": "selective", "chunked_loss": True},
    ),
    "spmd_fully_shard_remat_full_chunked": ("spmd_fully_shard", {"remat": "full", "chunked_loss": True}),
    # The inductor backend with every large float32 CPU matmul on oneDNN (the default before
    # inductor_gemm="auto", issue 25): against spmd_*_inductor in one run.
    "spmd_replicate_inductor_onednn": ("spmd_replicate_inductor", {"inductor_gemm": "onednn"}),
    "spmd_fully_shard_inductor_onednn": ("spmd_fully_shard_inductor", {"inductor_gemm": "onednn"}),
}
# Not run by default: the references for remat. fsdp2 with torch.utils.checkpoint (non-reentrant)
# around every block, what a user writes; torch.compile of one rank's model with
# torch._functorch.config.activation_memory_budget = 0.5 (its min-cut partitioner + knapsack).
REFERENCES = ("fsdp2_ckpt", "no_comm_compiled_budget")


@dataclasses.dataclass
class Variant:
    name: str
    model: nn.Module | None = None
    optim: torch.optim.Optimizer | None = None
    step: Callable[..., Any] | None = None
    first_call_s: float = 0.0
    times: list[float] = dataclasses.field(default_factory=list)
    wchar: int = 0
    wchar_steps: int = 0
    error: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Whether more untimed steps must follow the warm-up: an inductor variant's measured choice
    # between its code and the eager backend's graph (spmd.backend.step_aside) ends before the
    # timed steps.
    settling: Callable[[], bool] | None = None


def last_forward_unit(gm: torch.fx.GraphModule) -> set[str]:
    """Names of the parameters in the forward all-gather waited on last (fully_shard's last unit)."""
    from passes import collectives as C
    from passes.meta import PHASE, STATE_NAME, Phase

    gathers = [c for c in C.collectives(gm.graph) if C.kind_of(c) is C.Kind.ALL_GATHER]
    fwd = [c for c in gathers if c.meta.get(PHASE) is Phase.FORWARD]
    if not fwd:
        return set()
    last = max(fwd, key=lambda c: min(C.waits_of(c)))
    names, todo = set(), list(last.all_input_nodes)
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            names.add(n.meta.get(STATE_NAME))
        todo.extend(n.all_input_nodes)
    return {n for n in names if n}


def make_variant(name: str, spec: models.Spec, world: int) -> Variant:
    torch.manual_seed(0)  # same initial weights for every variant
    model = spec.build()

    def train_step(model, optim, x, y):  # noqa: ANN001, ANN202  (the plain single-device step)
        loss = spec.loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    step: Callable[..., Any] = train_step
    settling: Callable[[], bool] | None = None
    if name == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif name in ("fsdp2", "fsdp2_ckpt"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.utils.checkpoint import checkpoint

        mesh = init_device_mesh("cpu", (world,))
        for block in spec.blocks(model):
            if name == "fsdp2_ckpt":
                fwd = block.forward
                block.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif name.startswith("spmd_"):
        import spmd

        base, off = ABLATIONS.get(name, (name, None))
        base, options = OPTION_VARIANTS.get(base, (base, {}))
        backend = "inductor" if base.endswith("_inductor") else "eager"
        base = base.removesuffix("_inductor")
        mode = {
            "spmd_replicate": spmd.DataParallel("replicate"),
            "spmd_fully_shard": spmd.DataParallel("fully_shard", reshard_after_forward=True),
            "spmd_fully_shard_noreshard": spmd.DataParallel("fully_shard", reshard_after_forward=False),
        }[base]
        disabled = (off,) if off else ()
        step = spmd.compile(parallel_mode=mode, backend=backend, disabled_passes=disabled, **options)(
            train_step
        )
        if backend == "inductor":
            settling = lambda step=step: _measuring(step)  # noqa: E731
    elif name == "no_comm_compiled":
        # torch.compile of the single-device forward (and, through AOTAutograd, backward);
        # the optimizer stays eager. The bar the inductor backend is measured against.
        model = torch.compile(model)  # type: ignore[assignment]
    elif name == "no_comm_compiled_tuned":
        # torch.compile with the settings a CPU user would try: max-autotune (inductor times its
        # C++ GEMM templates against ATen per shape; coordinate-descent tuning of its kernels) and
        # the same per-shape GEMM library choice spmd's inductor backend makes (spmd.backend.gemm_policy,
        # as a post-grad pass). Freezing / weight prepacking do not apply: they treat parameters
        # as constants, and training changes them every step.
        model = torch.compile(  # type: ignore[assignment]
            model,
            options={
                **torch._inductor.list_mode_options("max-autotune-no-cudagraphs"),
                "post_grad_custom_pre_pass": GemmPolicyPass(),
            },
        )
    elif name == "no_comm_compiled_budget":
        from torch._inductor.compile_fx import compile_fx

        def budget_backend(gm, example_inputs):  # noqa: ANN001, ANN202
            # AOTAutograd's partitioner reads the budget while compile_fx compiles; a backend of
            # its own also keeps dynamo from reusing no_comm_compiled's code (its guards check it).
            with torch._functorch.config.patch(activation_memory_budget=0.5):
                return compile_fx(gm, example_inputs)

        model = torch.compile(model, backend=budget_backend)  # type: ignore[assignment]
    elif name != "no_comm":
        raise KeyError(f"unknown variant {name!r}; the variants are {VARIANTS + REFERENCES}")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    return Variant(name, model, optim, step, settling=settling)


class GemmPolicyPass:
    """inductor post-grad pass: each float32 CPU mm/addmm calls the library spmd.backend.gemm_policy
    measured faster for its shape on this machine (decided by this rank alone: no collectives)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from spmd.backend import gemm_policy
        from spmd.backend.inductor_rewrites import _onednn_gemms

        shapes = {n: g for n in graph.nodes if (g := gemm_policy.gemm_of(n)) is not None}
        decisions = gemm_policy.decide_here(shapes.values())
        _onednn_gemms(graph, {n for n, g in shapes.items() if decisions[g].choice == gemm_policy.ONEDNN})

    def uuid(self) -> None:
        return None  # no FX graph cache for these graphs: the decisions depend on the machine


def _aside(step: Any) -> Any:
    """An inductor step's measured choice (spmd.backend.step_aside.StepAside), or None. Read off
    the step's last graph, not report(), which estimates memory each time."""
    last = getattr(step, "_last", None)
    return last.exe.aside if last is not None else None


def _measuring(step: Any) -> bool:
    """Whether an inductor step still alternates its code and the eager backend's graph (its
    measured choice, rank-agreed: the same on every rank)."""
    aside = _aside(step)
    return aside is not None and aside.kept is None


def _pair_batch(step: Any, default: int) -> int:
    """Which batch the next call gets: ``default`` (the next in turn), but while an inductor step
    measures, the same batch for both calls of a timed pair. The bench cycles 4 batches and the
    pairs alternate their order, so in turn each candidate would get the same two batches every
    time, and a batch that costs more would bias the choice (the encoder's batch 0 was ~5% cheaper
    in one run under load); real training has a new batch every step."""
    aside = _aside(step)
    if aside is None or aside.kept is not None or aside.calls < 2:
        return default
    return (aside.calls - 2) // 2


def one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return "error: " + (text[0] if text else type(exc).__name__)[:160]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, choices=models.MODELS)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=20)  # timed steps per variant
    p.add_argument("--rounds", type=int, default=4)  # interleaved rounds the timed steps are split into
    p.add_argument("--warmup", type=int, default=3)  # untimed steps after the first call
    p.add_argument("--quick", action="store_true")  # smaller models
    p.add_argument("--overlap", action="store_true")  # item 4: compare with inductor's scheduler
    p.add_argument("--out", required=True)
    p.add_argument("--gloo-threads", type=int, default=1)  # 0: torch's default (run.py --gloo-threads)
    args = p.parse_args()

    torch.set_num_threads(1)
    from spmd.backend.gloo_threads import gloo_threads

    with gloo_threads(args.gloo_threads) if args.gloo_threads else contextlib.nullcontext():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    # spmd's decisions (inductor's GEMM library per shape, the kept callable, the passes' choices)
    # go to the job's log (run.py writes each worker's stderr there), rank 0's only.
    if rank == 0:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[rank 0] %(name)s %(levelname)s: %(message)s"))
        logging.getLogger("spmd").addHandler(handler)
        logging.getLogger("spmd").setLevel(logging.INFO)
    spec = models.get(args.model, quick=args.quick)
    gen = torch.Generator().manual_seed(1000 + rank)  # rank r's data, the same for every variant
    batches = [spec.batch(gen) for _ in range(4)]
    it = [0]

    def run(v: Variant) -> Any:
        x, y = batches[_pair_batch(v.step, it[0]) % len(batches)]
        it[0] += 1
        return v.step(v.model, v.optim, x, y)  # type: ignore[misc]

    def fail(v: Variant, exc: BaseException, where: str) -> None:
        v.error = one_line(exc)
        print(f"[rank {rank}] {args.model}/{v.name} failed in {where}:", file=sys.stderr)
        traceback.print_exc()
        v.model = v.optim = v.step = None

    def agree(vs: list[Variant]) -> None:
        """Drop, on every rank, the variants that failed on any rank (keeps the ranks in step)."""
        errs: list[dict[str, str | None]] = [{} for _ in range(world)]
        dist.all_gather_object(errs, {v.name: v.error for v in vs})
        for v in vs:
            for e in errs:
                if e.get(v.name) and not v.error:
                    v.error = e[v.name]
                    v.model = v.optim = v.step = None

    variants: list[Variant] = []
    for name in args.variants.split(","):
        v = Variant(name)
        variants.append(v)
        try:
            v = variants[-1] = make_variant(name, spec, world)
            dist.barrier()
            t0 = time.perf_counter()
            run(v)
            v.first_call_s = time.perf_counter() - t0
            for _ in range(args.warmup):
                run(v)
            while v.settling is not None and v.settling():  # rank-agreed: as many steps on every rank
                run(v)
        except Exception as exc:  # noqa: BLE001
            fail(v, exc, "setup")
        agree(variants)
        if rank == 0:
            print(
                f"  {args.model}/{name}: ready ({v.error or f'first call {v.first_call_s:.2f} s'})",
                flush=True,
            )

    per_round = math.ceil(args.steps / args.rounds)
    for r in range(args.rounds):
        for v in variants:
            if v.error:
                continue
            gc.collect()
            dist.barrier()
            try:
                run(v)  # untimed: the first step after switching variants
                w0 = measure.written_bytes()
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    run(v)
                    v.times.append(time.perf_counter() - t0)
                v.wchar += measure.written_bytes() - w0
                v.wchar_steps += per_round
            except Exception as exc:  # noqa: BLE001
                fail(v, exc, f"timing round {r}")
            agree(variants)
        if rank == 0:
            print(f"  {args.model}: round {r + 1}/{args.rounds} done", flush=True)

    for v in variants:
        if v.error:
            continue
        try:
            dist.barrier()
            comms = measure.count_comms(lambda v=v: run(v), 1 if v.name.startswith("no_comm") else world)
            dist.barrier()
            v.extra["peak_mem_bytes"] = measure.peak_memory(lambda v=v: run(v), v.model, v.optim)
            v.extra.update(
                collectives=comms.launches,
                comm_bytes=comms.bytes,
                comm_by_kind=comms.by_kind,
                backend_ops=comms.backend_ops,
            )
            if v.name.startswith("spmd_"):
                rep = v.step.report()  # type: ignore[union-attr]
                v.extra["kept_unit"] = sorted(last_forward_unit(v.step.graphs["final"]))  # type: ignore[union-attr]
                v.extra["report"] = {
                    "collectives": sum(c.count for c in rep.collectives.values()),
                    "comm_bytes": rep.comm_bytes,
                    "by_kind": {k: [c.count, c.bytes] for k, c in rep.collectives.items()},
                    "predicted_peak_bytes": rep.peak_memory_bytes,
                    "compile_s": rep.compile_s,
                    "backend": rep.backend,
                    "lower_s": rep.lower_s,
                    "kept": rep.kept,  # backend="inductor": the callable kept (spmd.backend.step_aside)
                    "measured_ms": rep.measured_ms,
                    "measured_iqr_ms": rep.measured_iqr_ms,
                    "measured_steps": rep.measured_steps,
                }
        except Exception as exc:  # noqa: BLE001
            fail(v, exc, "measurement")
        agree(variants)
        if rank == 0:
            print(f"  {args.model}/{v.name}: measured", flush=True)

    overlap: dict[str, Any] | None = None
    fs = next((v for v in variants if v.name == "spmd_fully_shard" and not v.error), None)
    if args.overlap and fs is not None:
        overlap = run_overlap(fs, rank, world)

    # What the sharding semantics must send (run.py's "min" column): parameter bytes, those
    # outside the FSDP2-wrapped blocks, and those backward reads (gathered again under FULL_SHARD).
    fresh = spec.build()
    nbytes = {n: p.numel() * p.element_size() for n, p in fresh.named_parameters()}
    in_blocks = {id(p) for b in spec.blocks(fresh) for p in b.parameters()}
    root = {n for n, p in fresh.named_parameters() if id(p) not in in_blocks}
    saved = measure.params_saved_for_backward(fresh, lambda m: spec.loss(m(batches[0][0]), batches[0][1]))
    kept = next((set(v.extra.get("kept_unit", ())) for v in variants if v.name == "spmd_fully_shard"), set())
    sizes = {
        # the unit forward needs last, which spmd keeps gathered into backward (passes.last_unit)
        "bwd_last_unit_param_bytes": sum(nbytes[n] for n in saved & kept),
        "param_bytes": sum(nbytes.values()),  # the whole model, unsharded
        "root_param_bytes": sum(nbytes[n] for n in root),  # outside the blocks FSDP2 wraps one by one
        "bwd_param_bytes": sum(nbytes[n] for n in saved),  # saved for backward by autograd
        "bwd_root_param_bytes": sum(nbytes[n] for n in saved & root),
    }
    times: list[dict[str, list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(times, {v.name: v.times for v in variants})
    wire: list[dict[str, float]] = [{} for _ in range(world)]
    dist.all_gather_object(wire, {v.name: v.wchar / max(v.wchar_steps, 1) for v in variants})
    if rank == 0:
        records = []
        for v in variants:
            rec: dict[str, Any] = {"model": args.model, "variant": v.name, "description": spec.description}
            rec.update(sizes)
            if v.error:
                rec.update(error=v.error, step_ms=None, peak_mem_bytes=None, comm_bytes=None)
                rec.update(collectives=None, compile_s=None)
            else:
                # A step takes as long as its slowest rank; the median over steps resists noise.
                per_step = [max(t[v.name][i] for t in times) for i in range(len(v.times))]
                step_s = statistics.median(per_step)
                rec["step_ms"] = step_s * 1e3
                rec["step_ms_min"] = min(per_step) * 1e3
                q = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else [step_s] * 3
                rec["step_ms_p25"], rec["step_ms_p75"] = q[0] * 1e3, q[2] * 1e3
                rec["timed_steps"] = len(per_step)
                rec["wire_bytes"] = int(max(w[v.name] for w in wire))
                rec.update(v.extra)
                compiled = v.name.startswith(("spmd_", "no_comm_compiled"))
                rec["compile_s"] = max(v.first_call_s - step_s, 0.0) if compiled else 0.0
                if v.name == "spmd_fully_shard" and overlap is not None:
                    rec["overlap"] = overlap
            records.append(rec)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def run_overlap(v: Variant, rank: int, world: int) -> dict[str, Any] | None:
    """Item 4 (see overlap.py): calibrate on all ranks, analyse on rank 0."""
    try:
        from benchmarks.bench import overlap
    except Exception as exc:  # noqa: BLE001
        return {"error": f"unavailable: {one_line(exc)}"}
    try:
        comm = overlap.calibrate_comm(dist.group.WORLD.group_name, world)  # type: ignore[union-attr]
    except Exception as exc:  # noqa: BLE001
        return {"error": f"unavailable: calibration {one_line(exc)}"}
    result: dict[str, Any] | None = None
    if rank == 0:
        try:
            flops, bw, overhead = overlap.calibrate_compute()
            cost = overlap.CostModel(flops_per_s=flops, bytes_per_s=bw, op_overhead_s=overhead, comm=comm)
            result = overlap.compare(dict(v.step.graphs), cost)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            result = {"error": f"unavailable: {one_line(exc)}"}
    dist.barrier()
    return result


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
