"""Keep the gathers a step issued for its next call (``cross_step_prefetch``); decide when not to use them.

A graph rewritten by :func:`passes.cross_step.carry_first_gathers` returns its first
unit's all-gather, still in flight, as its last outputs and takes it back as its last
inputs on the next call. :class:`CarriedGathers` (one per compiled step) holds those
tensors between calls together with what they were gathered from, and hands them to
the next call only if nothing could have changed that since:

- the same graph runs again (the same :class:`~spmd.backend.runtime.Executable`): another graph
  (new input shapes, eval vs train, a retrace, changed optimizer param_groups, which
  are part of the cache key) drains them;
- each parameter shard the gathers read is the same tensor object, with the same
  storage and the same version counter as right after the call: ``load_state_dict``,
  DCP ``dcp.load``, an in-place edit under ``no_grad`` (all ``copy_``/in-place ops, which
  bump ``_version``) and ``p.data = ...`` or a re-sharding (a new tensor or storage) all
  fail this.

- no DCP load ran since (``dcp.load``/``dcp.load_state_dict`` write the local shards through
  views whose version counters are not the shards', so :func:`install` counts the loads).

What the checks cannot see: a write to a shard through a tensor that does not share its
version counter (``p.to_local().data``, ``p._local_tensor.data``). After such an edit call
``train_step.invalidate_prefetch()`` on every rank; with
``check_invariants=True`` (or ``SPMD_DEBUG=1``) the runtime also compares the shards with a
copy taken after the call and raises :class:`~spmd.errors.StalePrefetchError` if they differ.

Otherwise it drains them (waits, so no collective stays in flight, then drops them) and
the call issues the gathers itself (:func:`passes.cross_step.issue_module`) right before
the graph, which is exactly the collective the graph would have issued first.

Why every rank decides the same (a rank that issued one gather more than its peers
would hang them): the decision reads only (1) which cached graph the call selected,
which is the same on every rank (the ranks run the same graph; ``check_rank_agreement``
checks it at compile), and (2) object identity, storage and version counters of the
parameter shards, which change only through the same user code on every rank
(``load_state_dict``, ``dcp.load`` -- itself collective --, an edit in the SPMD training
script). Version counters are compared with their value right after the last call on
this rank, so what the graph itself writes never counts. An edit on one rank alone
would already make the ranks' parameters disagree (no data-parallel semantics survive
it); with carried gathers it would also make that rank issue one more collective.

At the end of training (``last_train_step=True``), when the compiled step is garbage
collected, and at interpreter exit, the in-flight gathers are drained: a functional
collective left unwaited makes c10d warn at exit. Waiting after
``dist.destroy_process_group()`` is fine on gloo (measured: the gather completed when
both ranks issued it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from passes import torch_compat
from spmd.errors import StalePrefetchError

log = logging.getLogger("spmd")

_wait = torch.ops._c10d_functional.wait_tensor.default
# DCP loads so far (see install); part of every validity key.
_loads = [0]


def install() -> None:
    """Count DCP loads: wrap ``torch.distributed.checkpoint.state_dict_loader._load_state_dict``,
    which ``dcp.load`` and ``dcp.load_state_dict`` call on every rank (a collective load), so the
    count is the same on every rank."""
    from passes.torch_compat import dcp_state_dict_loader as loader

    fn = getattr(loader, torch_compat.DCP_LOAD_STATE_DICT)
    if getattr(fn, "__spmd_counts__", False):
        return

    def counting(*args: Any, **kwargs: Any) -> Any:
        _loads[0] += 1
        return fn(*args, **kwargs)

    counting.__spmd_counts__ = True  # type: ignore[attr-defined]
    setattr(loader, torch_compat.DCP_LOAD_STATE_DICT, counting)


class CarriedGathers:
    """The in-flight gathers of one compiled step, kept for its next call."""

    def __init__(self, *, verify: bool = False) -> None:
        # verify: also compare the shards with a copy taken after the call (debug mode).
        self.verify = verify
        self.copies: list[torch.Tensor] = []
        self.owner: Any = None  # the Executable whose call issued them
        self.tensors: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []  # the parameter shards they were gathered from
        self.key: list[tuple[int, ...]] = []  # see _keys
        self.reused = 0  # calls that used carried gathers (for tests and logs)
        self.issued = 0  # calls that gathered themselves

    def take(
        self,
        exe: Any,
        flat: list[torch.Tensor],
        params: list[torch.Tensor],
        sources: list[int],
        issue: fx.GraphModule,
    ) -> list[torch.Tensor]:
        """The carried tensors for a call of ``exe`` on ``flat``: the kept ones if still
        exact, else freshly issued ones (after draining the kept ones). ``params`` are the
        parameters whose local shards are ``flat[i] for i in sources``."""
        if self.owner is exe and self.key == _keys(params, [flat[i] for i in sources]):
            if self.verify:
                self._check_unchanged([flat[i] for i in sources])
            out = self.tensors
            self._forget()
            self.reused += 1
            return out
        if self.tensors:
            log.debug("spmd: carried gathers invalidated; gathering again")
        self.drain()
        self.issued += 1
        with torch.no_grad():
            return list(issue(*flat))

    def keep(
        self,
        exe: Any,
        flat: list[torch.Tensor],
        params: list[torch.Tensor],
        sources: list[int],
        tensors: list[torch.Tensor],
    ) -> None:
        """Hold the carried outputs of a call of ``exe`` on ``flat`` for the next call."""
        self.owner = exe
        self.tensors = list(tensors)
        self.sources = [*params, *(flat[i] for i in sources)]  # alive, so no id is reused
        self.key = _keys(params, [flat[i] for i in sources])
        if self.verify:
            self.copies = [flat[i].clone() for i in sources]

    def drain(self) -> None:
        """Wait on the kept gathers (if any) and drop them."""
        tensors = self.tensors
        self._forget()
        for t in tensors:
            _wait(t)

    def drain_quietly(self) -> None:
        """:meth:`drain` for finalizers (garbage collection, interpreter exit): a failure
        (a peer died, the group timed out) is logged, not raised."""
        try:
            self.drain()
        except Exception as exc:  # noqa: BLE001 - nothing to raise to at exit
            log.warning("spmd: could not wait on a carried all-gather at exit: %s", exc)

    def _check_unchanged(self, shards: list[torch.Tensor]) -> None:
        changed = [i for i, (a, b) in enumerate(zip(shards, self.copies)) if not torch.equal(a, b)]
        if changed:
            self.drain()
            raise StalePrefetchError(
                f"spmd: {len(changed)} parameter shard(s) read by the carried all-gather changed between "
                "calls without bumping a version counter (a write through .data), so "
                "the gather issued at the end of the last call holds old values. Call "
                "train_step.invalidate_prefetch() on every rank after such an edit, or edit the "
                "parameters themselves (in place under torch.no_grad(), load_state_dict), which spmd sees."
            )

    def _forget(self) -> None:
        self.owner = None
        self.tensors, self.sources, self.key, self.copies = [], [], [], []


def _keys(params: list[torch.Tensor], shards: list[torch.Tensor]) -> list[tuple[int, ...]]:
    """What must not change between calls, per parameter: the parameter object and its version
    counter (an in-place write through a DTensor parameter -- ``copy_`` from ``load_state_dict``
    or ``dcp.load``, an edit under ``no_grad`` -- bumps the wrapper's counter, not its local
    tensor's), and its local shard's identity, version and storage (a write to the local
    itself, ``p.data = ...``, a re-sharding). The step's own writes (the optimizer, on the local
    shards, through kernels that may not bump counters at all) happen before the snapshot."""
    return [
        (id(p), p._version, id(t), t._version, t.untyped_storage().data_ptr(), _loads[0])
        for p, t in zip(params, shards, strict=True)
    ]
