"""Where spmd's first call spends its time, per phase: the stage copies as they are now (a bare
graph copy per stage, built into a GraphModule on lookup) against the full GraphModule copy per
stage spmd took before, side by side in one process, alternating.

    OMP_NUM_THREADS=1 python benchmarks/profiles/compile_time.py                 # GPT-2-small-shaped, world 1
    OMP_NUM_THREADS=1 python benchmarks/profiles/compile_time.py --world 2      # fully_shard, fake group of 2
    OMP_NUM_THREADS=1 python benchmarks/profiles/compile_time.py --model bench --world 2   # the bench GPT
    OMP_NUM_THREADS=1 python benchmarks/profiles/compile_time.py --variants cheap --backend inductor
                                    # + inductor's phases (fresh TORCHINDUCTOR_CACHE_DIR: cold)

Phases (seconds, first call): state (optimizer state created for tracing), trace (make_fx),
partition, passes (the pass pipeline, without recording), stages (recording the stages),
lower (backend compile), first run (the first real step, with its layout check). With the fake
process group (--world 2) the collectives return garbage: shapes and times are right, values not.
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from collections import defaultdict
from unittest import mock

import torch
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import spmd  # noqa: E402
import spmd.api  # noqa: E402
import spmd.backend.runtime  # noqa: E402
import spmd.frontend.optim  # noqa: E402
import spmd.frontend.tracing  # noqa: E402
import spmd.pipeline  # noqa: E402
from passes.stages import Stages  # noqa: E402
from spmd import models as spmd_models  # noqa: E402
from tests.models import TinyGPT  # noqa: E402

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--model", default="gpt2s", choices=["gpt2s", "bench"])  # GPT-2 small shape / bench GPT
p.add_argument("--world", type=int, default=1)  # >1: fully_shard under the fake process group
p.add_argument("--backend", default="eager")  # spmd.compile(backend=...)
p.add_argument("--variants", default="full,cheap")  # stage copies: full (before), cheap (now)
p.add_argument("--reps", type=int, default=2)  # rounds of the variants
p.add_argument("--inductor-config", default="{}")  # JSON: spmd.compile(inductor_config=...)
args = p.parse_args()

times: dict[str, float] = defaultdict(float)
_depth: list[str] = []  # the phases being timed, outermost first


def timed(phase, fn):
    """``fn`` adding its wall time to ``times[phase]``."""

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        _depth.append(phase)
        try:
            return fn(*a, **k)
        finally:
            _depth.pop()
            dt = time.perf_counter() - t0
            times[phase] += dt
            if phase == "stages" and "passes+stages" in _depth:
                times["stages in passes"] += dt

    return wrapper


def full_record(self, name, gm):  # what spmd did before: a whole GraphModule copy per stage
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {})).meta = dict(gm.graph.output_node().meta)
    self[name] = fx.GraphModule(gm, graph)


def build():
    torch.manual_seed(0)
    if args.model == "gpt2s":
        model = TinyGPT(vocab=50257, d_model=768, n_layers=12, n_heads=12, seq=256)
        idx = torch.randint(0, 50257, (1, 257))
        return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()), spmd_models.train_step
    from benchmarks.bench.models import get

    spec = get("gpt")

    def train_step(model, optim, x, y):
        loss = spec.loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return spec.build(), spec.batch(torch.Generator().manual_seed(0)), train_step


def first_call(variant: str) -> dict[str, float]:
    model, batch, fn = build()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    mode = spmd.DataParallel("fully_shard") if args.world > 1 else None
    extra = {"inductor_config": json.loads(args.inductor_config)} if args.backend == "inductor" else {}
    step = spmd.compile(parallel_mode=mode, backend=args.backend, **extra)(fn)
    times.clear()
    mode_cls = type(step.parallel_mode)
    record = full_record if variant == "full" else Stages.record
    patches = [
        mock.patch.object(Stages, "record", timed("stages", record)),
        mock.patch.object(
            spmd.frontend.optim, "ensure_state", timed("state", spmd.frontend.optim.ensure_state)
        ),
        mock.patch.object(
            spmd.frontend.tracing, "trace_step", timed("trace", spmd.frontend.tracing.trace_step)
        ),
        mock.patch.object(type(step.parallel_mode), "partition", timed("partition", mode_cls.partition)),
        mock.patch.object(spmd.pipeline.Pipeline, "run", timed("passes+stages", spmd.pipeline.Pipeline.run)),
        mock.patch.object(spmd.api, "compile_graph", timed("lower", spmd.api.compile_graph)),
        mock.patch.object(
            spmd.backend.runtime.Executable, "run", timed("first run", spmd.backend.runtime.Executable.run)
        ),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        t0 = time.perf_counter()
        step(model, optim, *batch)
        total = time.perf_counter() - t0
    out = dict(times)
    out["passes"] = out.pop("passes+stages") - out.pop("stages in passes", 0.0)
    out["first call"] = total
    out["nodes"] = len(step.graphs["final"].graph.nodes)
    del model, optim, step
    gc.collect()
    return out


PHASES = ["state", "trace", "partition", "passes", "stages", "lower", "first run", "first call"]
if __name__ == "__main__":
    ctx = contextlib.nullcontext()
    if args.world > 1:
        from tests.unit.fake_pg import fake_process_group

        ctx = fake_process_group(args.world)
    with ctx:
        variants = args.variants.split(",")
        results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(args.reps):
            for v in variants:
                results[v].append(first_call(v))
    print(
        f"model {args.model}, world {args.world}, backend {args.backend}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); seconds, min over {args.reps} rounds"
    )
    print(f"{'phase':<12}" + "".join(f"{v:>12}" for v in variants))
    for ph in PHASES:
        row = [min(r.get(ph, 0.0) for r in results[v]) for v in variants]
        print(f"{ph:<12}" + "".join(f"{x:12.2f}" for x in row))
    print(f"{'final nodes':<12}" + "".join(f"{int(results[v][0]['nodes']):>12}" for v in variants))
    if args.backend != "eager":  # inductor's own phases (its dynamo_timed metrics), summed over rounds
        from torch._dynamo.utils import compile_times

        print(compile_times(repr="str", aggregate=True))
