"""spmd.parallel.layout: the memory order a sharded parameter is collected in."""

from __future__ import annotations

import torch

from spmd.parallel import layout


def test_memory_order_of_channels_last() -> None:
    w = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
    perm = layout.memory_order(w)
    assert perm == [0, 2, 3, 1] and w.permute(perm).is_contiguous()
    assert w.permute(perm).permute(layout.inverse(perm)).stride() == w.stride()
    w3 = torch.randn(4, 2, 3, 3, 3).to(memory_format=torch.channels_last_3d)
    assert layout.memory_order(w3) == [0, 2, 3, 4, 1]


def test_other_layouts_keep_logical_order() -> None:
    assert layout.memory_order(torch.randn(8, 3, 3, 3)) is None  # contiguous
    assert layout.memory_order(torch.randn(8, 3)) is None
    assert layout.memory_order(torch.randn(3, 8).t()) is None  # transposed: dim 0 not outermost
    # 1x1 kernels: channels_last memory is the contiguous memory (size-1 dims), nothing to permute
    assert layout.memory_order(torch.randn(8, 4, 1, 1).to(memory_format=torch.channels_last)) is None
