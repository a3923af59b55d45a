"""Run a function on N gloo ranks in fresh processes, with a hard deadline.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, initialises a gloo
process group over loopback, calls ``fn(rank, world_size, *args)`` and returns the
per-rank results. Any rank's exception is re-raised with its traceback; if the ranks
do not finish within ``timeout`` seconds every process is killed and the test fails
(a hang never blocks the suite).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, q: Any, args: tuple[Any, ...]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        out = fn(rank, world, *args)
        # Pickle here: a result that cannot be pickled must fail loudly, not vanish in the
        # queue's feeder thread and leave the parent waiting.
        q.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankFailure(AssertionError):
    pass


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 240) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, q, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(results) + len(errors) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise RankFailure(f"ranks did not finish within {timeout} s (finished: {sorted(results)})")
            try:
                rank, status, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                # A rank died without reporting (or another failed): stop once all have exited.
                failed = errors or any(p.exitcode not in (None, 0) for p in procs)
                if failed and all(p.exitcode is not None for p in procs):
                    break
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankFailure("\n".join(errors))
    if len(results) < world_size:
        codes = [p.exitcode for p in procs]
        raise RankFailure(f"ranks exited without a result (exit codes {codes})")
    return [results[r] for r in range(world_size)]
