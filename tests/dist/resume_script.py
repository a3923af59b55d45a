"""Train with a DCP checkpoint every ``--every`` steps, resuming from the newest complete one.

Run by tests/dist/test_resume.py under torchrun::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 tests/dist/resume_script.py \
        --ckpt DIR --out OUT.pt --steps 9 --every 3 --kill-at 7

With ``--kill-at S`` rank 1 SIGKILLs itself before step S on torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0), after closing its gloo connections and waiting for rank 0
to fail in a collective (:func:`die_after_the_survivor_fails`); torchrun restarts both, and the new attempt resumes from the last checkpoint. Rank 0 writes the final full
parameters and the losses of the steps this attempt ran to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import spmd
from tests import models
from tests.dist.workers import train_step


def newest_checkpoint(root: str) -> tuple[int, str] | None:
    """(step, path) of the newest checkpoint whose save completed (DCP writes .metadata last)."""
    done = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith("step_") and os.path.exists(os.path.join(root, name, ".metadata")):
            done.append((int(name.removeprefix("step_")), os.path.join(root, name)))
    return max(done) if done else None


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    idx = torch.randint(0, 64, (2, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


SURVIVOR_FAILED = "survivor_failed"  # written by rank 0 when its CollectiveError is raised


def die_after_the_survivor_fails(marker: str, wait_s: float = 120.0) -> None:
    """Rank 1's death, in an order without a race: close this rank's gloo connections (the
    survivor's collective fails at once, with the peer gone), wait until the survivor has raised
    its CollectiveError (it writes ``marker``), then SIGKILL this process. Killing first raced
    torchrun's monitor, which could SIGTERM the survivor before gloo noticed the closed socket."""
    dist.destroy_process_group()
    deadline = time.monotonic() + wait_s
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--style", default="fully_shard")
    args = ap.parse_args()

    torch.set_num_threads(1)
    # A short collective timeout: the survivor of the kill must fail fast, not wait 30 min.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    mode = spmd.DataParallel(args.style)
    model = models.build("tinygpt")
    opt = models.make_optimizer("adamw_fused", model)
    step_fn = spmd.compile(parallel_mode=mode)(train_step)
    start = 0
    found = newest_checkpoint(args.ckpt)
    if found is not None:
        start, path = found
        mode.distribute(model, opt)
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    losses = {}
    marker = os.path.join(args.ckpt, SURVIVOR_FAILED)
    for i in range(start, args.steps):
        if args.kill_at == i and attempt == 0 and rank == 1:
            die_after_the_survivor_fails(marker)
        try:
            losses[i] = step_fn(model, opt, *batch(i, rank)).item()
        except spmd.CollectiveError:
            if attempt == 0:
                with open(marker, "w"):
                    pass
            raise
        if (i + 1) % args.every == 0:
            path = os.path.join(args.ckpt, f"step_{i + 1}")
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)

    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective: every rank
    if rank == 0:
        torch.save({"params": full, "losses": losses, "start": start, "attempt": attempt}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    finally:
        # Every exit path, an error's included, destroys the group: a gloo group left alive to
        # the interpreter's exit can abort the rank there (benchmarks/results/crashes.md, "Teardown").
        if dist.is_initialized():
            dist.destroy_process_group()
