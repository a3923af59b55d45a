"""reduce_scatter_as_all_to_all on real gloo ranks: on by default at W=2, untouched at W=3.

The pass rewrites a 2-rank reduce-scatter into an all-to-all and a local sum; the bits must be
those of gloo's reduce-scatter (and so FSDP2's), and nothing changes at other world sizes.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import workers_gloo
from tests.dist.launcher import run_ranks


@pytest.mark.timeout(600)
def test_two_ranks_reduce_by_all_to_all_with_the_same_bits() -> None:
    """W=2, gloo: the final graph has no reduce-scatter left, one all-to-all per reduce-scatter
    the pass-off graph has, and the parameters equal the pass-off run's bit for bit."""
    on = run_ranks(workers_gloo.kinds_and_params, 2, "uneven", (), timeout=540)
    off = run_ranks(workers_gloo.kinds_and_params, 2, "uneven", (workers_gloo.PASS,), timeout=540)
    assert on[0]["ran"] and not off[0]["ran"]
    assert "reduce_scatter" not in on[0]["kinds"]
    assert on[0]["kinds"].count("all_to_all") == off[0]["kinds"].count("reduce_scatter") > 0
    assert [k for k in on[0]["kinds"] if k != "all_to_all"] == [
        k for k in off[0]["kinds"] if k != "reduce_scatter"
    ]
    for a, b in zip(on[0]["params"], off[0]["params"]):
        assert torch.equal(a, b)


@pytest.mark.timeout(600)
def test_two_ranks_bitwise_with_fsdp2() -> None:
    results = run_ranks(workers_gloo.fsdp2_parity, 2, timeout=540)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
def test_three_ranks_keep_the_reduce_scatter() -> None:
    """W=3: summation order would differ from gloo's; the pass runs and changes nothing."""
    (r0, *_) = run_ranks(workers_gloo.kinds_and_params, 3, "uneven", (), timeout=540)
    assert r0["ran"] and "reduce_scatter" in r0["kinds"] and "all_to_all" not in r0["kinds"]
