"""Run a function on N gloo ranks in fresh processes, with a hard deadline.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, initialises a gloo
process group over loopback, calls ``fn(rank, world_size, *args)`` and returns the
per-rank results. Any rank's exception is re-raised with its traceback; if the ranks
do not finish within ``timeout`` seconds every process is killed and the test fails
(a hang never blocks the suite).

Fault tests pass ``pg_timeout`` (seconds, the process group's collective timeout) and
``may_die`` (ranks allowed to exit without a result, e.g. one that SIGKILLs itself);
such a rank's result is ``None``.

Ranks start from a fork server that has imported torch, spmd and the test workers once per
pytest process (:func:`_context`): a spawned rank spent ~3 s of CPU importing them, and the suite
starts ~200 ranks. Each rank still gets the parent's environment and working directory as they
are at the call. A variable only read when a process starts (glibc's ``MALLOC_*``, the loader's,
the interpreter's, OpenMP's) cannot be handed to a forked rank, so a call whose environment
differs from the fork server's in one of those spawns fresh processes instead, as does every call
under ``SPMD_TEST_SPAWN=1`` (``benchmarks/diagnostics/crash_hunt.sh`` sets it: a forked rank ends in
``os._exit`` after its exit handlers, so the interpreter's own teardown, where a crash at exit
would happen, runs only in spawned ranks).

A rank killed by a signal it did not ask for (SIGABRT from glibc's heap checks, SIGSEGV,
SIGBUS) is a native crash, a memory-safety bug, and fails the run at once with
:class:`RankCrashed`, never retried: its message names the signal and holds every rank's
Python stacks -- the crashed rank's as ``faulthandler`` wrote them when the signal hit, the
others' dumped on request (``SIGUSR1``) just before they are killed. A retry would hide
a bug that in training could as well corrupt values silently instead of crashing
(issue 23; ``benchmarks/diagnostics/crash_hunt.sh`` hunts such crashes under load).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
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
    stacks: str | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> None:
    if env is not None:  # a forked rank: the caller's environment, not the fork server's
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    os.environ["OMP_NUM_THREADS"] = "1"
    import faulthandler

    # A native crash writes where each thread was; SIGUSR1 (sent by the parent when a peer
    # crashed) writes the same without stopping the rank. To a file the parent reads back.
    out = open(stacks, "w") if stacks else sys.stderr  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=out, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    import torch
    import torch.distributed as dist

    import spmd

    torch.set_num_threads(1)
    try:
        # One gloo worker thread: torch's gloo can corrupt the heap when two collectives run
        # at once (benchmarks/results/crashes.md), and the DDP/FSDP2 references the ranks run next to spmd
        # have no protection of their own. SPMD_TEST_GLOO_THREADS=default makes torch's own
        # group (two threads), on which spmd keeps one collective in flight
        # (tests/dist/test_gloo_threads.py; the torchrun jobs use it too).
        threads = os.environ.get("SPMD_TEST_GLOO_THREADS", "1")
        with spmd.gloo_threads(int(threads)) if threads != "default" else contextlib.nullcontext():
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
        if env is not None:
            # A forked rank ends in os._exit, which skips the interpreter's exit: run its exit
            # handlers here, so a crash in one still fails the test as a spawned rank's would.
            import atexit

            atexit._run_exitfuncs()


class RankFailure(AssertionError):
    pass


class RankCrashed(RankFailure):
    """A rank was killed by a signal it did not expect (a native crash): never retried."""


# How torchrun reports a worker killed by a native crash (not SIGKILL, which tests send).
_TORCHRUN_CRASH = re.compile(r"Signal (6|7|11) \((SIGABRT|SIGBUS|SIGSEGV)\)")
# A crash that torchrun does not report as such (at exit, after the worker's result was in):
# faulthandler's header, which PYTHONFAULTHANDLER=1 prints on any fatal signal.
_FATAL = re.compile(r"Fatal Python error: (Aborted|Segmentation fault|Bus error)")


def torchrun_crash(output: str) -> str | None:
    """The signal a torchrun job's worker crashed with, read from its output, if any.

    Callers fail on it (see the module docstring): a native crash is never retried."""
    m = _TORCHRUN_CRASH.search(output)
    if m:
        return m.group(2)
    f = _FATAL.search(output)
    return (
        {"Aborted": "SIGABRT", "Segmentation fault": "SIGSEGV", "Bus error": "SIGBUS"}[f.group(1)]
        if f
        else None
    )


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 240,
    pg_timeout: float = 60,
    may_die: Collection[int] = (),
) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as tmp:
        stacks = [os.path.join(tmp, f"rank{r}.stacks") for r in range(world_size)]
        return _run(fn, world_size, args, timeout, pg_timeout, may_die, stacks)


def _crashed(procs: list[Any], may_die: Collection[int]) -> dict[int, str]:
    """Ranks killed by a signal they did not ask for (SIGKILL is what fault tests send)."""
    return {
        r: signal.Signals(-p.exitcode).name
        for r, p in enumerate(procs)
        if r not in may_die and p.exitcode is not None and p.exitcode < 0 and p.exitcode != -signal.SIGKILL
    }


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


# What the fork server imports once; a rank imports the rest of what its function needs itself.
_PRELOAD = ["torch", "torch.distributed", "spmd", "tests.dist.launcher"]
_PRELOAD += sorted(
    "tests.dist." + os.path.splitext(f)[0]
    for f in os.listdir(os.path.dirname(os.path.abspath(__file__)))
    if f.startswith("workers") and f.endswith(".py")
)
# Read by glibc, the loader, the interpreter or OpenMP when a process starts: a fork cannot change them.
_STARTUP_ONLY = ("MALLOC_", "LD_", "PYTHON", "OMP_", "MKL_", "KMP_", "GLIBC_")
_server_env: dict[str, str] | None = None


def _context() -> tuple[Any, bool]:
    """The multiprocessing context for a call, and whether its ranks are forked (see the module
    docstring): the fork server, started with this process's environment at the first call, or
    ``spawn`` when a start-up-only variable has changed since."""
    global _server_env
    env = dict(os.environ)
    if _server_env is None:
        _server_env = env
        mp.set_forkserver_preload(_PRELOAD)
    startup = {k: v for k, v in env.items() if k.startswith(_STARTUP_ONLY)}
    if os.environ.get("SPMD_TEST_SPAWN") == "1" or startup != {
        k: v for k, v in _server_env.items() if k.startswith(_STARTUP_ONLY)
    }:
        return mp.get_context("spawn"), False
    return mp.get_context("forkserver"), True


def _run(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    pg_timeout: float,
    may_die: Collection[int],
    stacks: list[str],
) -> list[Any]:
    ctx, forked = _context()
    env, cwd = (dict(os.environ), os.getcwd()) if forked else (None, None)
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, q, args, pg_timeout, stacks[r], env, cwd))
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
            if _crashed(procs, may_die):
                break  # a native crash: the others would only wait for the dead rank
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
        signalled: set[int] = set()
        if _crashed(procs, may_die):
            # Where was everyone else? Their stacks (faulthandler, SIGUSR1), then they are
            # stopped like any leftover.
            for r, p in enumerate(procs):
                if p.is_alive() and p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGUSR1)
                        signalled.add(r)
            time.sleep(1.0)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    # After the joins: a crash at exit, after the rank's result was in, fails as well. A rank
    # that SIGUSR1 stopped before its handler was installed is no crash.
    crashed = {
        r: sig
        for r, sig in _crashed(procs, may_die).items()
        if not (r in signalled and procs[r].exitcode == -signal.SIGUSR1)
    }
    if crashed:  # the others' errors (a failed collective) follow from it
        state = {
            r: crashed.get(r) or ("reported" if r in reported else "stopped after the crash")
            for r in range(world_size)
        }
        where = "\n".join(
            f"--- rank {r} ({state[r]}):\n{_read(path) or '(no stacks written)'}"
            for r, path in enumerate(stacks)
        )
        names = ", ".join(f"rank {r} killed by {sig}" for r, sig in sorted(crashed.items()))
        raise RankCrashed(
            f"native crash ({names}): a memory-safety bug, not retried. Python stacks of every rank:\n"
            f"{where}\nThe others reported:\n" + "\n".join(errors)
        )
    if errors:
        raise RankFailure("\n".join(errors))
    missing = [r for r in range(world_size) if r not in results and r not in may_die]
    if missing:
        codes = [p.exitcode for p in procs]
        raise RankFailure(f"ranks {missing} exited without a result (exit codes {codes})")
    return [results.get(r) for r in range(world_size)]
