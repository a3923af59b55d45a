"""Shared memory between the ranks of one host: the transport of ``passes.shm_collectives``.

When every rank of a gloo group runs on this machine, spmd maps one file of ``/dev/shm`` into all
of them (made by the group's first rank, opened by the others, unlinked once all have it: nothing
is left behind, whatever happens later) and runs the group's collectives through it, in the
caller's thread: a rank copies what it sends into its own slot, publishes a counter, and copies
or adds what it needs out of its peers' slots once their counters say the data is there. No
thread, socket or system call moves the bytes (measured against gloo, one op at a time:
``benchmarks/profiles/shm_collectives.py``; docs/performance.md, "Shared memory between the ranks
of one host").

Layout of the file: a control page (a magic number and a token; then, one cache line each, every
rank's "published" counter and its "done" counter) and the slots, two per rank (the parity of
the round), ``slot_bytes`` each. A collective larger than a slot runs in rounds. Round ``k``
uses the slots of parity ``k % 2``: before writing, a rank waits until each peer's "done" counter
reaches ``k - 2`` (the last reader of that slot has finished); after writing it publishes ``k``;
it reads a peer's slot once that peer's published counter reaches ``k``; then it sets its "done"
counter to ``k``. Every rank runs the same rounds in the same order (the graph's), so the
counters agree.

Memory order: a counter is stored after the data it publishes and loaded before the data is
read. x86-64 keeps stores in order and loads in order across cores, so a rank that sees ``k``
sees the round's bytes; other architectures do not promise that without fences, which Python
cannot issue, so there the groups stay on gloo.

Waiting: a rank whose peer is late first yields its core (``sched_yield``: with more ranks than
cores, as in the test suite, the peer gets it), then, after 2 ms, sleeps 50 us at a time. Every
half second it checks that the peers' processes are alive (their pids and start times, compared
when the file was set up) and the group's timeout: a dead peer or a timeout raises
:class:`~spmd.errors.CollectiveError`, never a hang. After such an error (or any exception inside
a round) the ranks' counters no longer agree, so every later collective of the group raises too,
rather than read a slot a peer has not rewritten.

What it does not do: groups across hosts, groups where ``/dev/shm`` is missing or too small
(``posix_fallocate`` of the file fails: a full tmpfs would otherwise kill the process with
SIGBUS at a later write), non-x86-64 machines, CUDA tensors, or ``SPMD_SHM=0``: those keep gloo.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import secrets
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx

from passes import collectives as C
from passes import shm_ops, torch_compat
from passes.shm_collectives import restore_gloo
from spmd.errors import CollectiveError

log = logging.getLogger("spmd")

_MAGIC = 0x73706D6473686D31  # "spmdshm1"
_LINE = 8  # int64 counters per 64-byte cache line
_MAX_WORLD = 64
_PUB = _LINE  # rank r's published counter: ctrl[_PUB + r * _LINE]
_DONE = _LINE * (1 + _MAX_WORLD)  # rank r's done counter: ctrl[_DONE + r * _LINE]
_CTRL_BYTES = 3 * 4096  # (1 + 2 * 64) cache lines, rounded up to pages
# 4 MiB a slot: the rounds of a large collective cost one counter exchange each (~us), so the
# slot only has to be large enough for a round to be a copy, not a handshake.
_SLOT_BYTES = 4 << 20
_ALIGN = 64  # a round's bytes start on a cache line and on every dtype's element boundary
_YIELD_S = 2e-3  # yield the core this long before sleeping
_SLEEP_S = 5e-5
_CHECK_S = 0.5  # how often a waiting rank checks its peers' processes and the timeout


def _enabled_here() -> str | None:
    """Why this process cannot use shared memory, or None."""
    if os.environ.get("SPMD_SHM", "") == "0":
        return "SPMD_SHM=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} does not keep stores in order across cores without fences"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm"
    return None


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{platform.node()}/{boot}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if fields[0] not in ("Z", "X") else None


# write(start, end, my_slot) and read(start, end, peer, its_slot) of a round (Region._rounds), the
# slots cut to the round's elements.
_Write = Callable[[int, int, torch.Tensor], None]
_Read = Callable[[int, int, int, torch.Tensor], None]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as one dimension (a view); bool as bytes (the slots' views are numeric)."""
    flat = t.view(-1)
    return flat.view(torch.uint8) if flat.dtype is torch.bool else flat


class Region:
    """One group's shared file, mapped; runs that group's collectives (``passes.shm_ops.Transport``)."""

    def __init__(
        self,
        mm: mmap.mmap,
        *,
        group_name: str,
        rank: int,
        world: int,
        slot_bytes: int,
        peers: dict[int, tuple[int, str | None]],
        timeout_s: float,
    ):
        self.mm = mm
        self.group_name, self.rank, self.world, self.slot = group_name, rank, world, slot_bytes
        self.peers = sorted(peers)
        self.procs = peers  # group rank -> (pid, start time; None: not checkable from here)
        self.timeout_s = timeout_s
        self.ctrl = np.frombuffer(mm, dtype=np.int64, count=_CTRL_BYTES // 8)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, offset=_CTRL_BYTES, count=2 * world * slot_bytes)
        self.data = self.data.view(2, world, slot_bytes)
        self.k = 0  # rounds run
        # Why the group's shared memory is unusable (a peer died or timed out, or a round was
        # interrupted): the ranks' counters no longer agree, so a later round could read stale
        # slots. Every later collective raises instead.
        self.broken: str | None = None
        self._views: dict[tuple[int, int, torch.dtype], tuple[torch.Tensor, list[torch.Tensor]]] = {}

    # ------------------------------------------------------------------ rounds

    def _rounds(
        self, total: int, step: int, dtype: torch.dtype, write: _Write, read: _Read, what: str
    ) -> None:
        """Run ``total`` elements of ``dtype`` in rounds of at most ``step``: ``write(s, e, mine)``,
        then for each peer ``read(s, e, peer, theirs)``, where ``mine`` and ``theirs`` are the
        round's slots cut to ``e - s`` elements."""
        if self.broken is not None:
            raise CollectiveError(
                f"spmd: shared-memory {what} on process group {self.group_name!r}: the group failed "
                f"earlier ({self.broken}), so its ranks no longer agree on where they are. Restart the "
                "job (or resume from a checkpoint)."
            )
        try:
            self._run_rounds(total, step, dtype, write, read, what)
        except BaseException as e:
            self.broken = f"{type(e).__name__} during a {what}"
            raise

    def _run_rounds(
        self, total: int, step: int, dtype: torch.dtype, write: _Write, read: _Read, what: str
    ) -> None:
        ctrl, r = self.ctrl, self.rank
        for s in range(0, total, step):
            e = min(total, s + step)
            self.k += 1
            k = self.k
            if k > 2:
                for p in self.peers:
                    if ctrl[_DONE + p * _LINE] < k - 2:
                        self._wait(_DONE + p * _LINE, k - 2, p, what)
            mine, theirs = self._slots(k & 1, e - s, dtype)
            write(s, e, mine)
            ctrl[_PUB + r * _LINE] = k
            for p, slot in zip(self.peers, theirs):
                if ctrl[_PUB + p * _LINE] < k:
                    self._wait(_PUB + p * _LINE, k, p, what)
                read(s, e, p, slot)
            ctrl[_DONE + r * _LINE] = k

    def _slots(self, parity: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This rank's slot and its peers' (in ``peers`` order) of ``parity``, as ``n`` elements of
        ``dtype``. Cached: a step's collectives come back with the same sizes every call, and
        making the views is most of a small collective's cost."""
        key = (parity, n, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 1024:
                self._views.clear()
            typed = self.data[parity].view(dtype)
            views = self._views[key] = (typed[self.rank, :n], [typed[p, :n] for p in self.peers])
        return views

    def _wait(self, at: int, k: int, peer: int, what: str) -> None:
        ctrl = self.ctrl
        start = time.monotonic()
        check = start + _CHECK_S
        while ctrl[at] < k:
            now = time.monotonic()
            if now - start < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(_SLEEP_S)
            if now >= check:
                check = now + _CHECK_S
                self._check(peer, what, now - start)

    def _check(self, peer: int, what: str, waited: float) -> None:
        pid, started = self.procs[peer]
        if started is not None and _start_time(pid) != started:
            raise CollectiveError(
                f"spmd: rank {peer} of process group {self.group_name!r} (pid {pid}) exited while rank "
                f"{self.rank} waited for it in a shared-memory {what}. A peer rank died: look for its "
                "error above; restart the job (or resume from a checkpoint)."
            )
        if waited > self.timeout_s:
            raise CollectiveError(
                f"spmd: shared-memory {what} on process group {self.group_name!r} timed out after "
                f"{waited:.0f} s: rank {peer} never joined. A rank hung or ran a different step "
                "(different collectives); look for a rank that raised or diverged. To run on gloo "
                "instead, set SPMD_SHM=0."
            )

    # ------------------------------------------------------------------ collectives

    def _step(self, dtype: torch.dtype, parts: int = 1) -> int:
        """Elements of ``dtype`` a round moves when a rank's slot holds ``parts`` pieces."""
        return max(1, self.slot // parts // _ALIGN * _ALIGN // dtype.itemsize)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty([x.shape[0] * self.world, *x.shape[1:]])
        xf = _flat(x)
        n = xf.numel()
        of = _flat(out).view(self.world, n)

        def write(s: int, e: int, mine: torch.Tensor) -> None:
            mine.copy_(xf if e - s == n else xf[s:e])

        def read(s: int, e: int, p: int, theirs: torch.Tensor) -> None:
            (of[p] if e - s == n else of[p, s:e]).copy_(theirs)

        of[self.rank].copy_(xf)
        self._rounds(n, self._step(xf.dtype), xf.dtype, write, read, "all_gather")
        return out

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        sending = self.rank == src
        keep = torch.contiguous_format
        out = x.clone(memory_format=keep) if sending else torch.empty_like(x, memory_format=keep)
        of = _flat(out)

        def write(s: int, e: int, mine: torch.Tensor) -> None:
            if sending:
                mine.copy_(of[s:e])

        def read(s: int, e: int, p: int, theirs: torch.Tensor) -> None:
            if p == src:
                of[s:e].copy_(theirs)

        self._rounds(of.numel(), self._step(of.dtype), of.dtype, write, read, "broadcast")
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        w, r = self.world, self.rank
        xv = _flat(x).view(w, -1)
        ov = _flat(out).view(w, -1)
        ov[r].copy_(xv[r])
        # A round's slot holds one piece for each rank, at offset rank x piece.

        def write(s: int, e: int, mine: torch.Tensor) -> None:
            n = (e - s) // w
            for p in self.peers:
                mine[p * n : (p + 1) * n].copy_(xv[p, s // w : s // w + n])

        def read(s: int, e: int, p: int, theirs: torch.Tensor) -> None:
            n = (e - s) // w
            ov[p, s // w : s // w + n].copy_(theirs[r * n : (r + 1) * n])

        # Rounds over w pieces at once: ``s`` and ``e`` count the w pieces' elements together.
        step = self._step(xv.dtype, w) * w
        self._rounds(xv.numel(), step, xv.dtype, write, read, "all_to_all_single")
        return out

    def _sum_rounds(self, send: torch.Tensor, own: torch.Tensor, out: torch.Tensor, what: str) -> None:
        """``out = own + (the peer's send)`` elementwise, two ranks; ``send``, ``own``, ``out`` flat."""
        n = send.numel()

        def write(s: int, e: int, mine: torch.Tensor) -> None:
            mine.copy_(send if e - s == n else send[s:e])

        def read(s: int, e: int, p: int, theirs: torch.Tensor) -> None:
            # Two ranks: one addition, commutative, so these are gloo's bits whichever rank adds.
            if e - s == n:
                torch.add(own, theirs, out=out)
            else:
                torch.add(own[s:e], theirs, out=out[s:e])

        self._rounds(n, self._step(send.dtype), send.dtype, write, read, what)

    def all_reduce(self, x: torch.Tensor, op: str, out: torch.Tensor) -> torch.Tensor:
        assert self.world == 2 and op in ("sum", "avg"), (self.world, op)
        flat_in = x.contiguous().view(-1)
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        flat_out = target.view(-1)
        self._sum_rounds(flat_in, flat_in, flat_out, "all_reduce")
        if op == "avg":
            flat_out.div_(self.world)
        if target is not out:
            out.copy_(target)
        return out

    def reduce_scatter(self, x: torch.Tensor, op: str) -> torch.Tensor:
        assert self.world == 2 and op in ("sum", "avg"), (self.world, op)
        x = x.contiguous()
        out = x.new_empty([x.shape[0] // self.world, *x.shape[1:]])
        chunks = x.view(self.world, -1)
        self._sum_rounds(chunks[1 - self.rank], chunks[self.rank], out.view(-1), "reduce_scatter_tensor")
        if op == "avg":
            out.div_(self.world)
        return out


# ----------------------------------------------------------------------------- setup

# group name -> the default group it was made under (a re-initialized job's names are reused).
_MADE_UNDER: dict[str, object] = {}


def candidate_groups(gm: fx.GraphModule) -> dict[str, int]:
    """Name -> size of the process groups of ``gm``'s CPU collectives that may run through shared
    memory (:func:`candidates`); the pipeline's ``shared_memory_collectives`` puts them there, and
    :func:`settle` makes the transports once the ranks agreed on the final graph."""
    names: dict[str, None] = {}
    for c in C.collectives(gm.graph):
        v = c.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            names.setdefault(C.group_of(c))
    if not names or not dist.is_initialized():
        return {}
    return candidates(list(names))


def candidates(names: Sequence[str]) -> dict[str, int]:
    """Name -> size of the groups among ``names`` that may have shared memory, as far as this rank
    can tell alone (no collective): gloo groups of 2 to 64 ranks, shared memory usable here, and
    not refused at an earlier setup. Whether every rank of a group runs on this host is decided
    by :func:`transports`, collectively."""
    if _enabled_here() is not None:
        return {}
    _forget_old_groups()
    out = {}
    for name in names:
        try:
            g = torch_compat.resolve_process_group(name)
            size = dist.get_world_size(g)
            gloo = str(dist.get_backend(g)) == "gloo"
        except (RuntimeError, ValueError, KeyError):
            continue
        refused = name in _MADE_UNDER and name not in shm_ops.TRANSPORTS
        if gloo and 2 <= size <= _MAX_WORLD and not refused:
            out[name] = size
    return out


def settle(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the transports of the groups ``gm``'s shared-memory collectives run on (collectively:
    call it where every rank has the same final graph, after the rank-agreement check); a group
    that cannot have one (its ranks on several hosts, no room in ``/dev/shm``) goes back to gloo
    on every one of its ranks, which all get the same answer. Returns ``gm`` (changed in place)."""
    names = {C.group_of(c) for c in C.collectives(gm.graph) if C.is_shared_memory(c)}
    if not names:
        return gm
    made = transports([torch_compat.resolve_process_group(n) for n in _in_creation_order(names)])
    refused = names - set(made)
    if refused:
        restore_gloo(gm, refused)
    return gm


def _in_creation_order(names: set[str]) -> list[str]:
    """The groups in the order torch made them (their names count up), the same on every rank, so
    two ranks setting up the groups they share never wait on each other in opposite orders."""
    return sorted(names, key=lambda n: (0, int(n), "") if n.isdigit() else (1, 0, n))


def _forget_old_groups() -> None:
    default = torch_compat.get_default_group()
    for name in [n for n, g in _MADE_UNDER.items() if g is not default]:
        shm_ops.TRANSPORTS.pop(name, None)
        _MADE_UNDER.pop(name)


def transports(groups: Sequence[dist.ProcessGroup]) -> dict[str, int]:
    """Set up (collectively, on each group's ranks, in the order given) the shared memory of every
    gloo group in ``groups`` whose ranks all run on this host; returns name -> size of the groups
    that have it. Made once per group; every rank of a group gets the same answer."""
    _forget_old_groups()
    default = torch_compat.get_default_group()
    out: dict[str, int] = {}
    for g in groups:
        name = g.group_name
        if name not in _MADE_UNDER:
            _MADE_UNDER[name] = default
            region = _set_up(g)
            if region is not None:
                shm_ops.TRANSPORTS[name] = region
        if name in shm_ops.TRANSPORTS:
            out[name] = dist.get_world_size(g)
    return out


def _set_up(g: dist.ProcessGroup) -> Region | None:
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    if world < 2 or str(dist.get_backend(g)) != "gloo":
        return None
    why = _enabled_here()
    me = (why, _host_id(), os.getpid(), _start_time(os.getpid()))
    everyone: list[tuple[str | None, str, int, str | None]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, me, group=g)
    reasons = {w for w, *_ in everyone if w is not None}
    if reasons or len({h for _, h, _, _ in everyone}) != 1:
        log.info(
            "spmd: process group %r keeps gloo for its collectives (%s)",
            g.group_name,
            "; ".join(sorted(reasons)) if reasons else "its ranks run on more than one host",
        )
        return None
    slot = max(_ALIGN * 1024, min(_SLOT_BYTES, (64 << 20) // (2 * world)))
    size = _CTRL_BYTES + 2 * world * slot
    made: list[object] = [None, 0]
    mm: mmap.mmap | None = None
    if rank == 0:
        made, mm = _create(size, g.group_name)
    dist.broadcast_object_list(made, src=dist.get_global_rank(g, 0), group=g)
    path, token = made
    if path is not None and rank != 0:
        mm = _open(str(path), size, token)
    ok = [False] * world
    dist.all_gather_object(ok, mm is not None, group=g)
    if rank == 0 and path is not None:
        os.unlink(str(path))  # every rank has it mapped or has given up: nothing stays in /dev/shm
    if not all(ok):
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: the map goes with it
                mm.close()
        return None
    assert mm is not None
    peers = {}
    for p, (_, _, pid, started) in enumerate(everyone):
        if p != rank:
            peers[p] = (pid, started if _start_time(pid) == started else None)
    timeout = torch_compat.pg_timeout_s(g) or 1800.0
    log.info(
        "spmd: process group %r runs its collectives through shared memory (%d ranks)", g.group_name, world
    )
    return Region(
        mm, group_name=g.group_name, rank=rank, world=world, slot_bytes=slot, peers=peers, timeout_s=timeout
    )


def _create(size: int, group_name: str) -> tuple[list[object], mmap.mmap | None]:
    """The group's first rank: make the file (space reserved), map it, sign it."""
    path = f"/dev/shm/spmd-{uuid.uuid4().hex}"
    token = secrets.randbits(62)
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    except OSError as e:
        log.info("spmd: no shared memory for process group %r (%s); it keeps gloo", group_name, e)
        if fd >= 0:
            os.unlink(path)
        return [None, 0], None
    finally:
        if fd >= 0:
            os.close(fd)
    header = np.frombuffer(mm, dtype=np.int64, count=2)
    header[0], header[1] = _MAGIC, token
    return [path, token], mm


def _open(path: str, size: int, token: object) -> mmap.mmap | None:
    """Another rank: map the file and check it is the one its first rank signed."""
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError as e:
        log.info("spmd: cannot map %s (%s); the group keeps gloo", path, e)
        return None
    header = np.frombuffer(mm, dtype=np.int64, count=2)
    signed = int(header[0]) == _MAGIC and int(header[1]) == token
    del header  # an exported buffer would keep mm.close() from closing
    if not signed:
        with contextlib.suppress(BufferError):
            mm.close()
        return None
    return mm
