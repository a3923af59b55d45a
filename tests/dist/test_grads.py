"""``p.grad`` after a compiled step, on 2 gloo ranks: a step that never zeroes gradients
accumulates across calls exactly as DDP (replicate) and FSDP2 (fully_shard) do."""

from __future__ import annotations

import pytest

from tests.dist import workers_grads
from tests.dist.launcher import run_ranks


@pytest.mark.timeout(300)
def test_accumulation_across_calls_matches_ddp_and_fsdp2() -> None:
    """3 calls without zero_grad (SGD each call), then steps with zero_grad: loss, p.grad
    (a DTensor with the parameter's placement) and parameters equal the reference bit for bit."""
    results = run_ranks(workers_grads.accumulate, 2, "uneven", "sgd_momentum_foreach", timeout=240)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(300)
def test_micro_batches_on_top_of_old_gradients() -> None:
    """Two micro-batches per call, no zero_grad: replicate equals DDP with no_sync on the first,
    fully_shard equals FSDP2 without gradient sync on the first, bit for bit."""
    results = run_ranks(workers_grads.accumulate, 2, "mlp", "adamw_fused", True, timeout=240)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
