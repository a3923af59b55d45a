"""How each quantity is measured, the same way for every variant (eager, DDP, FSDP2, spmd).

* Collectives and their bytes: one extra step under ``torch.profiler`` (CPU activity,
  ``record_shapes``). Every collective issued on a process group -- by DDP's C++ reducer,
  FSDP2's hooks or spmd's functional collectives -- passes through a ``c10d::<op>`` dispatcher
  op (counted: one per launch, a coalesced op is one), and the gloo backend records a
  ``gloo:<algorithm>`` event with the shapes and dtypes of what it sends (summed for bytes).
  Bytes follow ``passes.collectives.bytes_of`` (the larger side: all-reduce and reduce-scatter
  count their input, all-gather its output) so they compare with spmd's ``report()``. Gloo
  runs a reduce-scatter as an all-reduce of the whole input, whose bytes are that input: the
  same number. A collective through shared memory (``passes.shm_collectives``) is its own
  ``spmd_shm::<op>`` event, counted by its input the same way.
* Wire bytes: the growth of ``wchar`` in ``/proc/self/io`` (bytes this process passed to
  ``write``-family system calls; gloo's TCP transport writes with ``writev``) over the timed
  steps. Nothing else writes during them. This is what actually left the rank (ring
  algorithms, gloo's all-reduce-based reduce-scatter, headers); through shared memory, nothing.
* Peak memory: one extra step under ``torch.distributed._tools.mem_tracker.MemTracker``, with
  the model and optimizer registered by ``track_external``: the peak of live tensor bytes
  (parameters, gradients, optimizer state, and everything allocated during the step, FSDP2's
  unsharded parameters and spmd's gathered ones included). Not seen: buffers a library
  allocates in C++ outside any op (DDP's gradient buckets, 1x the parameter bytes) and the
  allocator's caching. It slows the step, so it runs outside the timed steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# c10d dispatcher ops that launch one collective each (torch/csrc/distributed/c10d/Ops.cpp).
_C10D_COLLECTIVES = {
    "allreduce_",
    "allreduce_coalesced_",
    "_allgather_base_",
    "allgather_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "broadcast_",
    "reduce_",
    "gather_",
    "scatter_",
    "alltoall_",
    "alltoall_base_",
}

_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::Half": 2,
    "c10::BFloat16": 2,
    "long int": 8,
    "int": 4,
    "short int": 2,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


@dataclasses.dataclass(frozen=True)
class CommCount:
    """Collectives of one step, as the profiler saw them on this rank."""

    launches: int  # c10d collectives issued (a coalesced op is one)
    bytes: int  # larger-side bytes (see the module docstring)
    by_kind: dict[str, tuple[int, int]]  # c10d op -> (launches, bytes)
    backend_ops: int  # gloo work items (gloo splits some coalesced ops into several)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _family(op: str) -> str:
    """The gloo algorithm a c10d op runs as (gloo reduce-scatters with an all-reduce)."""
    if "gather" in op:
        return "all_gather"
    if "alltoall" in op or "all_to_all" in op:  # c10d alltoall_base_, gloo:all_to_all
        return "all_to_all"
    if "reduce" in op:  # allreduce*, reduce_scatter*, reduce_
        return "all_reduce"
    return op.strip("_")


def count_comms(run_step: Callable[[], Any], world_size: int) -> CommCount:
    """Run ``run_step`` once under the profiler and count its collectives."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run_step()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())  # type: ignore[union-attr]
    ops: list[str] = []
    by_kind: dict[str, list[int]] = {}
    last: dict[str, str] = {}  # gloo algorithm family -> the c10d op of that family issued last
    total = backend_ops = 0
    for e in events:
        name = e.name()
        if name.startswith("c10d::") and name[len("c10d::") :] in _C10D_COLLECTIVES:
            op = name[len("c10d::") :]
            ops.append(op)
            by_kind.setdefault(op, [0, 0])[0] += 1
            last[_family(op)] = op
        elif name.startswith("spmd_shm::"):
            # A collective through shared memory (passes.shm_collectives): no c10d op and no gloo
            # event; its own op records its input (the first shape and dtype).
            op = name
            ops.append(op)
            nbytes = _numel(e.shapes()[0]) * _DTYPE_BYTES.get(e.dtypes()[0], 4)
            if "all_gather" in name:
                nbytes *= world_size
            kind = by_kind.setdefault(op, [0, 0])
            kind[0] += 1
            kind[1] += nbytes
            total += nbytes
            backend_ops += 1
        elif name.startswith("gloo:"):
            nbytes = sum(
                _numel(s) * _DTYPE_BYTES.get(d, 4)
                for s, d in zip(e.shapes(), e.dtypes())
                if isinstance(s, list)
            )
            if name.startswith("gloo:all_gather"):
                nbytes *= world_size  # gloo records the input; count the gathered output
            total += nbytes
            backend_ops += 1
            # gloo records its work when a worker thread runs it, possibly after later ops were
            # issued: charge the last issued op that gloo runs with this algorithm.
            op = last.get(_family(name[len("gloo:") :]))
            if op is not None:
                by_kind[op][1] += nbytes
    return CommCount(
        launches=len(ops),
        bytes=total,
        by_kind={k: (v[0], v[1]) for k, v in by_kind.items()},
        backend_ops=backend_ops,
    )


def written_bytes() -> int:
    """This process's ``wchar`` (bytes passed to write-family system calls), or -1 if unreadable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def peak_memory(run_step: Callable[[], Any], model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Peak live tensor bytes of one step on this rank, by ``MemTracker`` (see the module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, optim)
    with mt:
        run_step()
    snap = mt.get_tracker_snapshot("peak")
    return int(sum(v.get("Total", 0) for v in snap.values()))


def params_saved_for_backward(
    model: torch.nn.Module, forward_loss: Callable[[torch.nn.Module], torch.Tensor]
) -> set[str]:
    """Names of the parameters autograd saves for backward (directly or as a view, e.g. ``W.t()``).

    Under FULL_SHARD exactly these must be gathered a second time for backward; the others
    (biases, embedding tables) need not be. Found with ``saved_tensors_hooks`` on one eager
    forward of an unwrapped model, so it does not depend on any of the variants measured.
    """
    by_storage = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    saved: set[str] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            name = by_storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            name = None
        if name is not None:
            saved.add(name)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_loss(model)
    return saved
