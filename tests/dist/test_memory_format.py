"""Memory formats in every style: a channels_last conv net against DDP.

Collectives work in logical order, so a gathered channels_last conv weight came back
contiguous and convolutions ran with a weight in another format than DDP's (a reported 1e-3
parameter gap after 3 SGD steps on another machine; on this CPU both formats happen to round
alike). spmd gathers and reduce-scatters such parameters in memory order
(:mod:`spmd.parallel.layout`): the test checks bit-for-bit parity and, since the values alone
may not show it here, the strides of the parameters the graph gathers and of the gradient
shards it reduces.
"""

from __future__ import annotations

import pytest

from tests.dist import workers_memory_format
from tests.dist.launcher import run_ranks


@pytest.mark.timeout(300)
def test_channels_last_matches_ddp() -> None:
    cases = [
        ("replicate", "sgd_momentum_foreach"),
        ("replicate", "adamw_fused"),  # was 6e-2 off DDP: a contiguous gradient, channels_last weight
        ("replicate_unbucketed", "adamw_fused"),
        ("fully_shard", "sgd_momentum_foreach"),
        ("fully_shard", "adamw_fused"),  # fused alignment flattens shards in memory order
        ("hybrid_shard", "adamw_fused"),
    ]
    results = run_ranks(workers_memory_format.channels_last_parity, 2, cases, 3, timeout=240)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
