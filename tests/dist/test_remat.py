"""remat= on 2 real gloo ranks, one launch: a tiny Hugging Face Llama, different data per rank,
each policy bit for bit with remat=None of the same setting, something recomputed, fewer
activation bytes saved, and no more all-gathers per step after bucketing (the recompute reads
the backward gathers). Settings: fully_shard (reshard after forward) with every policy;
hybrid_shard with prefetch 2 units ahead; bf16 mixed precision (fp32 reduction) with two
micro-batches of gradient accumulation."""

from __future__ import annotations

import pytest
import torch

from tests.dist import workers_remat
from tests.dist.launcher import run_ranks

# (setting, policy, the setting whose remat=None run it must equal bit for bit). hybrid_shard
# over one replica of 2 ranks and a deeper prefetch change no value: fully_shard's bits.
CASES = [
    ("fully_shard", "selective", "fully_shard"),
    ("fully_shard", 0.5, "fully_shard"),
    ("fully_shard", "full", "fully_shard"),
    ("hybrid_prefetch2", "full", "fully_shard"),
    ("bf16_accumulate", "full", "bf16_accumulate"),
]
CONFIGS = [("fully_shard", None), ("bf16_accumulate", None)] + [(s, p) for s, p, _ in CASES]


@pytest.mark.timeout(900)
def test_llama_policies_bit_for_bit() -> None:
    pytest.importorskip("transformers")
    results = run_ranks(workers_remat.llama_policies, 2, CONFIGS, timeout=840)
    for rank, res in enumerate(results):
        for setting, policy, ref_setting in CASES:
            tag = f"rank {rank} {setting} remat={policy}"
            ref, got = res[f"{ref_setting}/None"], res[f"{setting}/{policy}"]
            assert ref["recomputed"] == 0
            assert got["recomputed"] > 0, f"{tag}: nothing recomputed"
            assert got["saved_bytes"] < ref["saved_bytes"], f"{tag}: saves as much as remat=None"
            assert got["gathers"] == ref["gathers"], (
                f"{tag}: {got['gathers']} all-gathers, not {ref['gathers']}"
            )
            for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
                assert torch.equal(a, b), f"{tag}: loss {i}"
            for i, (a, b) in enumerate(zip(got["params"], ref["params"])):
                assert torch.equal(a, b), f"{tag}: parameter {i}"
