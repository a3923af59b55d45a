"""Ignored parameters and per-module styles against DDP on 2 gloo ranks, bit for bit.

The model (workers_hybrid.LocalExpertNet) has a shared trunk and head around an expert that
starts different on every rank. Ignored, the expert is never communicated: each rank trains
its own, as DDP does for parameters in ``_set_params_and_buffers_to_ignore_for_model``. Its
gradient is local on both sides and the shared parameters are averaged the same way, so every
loss and parameter equals DDP's bit for bit. With ``module_styles={"head": "replicate"}`` in a
fully_shard model the head is all-reduced like DDP's gradients and the rest reduce-scattered
(which averages each element exactly as DDP's all-reduce does at 2 ranks): bit for bit too.
"""

from __future__ import annotations

import pytest

from tests.dist import workers_hybrid
from tests.dist.launcher import run_ranks

CASES = [
    ("replicate", "adamw_fused", {"ignored_modules": ["expert"]}),
    ("fully_shard", "adamw_fused", {"ignored_modules": ["<expert object>"]}),
    ("fully_shard", "sgd_momentum_foreach", {"ignored_params": ["expert.0.weight", "expert.0.bias"]}),
    ("fully_shard", "adam_fused", {"module_styles": {"head": "replicate"}}),
    ("fully_shard", "adamw_fused", {"module_styles": {"head": "replicate"}, "ignored_modules": ["expert"]}),
]


@pytest.mark.timeout(600)
def test_ignored_and_module_styles_bitwise_parity_with_ddp() -> None:
    results = run_ranks(workers_hybrid.ignored_and_styles, 2, CASES, timeout=540)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
