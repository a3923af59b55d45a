"""Compile-time check that every rank will issue the same collectives.

Ranks that compiled different graphs (a different model, a different code path)
hang in the first collective they disagree on, or silently exchange mismatched
buffers. Before the first run each rank publishes a fingerprint of its final
collective sequence (kind, shapes, dtypes, group, reduce op, order) in the
process group's key-value store, reads everyone else's, and on a mismatch raises
:class:`RankDivergenceError` on every rank, naming the first differing collective
and the module it belongs to. A group is compared by its shape
(:func:`spmd.parallel.plan.group_label`), not its name: the shard groups of a hybrid
mesh have different names on different ranks. The exchange uses the store, not a
collective, so a rank that never gets here produces a timeout error, not a hang.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.invariants import describe, fingerprint
from spmd.errors import RankDivergenceError
from spmd.parallel.plan import group_label

log = logging.getLogger("spmd")


def check_rank_agreement(
    gm: fx.GraphModule, *, step_name: str, timeout_s: float = 30.0, before: Sequence[tuple[Any, str]] = ()
) -> None:
    """Raise :class:`RankDivergenceError` unless all ranks compiled the same collective sequence.

    Agreement is keyed by the fingerprint, not by how many graphs a rank compiled: a rank
    that retraces alone (its last batch is smaller) but issues the same collectives finds
    the others' matching fingerprints already published and goes on at once. Each
    publication also takes a number from a store counter; a rank still waiting that sees
    another rank publish a *different* sequence after its own declares divergence, and
    posts it so that every waiting rank raises the same error within a poll interval.

    ``before``: collectives the step issues outside the graph, before it, as (fingerprint entry,
    description): the all-reduce of the data checks (:mod:`spmd.frontend.data_checks`).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "fake":
        return  # simulation: one process stands for every rank
    fp = [*(entry for entry, _ in before), *fingerprint(gm, group_key=group_label)]
    if not fp:
        # A step that issues no collective cannot hang, and runs on without meeting the other ranks:
        # its publication here could be the last store operation of a script, racing a rank that
        # hosts the store and has already exited (a second eval step with the same empty
        # fingerprint finds every rank's key from the first one and goes on at once). A rank that
        # compiled collectives where this one did not times out waiting for this one's key below.
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    where = [*(text for _, text in before), *(describe(c) for c in C.collectives(gm.graph))]
    digest = hashlib.sha256(repr(fp).encode()).hexdigest()[:32]
    store = torch_compat.get_default_store()
    prefix = f"spmd/agree/{step_name}"
    seq = store.add(f"{prefix}/clock", 1)
    store.set(f"{prefix}/fp/{digest}/{rank}", "1")
    store.set(f"{prefix}/latest/{rank}", pickle.dumps((seq, digest, fp, where)))  # type: ignore[arg-type]
    mine = [f"{prefix}/fp/{digest}/{r}" for r in range(world)]
    abort = f"{prefix}/abort"
    deadline = time.monotonic() + timeout_s
    while not store.check(mine):
        if store.check([abort]):
            store.set(f"{abort}/seen/{rank}", "1")
            raise RankDivergenceError(store.get(abort).decode())
        for r in range(world):
            key = f"{prefix}/latest/{r}"
            if r == rank or not store.check([key]):
                continue
            their_seq, their_digest, their_fp, their_where = pickle.loads(store.get(key))
            if their_digest != digest and their_seq > seq:
                msg = _divergence_message(step_name, (rank, fp, where), (r, their_fp, their_where))
                _post_abort(store, abort, msg, rank, world)
                raise RankDivergenceError(msg)
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(mine) if not store.check([k])]
            raise RankDivergenceError(
                f"spmd: rank {rank} compiled {step_name!r} but rank(s) {missing} did not compile the same "
                f"collective sequence within {timeout_s:.0f} s. The ranks are running different code paths "
                "(or one crashed); running the step would hang. Make every rank call the same compiled "
                "steps with the same model and argument structure."
            )
        time.sleep(0.1)
    log.debug("spmd: %d ranks agree on %d collectives of %s", world, len(fp), step_name)


def _post_abort(store: dist.Store, abort: str, msg: str, rank: int, world: int, wait_s: float = 5.0) -> None:
    """Post the divergence for every waiting rank and give them ``wait_s`` to read it before this
    rank raises: the rank that found it may host the store (rank 0 under ``init_method="tcp://"``),
    and if its process ended first the others would meet a dropped connection instead of the error."""
    store.set(abort, msg)
    seen = [f"{abort}/seen/{r}" for r in range(world) if r != rank]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if store.check(seen):
                return
        except dist.DistError:  # the store's host read the abort, raised and exited: it has seen it
            return
        time.sleep(0.05)


def _divergence_message(
    step_name: str, a: tuple[int, list, list[str]], b: tuple[int, list, list[str]]
) -> str:
    (ra, fa, wa), (rb, fb, wb) = sorted([a, b], key=lambda x: x[0])
    i = next((i for i, (x, y) in enumerate(zip(fa, fb)) if x != y), min(len(fa), len(fb)))

    def show(entries: list, where: list[str]) -> str:
        return where[i] if i < len(entries) else "(no collective: its sequence ended)"

    return (
        f"spmd: ranks compiled different collective sequences for {step_name!r} "
        f"({len(fa)} collectives on rank {ra}, {len(fb)} on rank {rb}). First difference at "
        f"collective #{i}: rank {ra} issues {show(fa, wa)}; rank {rb} issues {show(fb, wb)}. Running this "
        "step would hang or mix up buffers. Check that every rank builds the same model (same layers, "
        "shapes, dtypes) and takes the same code path in the step."
    )
