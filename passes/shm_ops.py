"""The shared-memory collectives: ops with the functional collectives' signatures, run by a transport.

``torch.ops.spmd_shm.<op>`` takes exactly the arguments of ``torch.ops._c10d_functional.<op>``
(the group's name last), so every reader of the collective vocabulary (``passes.collectives``:
kinds, groups, bytes, reduce ops, group sizes) reads them unchanged. What differs is when the
data moves: the op returns its finished result (the collective ran in the caller's thread, through
memory the ranks of one host share), and the ``wait_tensor`` after it returns its argument.

The CPU kernel looks the group's transport up in :data:`TRANSPORTS` (filled by
``spmd.backend.shm``, which owns the shared memory): this module holds only the schemas, the fake
kernels (for shape propagation) and that table, so ``passes`` keeps no runtime state of its own.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Transport(Protocol):
    """What a group's shared-memory transport runs (``spmd.backend.shm.Region``)."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_reduce(self, x: torch.Tensor, op: str, out: torch.Tensor) -> torch.Tensor: ...
    def reduce_scatter(self, x: torch.Tensor, op: str) -> torch.Tensor: ...
    def all_to_all(self, x: torch.Tensor) -> torch.Tensor: ...
    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor: ...


# group name -> its transport; a group absent here has no shared memory (its ops are never emitted).
TRANSPORTS: dict[str, Transport] = {}


def _transport(group_name: str) -> Transport:
    t = TRANSPORTS.get(group_name)
    if t is None:
        raise RuntimeError(
            f"spmd_shm: process group {group_name!r} has no shared-memory transport in this process "
            "(the graph was rewritten for it, then the transport was closed)"
        )
    return t


_LIB = torch.library.Library("spmd_shm", "DEF")
_LIB.define("all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor")
_LIB.define("all_reduce_(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)")
_LIB.define("all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor")
_LIB.define("reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor")
_LIB.define(
    "all_to_all_single(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, "
    "str group_name) -> Tensor"
)
_LIB.define("broadcast(Tensor input, int src, str group_name) -> Tensor")


def _all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _transport(group).all_reduce(x, op, torch.empty_like(x, memory_format=torch.contiguous_format))


def _all_reduce_(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _transport(group).all_reduce(x, op, x)


def _all_gather(x: torch.Tensor, group_size: int, group: str) -> torch.Tensor:
    return _transport(group).all_gather(x)


def _reduce_scatter(x: torch.Tensor, op: str, group_size: int, group: str) -> torch.Tensor:
    return _transport(group).reduce_scatter(x, op)


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: str) -> torch.Tensor:
    return _transport(group).all_to_all(x)


def _broadcast(x: torch.Tensor, src: int, group: str) -> torch.Tensor:
    return _transport(group).broadcast(x, src)


for _name, _fn in (
    ("all_reduce", _all_reduce),
    ("all_reduce_", _all_reduce_),
    ("all_gather_into_tensor", _all_gather),
    ("reduce_scatter_tensor", _reduce_scatter),
    ("all_to_all_single", _all_to_all),
    ("broadcast", _broadcast),
):
    _LIB.impl(_name, _fn, "CPU")


def _gathered_shape(x: torch.Tensor, n: int) -> list[int]:
    return [x.shape[0] * n, *x.shape[1:]]


def _fakes() -> dict[str, Any]:
    return {
        "all_reduce": lambda x, op, g: torch.empty_like(x),
        "all_reduce_": lambda x, op, g: x,
        "all_gather_into_tensor": lambda x, n, g: x.new_empty(_gathered_shape(x, n)),
        "reduce_scatter_tensor": lambda x, op, n, g: x.new_empty([x.shape[0] // n, *x.shape[1:]]),
        "all_to_all_single": lambda x, o, i, g: x.new_empty([sum(o), *x.shape[1:]]),
        "broadcast": lambda x, src, g: torch.empty_like(x),
    }


for _name, _fake in _fakes().items():
    torch.library.register_fake(f"spmd_shm::{_name}", _fake, lib=_LIB)

_ops = torch.ops.spmd_shm
ALL_REDUCE = _ops.all_reduce.default
ALL_REDUCE_ = _ops.all_reduce_.default
ALL_GATHER = _ops.all_gather_into_tensor.default
REDUCE_SCATTER = _ops.reduce_scatter_tensor.default
ALL_TO_ALL = _ops.all_to_all_single.default
BROADCAST = _ops.broadcast.default
SHM_OPS = frozenset({ALL_REDUCE, ALL_REDUCE_, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST})
