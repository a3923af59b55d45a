"""Small workloads for ``valgrind_hunt.sh`` and ``crash_hunt.sh`` in benchmarks/diagnostics/ (issue 23).

Each closes a gap ``benchmarks/results/crashes.md`` lists ("Not done", "Not ruled out"):

``eager_clip``
    One process, no process group, no spmd trace: ``linalg_vector_norm`` + ``clamp`` + ``mul``
    through the Python API (unboxed calls) and through ``torch.ops.aten.*.default`` (boxed calls,
    as fx's generated code runs them), then ``torch.nn.utils.clip_grad_norm_`` on a tiny model,
    then (phase ``spmd``) the same clipped step compiled by spmd at world size 1. A line
    ``=== phase NAME`` goes to stderr before each phase; with valgrind's ``--log-fd=2`` the
    markers split its log by phase (``valgrind_hunt.sh eager_clip`` does that).
``refs``
    A torchrun worker: a few steps of DDP, of FSDP2 ``fully_shard`` (per block + root), then
    spmd's fully_shard step, in one rank process on gloo, compared as the parity tests compare.
``expand``
    A torchrun worker: ``tests/dist/test_expand.py``'s 1-D tensor-parallel case (TinyGPT with
    Megatron placements on 2 ranks, clip_grad_norm_, fused SGD; the test that crashed in CI).
``teardown``
    A torchrun worker that ends a rank the ways a test or a user may: ``--case exception``
    (an exception escapes after a collective, no ``destroy_process_group``), ``--case unwaited``
    (an async ``all_reduce`` issued and never waited, then exit), ``--case compiled`` (a compiled
    spmd step and its model alive at interpreter exit), ``--case survivor`` (all three at once, as
    ``tests/dist/test_resume.py``'s surviving rank: its peer vanishes, its next compiled step fails
    in a collective with others in flight, the error escapes); ``--destroy`` destroys the group first.

    PYTHONPATH=. .venv/bin/python benchmarks/diagnostics/valgrind_workloads.py eager_clip
    PYTHONPATH=. .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        benchmarks/diagnostics/valgrind_workloads.py teardown --case unwaited
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn as nn


def phase(name: str) -> None:
    print(f"=== phase {name}", file=sys.stderr, flush=True)


def eager_clip(with_spmd: bool = True) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    phase("api")  # unboxed: the Python bindings call at:: functions directly
    n = torch.linalg.vector_norm(x, 2.0)
    c = (1.0 / (n + 1e-6)).clamp(max=1.0)
    y = x * c
    float(y.sum())
    phase("aten_boxed")  # boxed: torch.ops.aten.*.default, as fx's generated code calls them
    aten = torch.ops.aten
    n = aten.linalg_vector_norm.default(x, 2.0)
    c = aten.clamp.default(aten.reciprocal.default(aten.add.Tensor(n, 1e-6)), None, 1.0)
    y = aten.mul.Tensor(x, c)
    s = aten.sqrt.default(
        aten.sum.default(aten.pow.Tensor_Scalar(aten.cat.default([x.flatten(), y.flatten()]), 2))
    )
    float(s)
    phase("clip_grad_norm_")
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    model(x).square().mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    float(sum(p.grad.sum() for p in model.parameters() if p.grad is not None))
    if not with_spmd:
        phase("end")
        return
    import spmd
    from tests import models as shared
    from tests.dist import parity_models as pm
    from tests.dist.workers import train_step_clip

    phase("spmd_compile_and_step")  # the same clip, traced by spmd at world size 1
    model = pm.build("uneven")
    opt = shared.make_optimizer("adam_fused", model)
    step = spmd.compile()(train_step_clip)
    for i in range(2):
        float(step(model, opt, *pm.batch("uneven", i, 0)))
    phase("end")


def refs(steps: int) -> list[str]:
    """DDP, FSDP2 and spmd fully_shard in one rank process, as the parity tests run them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spmd
    from tests import models as shared
    from tests.dist import parity_models as pm
    from tests.dist.workers import train_step

    rank = dist.get_rank()
    problems: list[str] = []
    name, opt_name = "tinygpt", "adamw_fused"  # as the parity tests (bit for bit)
    model = pm.build(name)
    ddp = DDP(copy.deepcopy(model))
    ddp_opt = shared.make_optimizer(opt_name, ddp.module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp = copy.deepcopy(model)
    for blk in fsdp.blocks:  # per block, then the root (tests/dist/workers_mixed_precision.py)
        fully_shard(blk, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = shared.make_optimizer(opt_name, fsdp)
    opt = shared.make_optimizer(opt_name, model)
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"), check_invariants=True)(train_step)
    for i in range(steps):
        b = pm.batch(name, i, rank)
        want = train_step(ddp, ddp_opt, *b)
        got_fsdp = train_step(fsdp, fsdp_opt, *b)
        got = step(model, opt, *b)
        if not torch.equal(want, got_fsdp) or not torch.equal(want, got):
            problems.append(
                f"step {i}: losses ddp {want.item()!r} fsdp2 {got_fsdp.item()!r} spmd {got.item()!r}"
            )

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    for (n, p), q, r in zip(
        model.named_parameters(), ddp.module.parameters(), fsdp.parameters(), strict=True
    ):
        if not torch.equal(full(p), q) or not torch.equal(full(r), q):
            problems.append(f"parameter {n} differs")
    return problems


def expand(steps: int) -> list[str]:
    import torch.distributed as dist

    from tests.dist import workers_expand

    r = workers_expand.tensor_parallel(
        dist.get_rank(), dist.get_world_size(), {"tp": 2}, "sgd", True, steps=steps
    )
    tol = 1e-5  # tests/dist/test_expand.py's TOL: TP reorders sums
    return [f"{k} {r[k]}" for k in ("param_diff", "loss_diff") if not r[k] < tol]


def teardown(case: str, destroy: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.full((1 << 12,), float(rank))
    dist.all_reduce(x)
    if case == "exception":
        # As a test worker whose rank raises an expected error: the exception escapes the rank.
        if destroy:
            dist.destroy_process_group()
        raise RuntimeError(f"rank {rank}: the expected error")
    if case == "unwaited":
        work = dist.all_reduce(torch.ones(1 << 14), async_op=True)  # issued, never waited
        del work
        if destroy:
            dist.destroy_process_group()
        print(f"rank {rank}: exit with an unwaited all_reduce", flush=True)
        return
    if case in ("compiled", "survivor"):
        import spmd
        from tests import models as shared
        from tests.dist import parity_models as pm
        from tests.dist.workers import train_step

        global _ALIVE  # the model, optimizer and compiled step live until interpreter exit
        model = pm.build("tinygpt")
        opt = shared.make_optimizer("adamw_fused", model)
        step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"))(train_step)
        for i in range(2):
            step(model, opt, *pm.batch("tinygpt", i, rank))
        _ALIVE = (model, opt, step)
        if case == "survivor":
            # tests/dist/test_resume.py's survivor: the peer vanishes (here it exits at once, without
            # teardown, so torchrun does not stop this rank first), this rank's next step fails in a
            # collective with others issued and unwaited, and the error escapes with the group alive.
            if rank == 1:
                os._exit(0)
            step(model, opt, *pm.batch("tinygpt", 2, rank))
            raise AssertionError("the step did not fail without its peer")
        if destroy:
            dist.destroy_process_group()
        print(f"rank {rank}: exit with a compiled step alive", flush=True)
        return
    raise ValueError(case)


_ALIVE: object = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=["eager_clip", "refs", "expand", "teardown"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-spmd", action="store_true", help="eager_clip: skip the spmd phase")
    ap.add_argument("--case", choices=["exception", "unwaited", "compiled", "survivor"], default="exception")
    ap.add_argument("--destroy", action="store_true", help="teardown: destroy_process_group before exit")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.workload == "eager_clip":
        eager_clip(with_spmd=not args.no_spmd)
        return 0
    if args.workload == "teardown":
        teardown(args.case, args.destroy)
        return 0
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        problems = refs(args.steps) if args.workload == "refs" else expand(args.steps)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    for p in problems:
        print("MISMATCH", p)
    print(f"{args.workload}: {args.steps} steps: {'ok' if not problems else 'MISMATCH'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
