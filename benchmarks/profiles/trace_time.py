"""How long spmd takes to trace a GPT-2-small-shaped train step, and how big the graph is.

    OMP_NUM_THREADS=1 python benchmarks/profiles/trace_time.py            # GPT-2 small: 12 x 768, vocab 50257
    OMP_NUM_THREADS=1 python benchmarks/profiles/trace_time.py --layers 2 # a quicker look
    OMP_NUM_THREADS=1 python benchmarks/profiles/trace_time.py --backend inductor  # + inductor's lowering
                                  # (run twice with one TORCHINDUCTOR_CACHE_DIR: cold, then warm)

Prints the wall time of the first call (trace + partition + passes + one real step), the trace time
spmd logs for make_fx alone, the node count of graphs['traced'], and the time of a cached step.
World size 1 (no process group).

    OMP_NUM_THREADS=1 python benchmarks/profiles/trace_time.py --simulate 2,1024   # spmd.simulate instead

With ``--simulate``: for each world size, in one process, the time of ``spmd.simulate`` of the
model's fully_shard step (trace + partition + passes, under the fake process group, never run)
and the final graph's node count.
"""

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import spmd  # noqa: E402
from spmd import models as spmd_models  # noqa: E402
from tests.models import TinyGPT  # noqa: E402  (token+pos embedding, pre-LN blocks, SDPA, tied head)

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=12)  # GPT-2 small: 12
p.add_argument("--d-model", type=int, default=768)  # 768
p.add_argument("--heads", type=int, default=12)  # 12
p.add_argument("--vocab", type=int, default=50257)  # GPT-2 BPE vocabulary
p.add_argument("--seq", type=int, default=256)  # tokens per sequence
p.add_argument("--batch", type=int, default=1)  # sequences per step
p.add_argument("--backend", default="eager")  # spmd.compile(backend=...): eager or inductor
p.add_argument("--simulate", default="")  # comma-separated world sizes: time spmd.simulate instead
p.add_argument("--style", default="fully_shard")  # --simulate: the DataParallel style
args = p.parse_args()


def simulate(world_sizes: list[int]) -> None:
    """spmd.simulate of GPT-2 small (spmd.models, built fake) at each world size, side by side."""
    from spmd import models

    for w in world_sizes:
        step = spmd.compile(parallel_mode=spmd.DataParallel(args.style))(models.train_step)
        model, optim, idx, targets = models.build("gpt2-small", batch=args.batch, seq=args.seq, fake=True)
        t0 = time.perf_counter()
        report = spmd.simulate(step, model, optim, idx, targets, world_size=w)
        took = time.perf_counter() - t0
        print(f"simulate W={w:<5} {took:6.2f} s  final graph {report.num_nodes} nodes")


if args.simulate:
    simulate([int(w) for w in args.simulate.split(",")])
    sys.exit(0)


class TraceTime(logging.Handler):
    """Picks the make_fx time out of spmd's "traced %s in %.2f s (%d nodes)" log record."""

    seconds: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("spmd: traced"):
            self.seconds = float(record.args[1])


handler = TraceTime(level=logging.INFO)
log = logging.getLogger("spmd")
log.setLevel(logging.INFO)
log.addHandler(handler)

torch.manual_seed(0)
model = TinyGPT(
    vocab=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq=args.seq
)
optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
n_params = sum(p.numel() for p in model.parameters())


train_step = spmd.compile(backend=args.backend)(
    spmd_models.train_step
)  # next-token loss, backward, optimizer step


def batch():
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


t0 = time.perf_counter()
train_step(model, optim, *batch())
first = time.perf_counter() - t0
t0 = time.perf_counter()
train_step(model, optim, *batch())
cached = time.perf_counter() - t0

gm = train_step.graphs["traced"]
print(
    f"model          {args.layers} layers x d_model {args.d_model}, vocab {args.vocab}, seq {args.seq}, "
    f"batch {args.batch}: {n_params / 1e6:.1f} M parameters (tied head)"
)
print(f"torch          {torch.__version__}, {torch.get_num_threads()} thread(s)")
print(f"first call     {first:.2f} s  (trace + partition + passes + one step)")
print(f"make_fx trace  {handler.seconds:.2f} s  (from spmd's log)")
print(f"traced graph   {len(gm.graph.nodes)} nodes")
print(f"cached step    {cached:.2f} s")
report = train_step.report()
if report.lower_s is not None:
    print(f"{report.backend} lowering {report.lower_s:.2f} s  (part of the first call)")
