"""The chunked loss head (passes.chunked_loss) on 2 gloo ranks against DDP.

One chunk is the unchunked head's ops: the parameters equal DDP's bit for bit (fully_shard).
Chunks of 5 tokens change the summation order of the loss and of the head's weight gradient:
within the documented tolerance (docs/loss-head.md) of DDP after 3 SGD steps.
"""

from __future__ import annotations

import pytest

from tests.dist import workers_chunked_loss
from tests.dist.launcher import run_ranks

# A few float32 ulps of the largest values, grown through 3 momentum-SGD steps: the loss and
# parameters are O(1); torch.testing's float32 atol (1e-5) bounds them.
ATOL = 1e-5


@pytest.mark.timeout(600)
def test_fully_shard_chunked_head_against_ddp() -> None:
    ranks = run_ranks(workers_chunked_loss.against_ddp, 2, "fully_shard", [10_000, 5], 3, timeout=540)
    one, five = zip(*ranks)
    assert all(r["heads"] == 1 and r["worst"] == 0.0 for r in one), one
    assert all(r["heads"] == 1 and r["tokens"] % 5 for r in five), five  # uneven last chunk
    assert max(r["worst"] for r in five) <= ATOL, five
