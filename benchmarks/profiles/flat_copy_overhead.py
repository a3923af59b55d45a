"""Per-call cost of fully_shard's per-unit ops against the bare kernels they wrap, on a busy machine.

    OMP_NUM_THREADS=1 python benchmarks/profiles/flat_copy_overhead.py     # the overhead bench's unit
    OMP_NUM_THREADS=1 python benchmarks/profiles/flat_copy_overhead.py --blocks 1 --world 4

One unit of the bench's ``overhead`` model (``--blocks`` ResMLP blocks of d 64, hidden 256: 6
parameters a block; 8 blocks, 48 parameters, is the unit fully_shard makes on 2 ranks), sharded over
``--world`` ranks as fully_shard shards it (dim 0, ``ceil`` rows a rank). The optimizer's shards are
padded to 64 elements (LayerNorm and the second bias are 64 elements, so at 2 ranks 72 of its 146
shards are ragged there): the op's cost with many ragged shards, as at large world sizes. spmd
itself aligns to 64 bytes (``sharded_optim.align_elements``: 16 float32 elements), where these
shards are aligned at 2 ranks and the op is not used:

* ``spmd::all_gather_copy_in`` (rank 0's shards into the flat buffer) against a bare ``torch.cat``
  of the shards flattened;
* ``spmd::all_gather_copy_out`` (the gathered buffer into full parameters) against a bare
  ``split_with_sizes_copy`` into buffers allocated beforehand;
* ``spmd::aligned_fused_optimizer_`` (AdamW on the unit's shards, the ragged ones padded) against a
  bare ``_fused_adamw_`` on the same shards.

The time of a call is the minimum over ``--calls`` calls of its wall time (``perf_counter``), one
process, after warm-up: the minimum is what the call costs when nothing else gets the core, which
on a shared machine the median is not (both are printed). To compare against another version of
the ops, run the same command with ``PYTHONPATH`` set to that checkout (``git archive``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import torch

# Appended, not prepended: a checkout on PYTHONPATH comes first (the version to measure).
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import passes  # noqa: E402
from passes import torch_compat  # noqa: E402
from passes.flat_ops import COPY_IN, COPY_OUT  # noqa: E402
from passes.fused_align import ALIGNED_FUSED, wrap_args  # noqa: E402

ALIGN = 64  # elements: pads the unit's small shards, as a large world size would


def unit(blocks: int, d: int = 64, hidden: int = 256) -> list[torch.Tensor]:
    torch.manual_seed(0)
    out = []
    for _ in range(blocks):
        out += [torch.randn(d), torch.randn(d), torch.randn(hidden, d), torch.randn(hidden)]
        out += [torch.randn(d, hidden), torch.randn(d)]
    return out


def timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(min, median) wall time of one call, in microseconds."""
    for _ in range(50):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0] * 1e6, times[len(times) // 2] * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    w, fulls = args.world, unit(args.blocks)
    rows = [math.ceil(t.shape[0] / w) for t in fulls]
    shards = [t[:r] for t, r in zip(fulls, rows)]  # rank 0's
    sizes = [r * math.prod(t.shape[1:]) for t, r in zip(fulls, rows)]
    shapes = [list(t.shape) for t in fulls]
    flat_shapes, ranks = [d for s in shapes for d in s], [len(s) for s in shapes]
    gathered = torch.cat([COPY_IN(shards, sizes, torch.float32)] * w)
    dests = [torch.empty(w, c) for c in sizes]
    results = {
        "spmd::all_gather_copy_in": timed(lambda: COPY_IN(shards, sizes, torch.float32), args.calls),
        "  bare cat": timed(lambda: torch.cat([s.reshape(-1) for s in shards]), args.calls),
        "spmd::all_gather_copy_out": timed(
            lambda: COPY_OUT(gathered, w, sizes, flat_shapes, ranks), args.calls
        ),
        "  bare split_with_sizes_copy": timed(
            lambda: torch.split_with_sizes_copy(gathered.view(w, -1), sizes, dim=1, out=dests), args.calls
        ),
    }
    kernel = torch.ops.aten._fused_adamw_.default
    n = len(shards)
    state = {
        "self": [s.clone() for s in shards],
        "grads": [torch.randn_like(s) for s in shards],
        "exp_avgs": [torch.zeros_like(s) for s in shards],
        "exp_avg_sqs": [torch.zeros_like(s) for s in shards],
        "max_exp_avg_sqs": [],
        "state_steps": [torch.tensor(1.0) for _ in range(n)],
        "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8,
        "amsgrad": False, "maximize": False,
    }  # fmt: skip
    # Rank 0's shard starts at 0; it is ragged where it ends before the full tensor and off the
    # alignment (pad to the next multiple), as spmd.parallel.sharded_optim computes it.
    post = [
        0 if (s.numel() == t.numel() or s.numel() % ALIGN == 0) else -s.numel() % ALIGN
        for s, t in zip(shards, fulls)
    ]
    wargs, wkw = wrap_args(kernel, state, [0] * n, post, [0] * n)
    pos = [a.name for a in torch_compat.op_schema(kernel).arguments if not a.kwarg_only]
    bare_args = [state[k] for k in pos]
    bare_kw = {k: v for k, v in state.items() if k not in pos}
    results["spmd::aligned_fused_optimizer_"] = timed(lambda: ALIGNED_FUSED(*wargs, **wkw), args.calls)
    results["  bare _fused_adamw_"] = timed(lambda: kernel(*bare_args, **bare_kw), args.calls)
    ragged = sum(1 for x in post if x)
    print(
        f"{n} parameters ({args.blocks} blocks, {ragged} ragged shards), world {w}, "
        f"torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.calls} calls; ops from {os.path.dirname(passes.__file__)}"
    )
    print(f"{'op':34s} {'min us':>8s} {'median us':>10s}")
    for name, (lo, med) in results.items():
        print(f"{name:34s} {lo:8.1f} {med:10.1f}")


if __name__ == "__main__":
    main()
