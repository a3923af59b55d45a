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

The reduce-scatter side needs no op of ours: ``aten._chunk_cat(grads, 0, W)`` packs full
gradients into the padded ``(W, sum of chunks)`` layout the reduce-scatter sends, and each
gradient shard is an ``as_strided`` view of the flat result (see :mod:`passes.bucketing`).
"""

from __future__ import annotations

import math

import torch


def _shapes(shapes: list[int], ranks: list[int]) -> list[list[int]]:
    out, i = [], 0
    for r in ranks:
        out.append(list(shapes[i : i + r]))
        i += r
    return out


@torch.library.custom_op("spmd::all_gather_copy_in", mutates_args=())
def all_gather_copy_in(
    shards: list[torch.Tensor], chunk_numels: list[int], dtype: torch.dtype
) -> torch.Tensor:
    if any(x.dtype != dtype for x in shards):  # a cast (mixed precision): copy_ casts per shard
        out = shards[0].new_empty(sum(chunk_numels), dtype=dtype)
        off = 0
        for x, c in zip(shards, chunk_numels):
            n = x.numel()
            out[off : off + n].view(x.shape).copy_(x)
            if n < c:
                out[off + n : off + c].zero_()
            off += c
        return out
    # One cat instead of a slice, view and copy per shard: this op runs once per unit and
    # phase, and on a stack of tiny blocks its per-shard Python ops were most of its cost.
    pieces: list[torch.Tensor] = []
    for x, c in zip(shards, chunk_numels):
        n = x.numel()
        if n:
            pieces.append(x.reshape(-1))  # logical order (a copy only for a non-viewable shard)
        if n < c:
            pieces.append(x.new_zeros(c - n))
    if not pieces:
        return shards[0].new_empty(0, dtype=dtype)
    return torch.cat(pieces)


@all_gather_copy_in.register_fake
def _(shards: list[torch.Tensor], chunk_numels: list[int], dtype: torch.dtype) -> torch.Tensor:
    return shards[0].new_empty(sum(chunk_numels), dtype=dtype)


@torch.library.custom_op("spmd::all_gather_copy_out", mutates_args=())
def all_gather_copy_out(
    gathered: torch.Tensor, world: int, chunk_numels: list[int], shapes: list[int], ranks: list[int]
) -> list[torch.Tensor]:
    # Every piece lands in its output with one split_with_sizes_copy (FSDP2's copy-out): per
    # parameter only an allocation and views. Output k holds piece k of every block in block
    # order, i.e. the full parameter followed by the padding of the last blocks, which a
    # leading-``n`` view drops (the output is then a view of a slightly larger buffer).
    outs, dests = [], []
    for c, shape in zip(chunk_numels, _shapes(shapes, ranks)):
        n = math.prod(shape)
        if n == world * c:
            out = gathered.new_empty(shape)
            dests.append(out.view(world, c))
        else:
            buf = gathered.new_empty(world * c)
            dests.append(buf.view(world, c))
            out = buf[:n].view(shape)
        outs.append(out)
    torch.split_with_sizes_copy(gathered.view(world, sum(chunk_numels)), chunk_numels, dim=1, out=dests)
    return outs


@all_gather_copy_out.register_fake
def _(
    gathered: torch.Tensor, world: int, chunk_numels: list[int], shapes: list[int], ranks: list[int]
) -> list[torch.Tensor]:
    return [gathered.new_empty(s) for s in _shapes(shapes, ranks)]


COPY_IN = torch.ops.spmd.all_gather_copy_in.default
COPY_OUT = torch.ops.spmd.all_gather_copy_out.default
