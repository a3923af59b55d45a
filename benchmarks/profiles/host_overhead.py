"""Host (Python) overhead of a cached compiled step: everything a call does besides running the graph.

    OMP_NUM_THREADS=1 python benchmarks/profiles/host_overhead.py              # 24 residual MLP blocks
    OMP_NUM_THREADS=1 python benchmarks/profiles/host_overhead.py --blocks 4   # a smaller model

World size 1 (no process group). The compiled step is called once (trace), then its final graph
is swapped for a null graph that returns the outputs of one real run: the wall time of a call is
then the host overhead alone (argument split, cache look-up, structure and attribute checks,
input recipe, output and ``.grad`` bookkeeping). Also prints the real graph's own run time and a
real call's wall time for scale. Medians over ``--calls`` calls.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import spmd  # noqa: E402

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--blocks", type=int, default=24)  # residual MLP blocks (each: LayerNorm, 2 Linear, Dropout)
p.add_argument("--width", type=int, default=32)  # small, so the graph's own time stays small
p.add_argument("--calls", type=int, default=300)  # timed calls per measurement
p.add_argument("--zero-grad", type=int, default=1)  # 1: the step ends with zero_grad; 0: grads accumulate
p.add_argument("--slow-path", action="store_true")  # forget the last call before each call (no fast path)
args = p.parse_args()


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.0)
        self.scale = 1.0  # a plain attribute the forward reads (guarded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d: int, n: int):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def train_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    if args.zero_grad:
        optim.zero_grad()
    return loss


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


torch.manual_seed(0)
model = Net(args.width, args.blocks)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x, y = torch.randn(8, args.width), torch.randint(0, 4, (8,))
step = spmd.compile()(train_step)
for _ in range(3):
    step(model, optim, x, y)
real_call = median_ms(lambda: step(model, optim, x, y), args.calls)

exe = step._last.exe
real_gm = exe.gm
flat = [
    spmd.parallel.sharding.local(t)
    for t in exe.inputs(spmd.frontend.step_inputs.split_args((model, optim, x, y), {}))
]


def run_graph() -> None:
    with torch.no_grad():
        real_gm(*flat)


graph_only = median_ms(run_graph, args.calls)
with torch.no_grad():
    outs = real_gm(*flat)
exe.gm = lambda *a: outs  # the null graph


def null_call() -> None:
    if args.slow_path:
        step._last_call = None
    step(model, optim, x, y)


overhead = median_ms(null_call, args.calls)
exe.gm = real_gm

n_mod = len(list(model.modules()))
print(
    f"blocks={args.blocks} modules={n_mod} params={len(list(model.parameters()))} "
    f"zero_grad={args.zero_grad} slow_path={args.slow_path}\n"
    f"host overhead per call (null graph): {overhead:.3f} ms\n"
    f"graph alone: {graph_only:.3f} ms   real call: {real_call:.3f} ms"
)
