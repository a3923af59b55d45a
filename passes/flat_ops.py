"""The ops of a unit's flat communication buffer: all-gather copy-in and copy-out.

A unit's all-gather sends one flat buffer per rank: the concatenation of the rank's shards,
each padded to the unit's equal chunk size (FSDP2's ``all_gather_copy_in``). What comes back
is ``W`` such blocks, one per rank; copy-out cuts every full parameter out of them at once
(FSDP2's ``split_with_sizes_copy``). Two nodes, however many parameters the unit has and
however ragged their shards are, instead of a pad per shard and a slice, split piece and
copy per parameter.

``spmd::all_gather_copy_in(shards, chunk_numels, dtype)``: shard ``k`` (any strides: it is
read in logical order, so a channels_last shard is passed permuted to memory order) is cast
to ``dtype`` and written at offset ``sum(chunk_numels[:k])``; the rest of its chunk (the
padding of an uneven or empty shard) is zero.

``spmd::all_gather_copy_out(gathered, world, chunk_numels, shapes, ranks)``: ``gathered`` is
``world`` blocks of ``sum(chunk_numels)``; output ``k`` is the contiguous tensor of shape
``shapes[k]`` (``ranks[k]`` dims, flattened into ``shapes``) whose elements are the first
``prod(shape)`` elements of the concatenation of block ``r``'s piece ``k`` over ``r``: the
full parameter with the padding of every shard dropped.

Cost per call: both ops are defined with :class:`torch.library.Library` and one
``CompositeExplicitAutograd`` Python kernel each, so a call is one C++ dispatch into that kernel
(``torch.library.custom_op``'s Python wrappers cost ~70 us a call; ``int[]`` arguments, not
``SymInt[]``, another ~10 us), and each kernel makes one C++ call for all its tensors: copy-in one
``flatten_dense_tensors`` (c10d's bucket flattener: every shard flattened and concatenated), copy-out
one ``split_with_sizes_copy`` that allocates the pieces, then a ``reshape`` (a view) per parameter.
What is left per parameter is making the tensors themselves (~1 us each on a CPU):
``benchmarks/profiles/flat_copy_overhead.py`` measures it.

The reduce-scatter side needs no op of ours: ``aten._chunk_cat(grads, 0, W)`` packs full
gradients into the padded ``(W, sum of chunks)`` layout the reduce-scatter sends, and each
gradient shard is an ``as_strided`` view of the flat result (see :mod:`passes.bucketing`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import cast

import torch

from passes import torch_compat

# Without ``out=`` it returns the pieces (torch's stubs say None).
_split_copy = cast(Callable[..., list[torch.Tensor]], torch.split_with_sizes_copy)


def _shapes(shapes: list[int], ranks: list[int]) -> list[list[int]]:
    out, i = [], 0
    for r in ranks:
        out.append(list(shapes[i : i + r]))
        i += r
    return out


def _all_gather_copy_in(
    shards: list[torch.Tensor], chunk_numels: list[int], dtype: torch.dtype
) -> torch.Tensor:
    # One C++ call flattens and concatenates every shard (a slice, view and copy per shard made
    # this op most of its own cost on a stack of tiny blocks). A short or empty shard is followed
    # by a slice of one zero buffer that fills its chunk.
    pieces = shards
    numels = list(map(torch.Tensor.numel, shards))
    if numels != chunk_numels:
        zeros = shards[0].new_zeros(max(c - n for n, c in zip(numels, chunk_numels)))
        pieces = []
        for x, n, c in zip(shards, numels, chunk_numels):
            pieces.append(x)
            if n < c:
                pieces.append(zeros[: c - n])
    if len(pieces) == 1:  # flatten_dense_tensors would return a view of the one shard
        return pieces[0].reshape(-1).to(dtype, copy=True)
    # Mixed shard dtypes concatenate in their promoted type (every value exact in it), then one
    # cast rounds each value once, as a copy_ into the buffer per shard would.
    flat = torch_compat.flatten_dense_tensors(pieces)
    return flat if flat.dtype == dtype else flat.to(dtype)


@functools.lru_cache(maxsize=1024)
def _out_plan(
    world: int, chunk_numels: tuple[int, ...], shapes: tuple[int, ...], ranks: tuple[int, ...]
) -> tuple[list[list[int]], list[int | None], bool]:
    """Each output's shape, its element count where its ``world`` chunks hold padding (``None``:
    they hold exactly the parameter), and whether none does. Once per distinct unit, not per call."""
    full = _shapes(list(shapes), list(ranks))
    cuts = [None if math.prod(s) == world * c else math.prod(s) for s, c in zip(full, chunk_numels)]
    return full, cuts, all(n is None for n in cuts)


def _all_gather_copy_out(
    gathered: torch.Tensor, world: int, chunk_numels: list[int], shapes: list[int], ranks: list[int]
) -> list[torch.Tensor]:
    # One split_with_sizes_copy (FSDP2's copy-out) allocates every piece and fills it: piece k
    # holds chunk k of every block in block order, i.e. the full parameter followed by the
    # padding of the last blocks, which a leading-``n`` view drops (the output is then a view of
    # a slightly larger buffer). Per parameter only a reshape of a fresh contiguous piece (a view).
    full, cuts, exact = _out_plan(world, tuple(chunk_numels), tuple(shapes), tuple(ranks))
    pieces = _split_copy(gathered.view(world, sum(chunk_numels)), chunk_numels, dim=1)
    if exact:
        return list(map(torch.reshape, pieces, full))
    return [p.reshape(s) if n is None else p.view(-1)[:n].view(s) for p, s, n in zip(pieces, full, cuts)]


_LIB = torch.library.Library("spmd", "FRAGMENT")
_LIB.define("all_gather_copy_in(Tensor[] shards, int[] chunk_numels, ScalarType dtype) -> Tensor")
_LIB.define(
    "all_gather_copy_out(Tensor gathered, int world, int[] chunk_numels, int[] shapes, int[] ranks) "
    "-> Tensor[]"
)
_LIB.impl("all_gather_copy_in", _all_gather_copy_in, "CompositeExplicitAutograd")
_LIB.impl("all_gather_copy_out", _all_gather_copy_out, "CompositeExplicitAutograd")


@torch.library.register_fake("spmd::all_gather_copy_in", lib=_LIB)
def _(shards: list[torch.Tensor], chunk_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    return shards[0].new_empty(sum(chunk_numels), dtype=dtype)


@torch.library.register_fake("spmd::all_gather_copy_out", lib=_LIB)
def _(
    gathered: torch.Tensor, world: int, chunk_numels: list[int], shapes: list[int], ranks: list[int]
) -> list[torch.Tensor]:
    return [gathered.new_empty(s) for s in _shapes(shapes, ranks)]


COPY_IN = torch.ops.spmd.all_gather_copy_in.default
COPY_OUT = torch.ops.spmd.all_gather_copy_out.default
