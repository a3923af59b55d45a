"""One inductor compile per host: ranks lowering the same graph share one compile.

Under ``torchrun`` every rank of a host compiles its final graph at the same moment, on the
same cores. With data parallelism the graphs are usually identical, so all but one of those
compiles are wasted, and they slow the one that matters (measured on 2 cores, 2 ranks:
``benchmarks/profiles/compile_time.py --ranks 2``). Here the first rank to reach the lowering of a
given graph on a host (the *leader*) compiles it; every other rank with the same graph on
that host (a *follower*) waits until the leader is done, then compiles too, and its compile
is a hit in inductor's on-disk caches (FX graph cache, with the kernels in the code cache
under ``TORCHINDUCTOR_CACHE_DIR``), which the leader has just filled.

Which ranks share: those whose :func:`graph_key` is equal, a hash of what inductor will
compile (the final graph's code, every input's shape, stride, dtype and device, the inductor
settings and lowering options, the torch version) together with the host name and the cache
directory. A rank with a different graph (uneven local batches, a hybrid mesh's per-rank
group names) has a different key and compiles alone, at once. A follower still compiles its
own graph: a cache entry inductor does not consider equal is a miss, never a wrong program;
sharing only decides who goes first.

The leader is the first rank to arrive (an atomic counter in the process group's store),
not the lowest rank: no barrier is needed, and a rank that retraces alone (a smaller last
batch) just leads its own compile. Never a hang: a leader that fails posts its error, and
each follower raises :class:`spmd.errors.LoweringError` naming it; a leader that never posts
(a killed process) makes followers raise after the process group's timeout.

Off by default: with 2 ranks on 2 cores no gain was measurable (the compile is largely
single-threaded Python, which two ranks run side by side), and a warm cache makes followers
queue behind the leader's load. It is meant for many ranks per host (8 GPUs per node), where
every rank would otherwise compile the same graph on the same cores. ``share_compile=True``
(or env ``SPMD_SHARE_COMPILE=1``) turns it on; it then applies only where it is safe: a
process group of more than one rank (not the fake one) and inductor's FX graph cache enabled
under the settings in force.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.fx as fx

from passes import torch_compat
from spmd.errors import LoweringError

log = logging.getLogger("spmd")

T = TypeVar("T")
_POLL_S = 0.05
_DEFAULT_TIMEOUT_S = 1800.0  # gloo's and NCCL's default process group timeout


class Role(enum.Enum):
    ALONE = "alone"  # compiled without sharing (off, unsafe, or world size 1)
    LEADER = "leader"  # compiled first, for every rank of its host with the same graph
    FOLLOWER = "follower"  # waited for the leader, then loaded its compile from the caches


def sharing_safe(settings: dict[str, Any]) -> bool:
    """Whether a shared compile can help: a real process group of more than one rank, and
    inductor's FX graph cache on under ``settings`` (the patch spmd applies to inductor)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    if dist.get_backend() == "fake":
        return False  # simulation: one process stands for every rank
    from passes.torch_compat import inductor_config as config

    with config.patch(settings):
        return bool(config.fx_graph_cache) and not bool(config.force_disable_caches)


def graph_key(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], extra: Sequence[Any]) -> str:
    """A hash of what inductor compiles for ``gm``, plus the host and the cache directory:
    equal keys on two ranks mean equal compiles that can share one cache entry."""
    from passes.torch_compat import inductor_cache_dir as cache_dir

    h = hashlib.sha256()
    for part in (socket.gethostname(), cache_dir(), torch.__version__, gm.code, *map(repr, extra)):
        h.update(str(part).encode())
        h.update(b"\0")
    for t in example_inputs:
        h.update(repr((tuple(t.shape), t.stride(), t.dtype, t.device.type, t.requires_grad)).encode())
    return h.hexdigest()[:32]


def compile_once_per_host(
    key: str, compile: Callable[[], T], *, timeout_s: float | None = None
) -> tuple[T, Role, float]:
    """``compile()`` on the first rank of this host to arrive with ``key``; on the others,
    ``compile()`` after it is done (a cache hit). Returns (result, role, seconds waited).

    Raises:
        LoweringError: on a follower, when the leader's compile failed or did not finish
            within ``timeout_s`` (default: the process group's timeout).
    """
    store = torch_compat.get_default_store()
    prefix = f"spmd/lower/{key}"
    rank = dist.get_rank()
    if store.add(f"{prefix}/claims", 1) == 1:
        store.set(f"{prefix}/leader", str(rank))
        log.info("spmd: rank %d compiles the graph for every rank of this host with the same graph", rank)
        bypassed = _bypasses()
        try:
            out = compile()
        except BaseException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            what = first if isinstance(exc, LoweringError) else f"{type(exc).__name__}: {first}"
            store.set(f"{prefix}/done", f"error:{what}")
            raise
        # A compile inductor would not cache leaves the followers nothing to load: say so.
        store.set(f"{prefix}/done", "ok" if _bypasses() == bypassed else "uncached")
        return out, Role.LEADER, 0.0
    timeout = timeout_s if timeout_s is not None else (_pg_timeout_s() or _DEFAULT_TIMEOUT_S)
    t0 = time.perf_counter()
    leader = _wait(store, f"{prefix}/leader", t0 + timeout) or "?"
    log.info(
        "spmd: rank %d waits for rank %s's compile of the same graph (then loads it from the cache)",
        rank,
        leader,
    )
    done = _wait(store, f"{prefix}/done", t0 + timeout)
    waited = time.perf_counter() - t0
    if done is None:
        raise LoweringError(
            f"spmd: rank {rank} waited {waited:.0f} s for rank {leader} to compile the same graph with "
            "inductor, and it did not finish (it may have crashed or been killed). Raise the process group "
            "timeout (init_process_group(timeout=...)) if compiles are that slow, or turn the shared compile "
            "off with spmd.compile(..., share_compile=False) (env SPMD_SHARE_COMPILE=0)."
        )
    if done.startswith("error:"):
        raise LoweringError(
            f"spmd: rank {leader} compiled this rank's graph (the same graph) with inductor for the host, "
            f"and it failed; rank {rank} does not repeat it. Rank {leader}'s error: "
            f"{done.removeprefix('error:')}"
        )
    if done == "uncached":
        log.warning(
            "spmd: rank %s's compile of the same graph bypassed inductor's FX graph cache, so rank %d "
            "compiles it again after waiting %.2f s; spmd.compile(..., share_compile=False) avoids the wait",
            leader,
            rank,
            waited,
        )
    else:
        log.info("spmd: rank %d waited %.2f s for rank %s's compile", rank, waited, leader)
    return compile(), Role.FOLLOWER, waited


def _bypasses() -> int:
    from passes.torch_compat import dynamo_counters as counters

    return int(counters["inductor"]["fxgraph_cache_bypass"])


def _wait(store: Any, key: str, deadline: float) -> str | None:
    """The value of ``key`` once it is set, or None at ``deadline``."""
    while not store.check([key]):
        if time.perf_counter() > deadline:
            return None
        time.sleep(_POLL_S)
    value = store.get(key)
    return value.decode() if isinstance(value, bytes) else str(value)


def _pg_timeout_s() -> float | None:
    from spmd.backend.runtime import _pg_timeout_s as timeout

    return timeout()
