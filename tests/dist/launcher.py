"""Run a function on N gloo ranks in fresh processes, with a hard deadline.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, initialises a gloo
process group over loopback, calls ``fn(rank, world_size, *args)`` and returns the
per-rank results. Any rank's exception is re-raised with its traceback; if the ranks
do not finish within ``timeout`` seconds every process is killed and the test fails
(a hang never blocks the suite).

Fault tests pass ``pg_timeout`` (seconds, the process group's collective timeout) and
``may_die`` (ranks allowed to exit without a result, e.g. one that SIGKILLs itself);
such a rank's result is ``None``.

A rank killed by a signal it did not ask for (SIGABRT from glibc's heap checks, SIGSEGV)
is a native crash, not a Python error: every rank prints its Python stacks on such a
signal (``faulthandler``), and the whole run is repeated once, with a warning naming the
crash. The suite has seen this rarely under load (a gloo rank aborting with "malloc():
unaligned tcache chunk detected"; not reproduced in 30 isolated runs): a second crash
fails the test as before, so a crash that our code causes every time still fails.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import re
import socket
import signal
import traceback
import warnings
from collections.abc import Callable, Collection
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    q: Any,
    args: tuple[Any, ...],
    pg_timeout: float = 60,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import faulthandler

    faulthandler.enable(all_threads=True)  # a native crash prints where each thread was
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
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


class RankCrashed(RankFailure):
    """A rank was killed by a signal it did not expect (a native crash)."""


# How torchrun reports a worker killed by a native crash (not SIGKILL, which tests send).
_TORCHRUN_CRASH = re.compile(r"Signal (6|7|11) \((SIGABRT|SIGBUS|SIGSEGV)\)")


def torchrun_crash(output: str) -> str | None:
    """The signal a torchrun job's worker crashed with, read from its output, if any.

    Callers run such a job once more (see the module docstring); a second crash fails."""
    m = _TORCHRUN_CRASH.search(output)
    return m.group(2) if m else None


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 240,
    pg_timeout: float = 60,
    may_die: Collection[int] = (),
) -> list[Any]:
    try:
        return _run_once(fn, world_size, args, timeout, pg_timeout, may_die)
    except RankCrashed as crash:
        warnings.warn(f"run_ranks({fn.__name__}): native crash, running once more: {crash}", stacklevel=2)
        return _run_once(fn, world_size, args, timeout, pg_timeout, may_die)


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    pg_timeout: float,
    may_die: Collection[int],
) -> list[Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, q, args, pg_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()

    def take(item: tuple[int, str, Any]) -> None:
        rank, status, payload = item
        reported.add(rank)
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank}:\n{payload}")

    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(reported) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise RankFailure(f"ranks did not finish within {timeout} s (finished: {sorted(results)})")
            try:
                take(q.get(timeout=min(left, 1.0)))
            except queue.Empty:
                # A rank died without reporting (or another failed): stop once all have exited,
                # after collecting what the others sent just before exiting.
                if all(p.exitcode is not None for p in procs):
                    with contextlib.suppress(queue.Empty):
                        while len(reported) < world_size:
                            take(q.get(timeout=1.0))
                    break
                continue
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    crashed = {
        r: signal.Signals(-p.exitcode).name
        for r, p in enumerate(procs)
        if r not in may_die and p.exitcode is not None and p.exitcode < 0 and p.exitcode != -signal.SIGKILL
    }
    if crashed:  # the others' errors (a failed collective) follow from it
        raise RankCrashed(f"ranks killed by a signal: {crashed}; the others reported:\n" + "\n".join(errors))
    if errors:
        raise RankFailure("\n".join(errors))
    missing = [r for r in range(world_size) if r not in results and r not in may_die]
    if missing:
        codes = [p.exitcode for p in procs]
        raise RankFailure(f"ranks {missing} exited without a result (exit codes {codes})")
    return [results.get(r) for r in range(world_size)]
