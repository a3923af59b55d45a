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
context manager swaps the class it constructs for the time of the call
(``passes.torch_compat.gloo_groups_with_threads``). Groups made inside (``init_process_group``,
``new_group``, ``DeviceMesh``'s groups) get ``n`` threads; nothing changes outside.

A user no longer needs it for spmd's sake: where torch's default group is gloo with several
threads, spmd makes its own one-thread groups for its collectives (``spmd.parallel.gloo_group``).
It is for the other code of a script that keeps several gloo collectives in flight (DDP, FSDP2's
prefetch), and for a mesh a user builds and passes in: on a gloo group with more than one thread
spmd keeps one collective in flight at a time (``spmd.pipeline.gloo_concurrent``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
    with torch_compat.gloo_groups_with_threads(n):
        yield
