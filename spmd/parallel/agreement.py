"""Compile-time check that every rank will issue the same collectives.

Ranks that compiled different graphs (a different model, a different code path)
hang in the first collective they disagree on, or silently exchange mismatched
buffers. Before the first run each rank publishes a fingerprint of its final
collective sequence (kind, shapes, dtypes, group, reduce op, order) in the
process group's key-value store, reads everyone else's, and on a mismatch raises
:class:`RankDivergenceError` on every rank, naming the first differing collective
and the module it belongs to. The exchange uses the store, not a collective, so a
rank that never gets here produces a timeout error, not a hang.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import logging
import pickle

import torch.distributed as dist
import torch.fx as fx

from passes import collectives as C
from passes.invariants import describe, fingerprint
from spmd.errors import RankDivergenceError

log = logging.getLogger("spmd")

_ROUND = itertools.count()


def check_rank_agreement(gm: fx.GraphModule, *, step_name: str, timeout_s: float = 30.0) -> None:
    """Raise :class:`RankDivergenceError` unless all ranks compiled the same collective sequence."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "fake":
        return  # simulation: one process stands for every rank
    rank, world = dist.get_rank(), dist.get_world_size()
    fp = fingerprint(gm)
    where = [describe(c) for c in C.collectives(gm.graph)]
    digest = hashlib.sha256(repr(fp).encode()).hexdigest()
    store = dist.distributed_c10d._get_default_store()
    # Every rank compiles its graphs in the same order, so the n-th compile of a step
    # name is the same compile everywhere; a rank that compiles an extra graph times out.
    prefix = f"spmd/agree/{step_name}/{next(_ROUND)}"
    store.set(f"{prefix}/{rank}", pickle.dumps((digest, fp, where)))  # type: ignore[arg-type]
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - store timeouts surface as several types
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RankDivergenceError(
            f"spmd: rank {rank} compiled {step_name!r} but rank(s) {missing} did not reach the same "
            f"compilation within {timeout_s:.0f} s. The ranks are running different code paths (or one "
            "crashed); running the step would hang. Make every rank call the same compiled steps with "
            "the same model and argument structure."
        ) from exc
    theirs = {r: pickle.loads(store.get(k)) for r, k in enumerate(keys)}
    ref_digest, ref_fp, ref_where = theirs[0]
    bad = sorted(r for r, (d, _, _) in theirs.items() if d != ref_digest)
    if not bad:
        log.debug("spmd: %d ranks agree on %d collectives of %s", world, len(fp), step_name)
        return
    other = bad[0]
    _, o_fp, o_where = theirs[other]
    i = next((i for i, (a, b) in enumerate(zip(ref_fp, o_fp)) if a != b), min(len(ref_fp), len(o_fp)))

    def show(entries: list, where: list[str], i: int) -> str:
        return where[i] if i < len(entries) else "(no collective: its sequence ended)"

    raise RankDivergenceError(
        f"spmd: ranks compiled different collective sequences for {step_name!r} "
        f"({len(ref_fp)} collectives on rank 0, {len(o_fp)} on rank {other}). First difference at "
        f"collective #{i}: rank 0 issues {show(ref_fp, ref_where, i)}; rank {other} issues "
        f"{show(o_fp, o_where, i)}. Running this step would hang or mix up buffers. Check that every "
        "rank builds the same model (same layers, shapes, dtypes) and takes the same code path in the step."
    )
