"""spmd.calibrate's call-cost measurement counts its calls as the cost model prices them."""

from __future__ import annotations

import pytest

from passes.cost_model import call_tensors, ragged_pieces
from spmd.calibrate.calls import _list_op_cases, measure_call_costs


@pytest.mark.parametrize("ragged", [False, True])
def test_the_measured_calls_have_the_tensor_and_padding_counts_the_model_uses(ragged: bool) -> None:
    """Every case of 1 and of 4 tensors per list: its tensors grow with the lists, and the ops
    with a padded path are padded in every piece exactly when asked (so per_ragged is per piece)."""
    one, four = _list_op_cases(1, ragged), _list_op_cases(4, ragged)
    assert set(one) == set(four)
    for key in one:
        (op, a1, k1), (_, a4, k4) = one[key], four[key]
        assert call_tensors((a4, k4), op(*a4, **k4)) > call_tensors((a1, k1), op(*a1, **k1)), key
        if key.startswith("spmd."):
            assert ragged_pieces(op, a1) == (1 if ragged else 0), key
            assert ragged_pieces(op, a4) == (4 if ragged else 0), key


def test_call_costs_cover_the_list_ops_of_a_fully_shard_step() -> None:
    costs = measure_call_costs(repeats=1)
    padded = ("spmd.aligned_fused_optimizer_", "spmd.all_gather_copy_in", "spmd.all_gather_copy_out")
    assert set(padded) <= set(costs)
    for key in padded:
        assert set(costs[key]) == {"call", "per_tensor", "ragged_call", "per_ragged"}
    assert all(v >= 0.0 for c in costs.values() for v in c.values())
