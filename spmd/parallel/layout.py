"""Memory formats of sharded parameters: collect and reduce in memory order.

A parameter in another memory format than the default (a conv weight after
``model.to(memory_format=torch.channels_last)``: shape ``(O, I, kh, kw)``, strides
``(I*kh*kw, 1, kw*I, I)``) keeps dim 0 outermost in memory, so its ``Shard(0)`` pieces are
still contiguous runs of memory. A collective, though, works on the logical (row-major)
order: all-gathering the shards gives a contiguous full tensor, and convolutions then run
with a weight in another format than the user's (and DDP's) model. So the partitioner moves
every sharded tensor of such a parameter into *memory order* first, a ``permute`` that is a
view of the shard (``(O, kh, kw, I)`` contiguous), gathers or reduce-scatters that, and
permutes the result back, again a view: the gathered parameter, and the reduced gradient
shard, have the parameter's own strides. Legal: the permutation keeps dim 0 first, so
padding, chunking and slicing rows mean the same rows in both orders; a permute moves no
value.

The fused-optimizer alignment (:func:`spmd.parallel.sharded_optim.align_fused_optimizer`)
flattens shards in the same memory order, so an element's position in the flattened buffer
is its position in memory, as in the kernel DDP runs on the full tensor.
"""

from __future__ import annotations

import torch

_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def memory_order(t: torch.Tensor) -> list[int] | None:
    """The dim permutation that lists a channels-last ``t``'s dims outermost first in memory
    (``[0, 2, 3, 1]`` for channels_last, ``[0, 2, 3, 4, 1]`` for channels_last_3d), so that
    ``t.permute(perm)`` is contiguous; None for a contiguous tensor or any other layout
    (collected in logical order, as a contiguous tensor is).

    Both keep dim 0 outermost, so a dim-0 shard is one run of memory in either order.
    """
    fmt = _FORMATS.get(t.dim())
    if fmt is None or t.is_contiguous() or not t.is_contiguous(memory_format=fmt):
        return None
    return [0, *range(2, t.dim()), 1]


def inverse(perm: list[int]) -> list[int]:
    """The permutation that undoes ``perm``."""
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return inv
