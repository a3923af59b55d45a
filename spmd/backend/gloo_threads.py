"""``spmd.gloo_threads(n)``: make gloo process groups that run their collectives on ``n`` threads.

torch's gloo process group runs the collectives it is given on a pool of worker threads, two
for a group made by ``torch.distributed.init_process_group("gloo")``: two collectives in flight
run at once. On torch 2.13 that can corrupt the heap -- a shared-pointer control block of gloo's
TCP transport (``gloo::transport::tcp::UnboundBuffer``) is released twice -- so a rank aborts
with "malloc(): unaligned tcache chunk detected" (or another glibc heap message), or goes on
with a corrupted heap. Reproduced without spmd by ``benchmarks/diagnostics/gloo_concurrent_collectives.py``
(docs/troubleshooting.md). With one thread the group runs collectives one after another, still in the
background of the caller's compute, and the corruption was not seen.

``init_process_group`` takes no gloo options (torch ignores ``pg_options`` for gloo), so this
context manager swaps the class it constructs for the time of the call: a subclass whose
constructor sets the thread count. Groups made inside (``init_process_group``, ``new_group``,
``DeviceMesh``'s groups) get ``n`` threads; nothing changes outside. It relies on the name
``torch.distributed.distributed_c10d.ProcessGroupGloo``, which ``tests/unit/test_gloo_threads.py``
checks on the installed torch.

spmd itself keeps one collective in flight at a time on a gloo group with more than one
thread (``spmd.pipeline.gloo_concurrent``), so the default group is safe without this; a
one-thread group lets spmd overlap collectives with each other again.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from passes import torch_compat
from spmd.errors import ConfigError


@contextlib.contextmanager
def gloo_threads(n: int = 1) -> Iterator[None]:
    """Within the block, gloo process groups are made with ``n`` worker threads.

    Example::

        with spmd.gloo_threads(1):
            dist.init_process_group("gloo")
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"spmd.gloo_threads: the number of threads must be an int >= 1, got {n!r}.")
    base = dist.ProcessGroupGloo

    class _GlooWithThreads(base):  # type: ignore[misc, valid-type]
        def __init__(
            self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, **kwargs: Any
        ) -> None:
            super().__init__(store, rank, size, torch_compat.gloo_options(n, timeout, **kwargs))

    before = c10d.ProcessGroupGloo
    c10d.ProcessGroupGloo = _GlooWithThreads  # type: ignore[misc]
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = before  # type: ignore[misc]
