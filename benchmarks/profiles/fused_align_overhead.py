"""Per-call cost of ``spmd::aligned_fused_optimizer_`` against the bare fused kernel it wraps.

    OMP_NUM_THREADS=1 python benchmarks/profiles/fused_align_overhead.py              # 64 tiny ragged shards
    OMP_NUM_THREADS=1 python benchmarks/profiles/fused_align_overhead.py --params 8 --numel 33

What fully_shard runs for one optimizer bucket of a deep stack of tiny blocks (almost every shard
ragged): ``_fused_adamw_`` on ``--params`` shards of ``--numel`` elements, once bare and once
through the aligned op (pads every shard to the alignment, runs the kernel, copies back). The
difference is the op's fixed cost: dispatch through the custom-op wrapper, argument parsing and
the copy-in/out. Medians of CPU (thread) time over ``--calls`` calls, in microseconds (thread time,
not wall time, so other load on the machine adds less noise).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from passes.fused_align import ALIGNED_FUSED, wrap_args  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--params", type=int, default=64)  # shards in one call (one bucket)
p.add_argument("--numel", type=int, default=33)  # elements per shard (ragged: not a multiple of 64)
p.add_argument("--calls", type=int, default=500)
args = p.parse_args()

kernel = torch.ops.aten._fused_adamw_.default


def tensors() -> dict[str, object]:
    torch.manual_seed(0)
    n = args.params

    def mk() -> list[torch.Tensor]:
        return [torch.randn(args.numel) for _ in range(n)]

    return {
        "self": mk(),
        "grads": mk(),
        "exp_avgs": [t.abs() for t in mk()],
        "exp_avg_sqs": [t.abs() for t in mk()],
        "max_exp_avg_sqs": [],
        "state_steps": [torch.tensor(1.0) for _ in range(n)],
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "weight_decay": 0.01,
        "eps": 1e-8,
        "amsgrad": False,
        "maximize": False,
    }


def median_us(fn) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(args.calls):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e6


v = tensors()
bare_args = [v[a.name] for a in kernel._schema.arguments if not a.kwarg_only]
bare_kwargs = {a.name: v[a.name] for a in kernel._schema.arguments if a.kwarg_only and a.name in v}
n = args.params
wargs, wkw = wrap_args(kernel, v, [1] * n, [64 - (args.numel + 1) % 64] * n, [0] * n)
bare = median_us(lambda: kernel(*bare_args, **bare_kwargs))
aligned = median_us(lambda: ALIGNED_FUSED(*wargs, **wkw))
print(f"{n} shards x {args.numel} elements, torch {torch.__version__}, {torch.get_num_threads()} threads")
print(f"bare _fused_adamw_:           {bare:8.1f} us/call")
print(f"spmd::aligned_fused_optimizer_: {aligned:8.1f} us/call  (+{aligned - bare:.1f} us)")
