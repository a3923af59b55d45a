"""A warning at exit when the process group a compiled step ran on was never destroyed.

A gloo rank that leaves the interpreter with its group alive can abort at exit ("terminate
called without an active exception"): a collective that finishes on gloo's worker thread while
the interpreter finalizes releases its tensors there, takes the GIL, and the thread is ended
inside a destructor (pytorch/pytorch#190489; reproduced and explained in docs/troubleshooting.md,
"Teardown"). ``destroy_process_group()`` before the exit avoids it. spmd does not destroy the
user's group itself: with collectives still queued for a peer that is gone, the destroy waits
for them up to the group's timeout, which would turn an abort into a hang. It says so instead,
once, before the interpreter finalizes, so that an abort that follows has its cause printed
above it: a ``RuntimeWarning`` (shown by default, filterable with ``warnings``), not a log
record, which the ``spmd`` logger's default ``NullHandler`` would swallow.
"""

from __future__ import annotations

import atexit
import warnings

import torch.distributed as dist

_registered = False


def _alive_gloo_group() -> bool:
    return dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend())


def warn_at_exit_if_alive() -> None:
    """Arrange, once per process, the exit check (a no-op without a gloo process group)."""
    global _registered
    if _registered or not _alive_gloo_group():
        return
    _registered = True
    atexit.register(check_at_exit)


def check_at_exit() -> None:
    """Warn if the gloo process group is still initialized (run by ``atexit``)."""
    if _alive_gloo_group():
        warnings.warn(
            "spmd: the process group is still initialized at exit. Call "
            "torch.distributed.destroy_process_group() before the process exits, in a finally: "
            "around the training: a gloo rank that exits with its group alive can abort at exit "
            "(pytorch/pytorch#190489; docs/troubleshooting.md, gloo).",
            RuntimeWarning,
            stacklevel=1,
        )
