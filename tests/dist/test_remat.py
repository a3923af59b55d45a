"""remat= on 2 real gloo ranks: fully_shard (reshard after forward) of a tiny Hugging Face Llama,
different data per rank, every policy bit for bit with remat=None, and the recompute gathers
its parameters in backward with no more gathers per step after bucketing."""

from __future__ import annotations

import pytest
import torch

from tests.dist import workers_remat
from tests.dist.launcher import run_ranks

POLICIES = [None, "selective", 0.5, "full"]


@pytest.mark.timeout(900)
def test_llama_fully_shard_policies_bit_for_bit() -> None:
    pytest.importorskip("transformers")
    results = run_ranks(workers_remat.llama_policies, 2, POLICIES, timeout=840)
    for rank, res in enumerate(results):
        ref = res["None"]
        assert ref["recomputed"] == 0
        for policy in POLICIES[1:]:
            got = res[str(policy)]
            assert got["recomputed"] > 0, f"rank {rank} remat={policy}: nothing recomputed"
            assert got["gathers"] == ref["gathers"], f"rank {rank} remat={policy}: gathers"
            for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                assert torch.equal(a, b), f"rank {rank} remat={policy}: loss {i}"
            for i, (a, b) in enumerate(zip(got["params"], ref["params"])):
                assert torch.equal(a, b), f"rank {rank} remat={policy}: parameter {i}"
