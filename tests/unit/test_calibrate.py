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


def test_a_probe_reading_is_the_median_of_several_calls(monkeypatch) -> None:
    """plan_check's probe and measure_compute's roofline constants read the median of READINGS
    calls of their functions (one call varied 2x from call to call): one outlier call, slow or
    fast, does not move them. (The calls return made-up readings; measure_compute's other
    measurements are stubbed.)"""
    import spmd.calibrate as cal

    def readings(*values: float):  # noqa: ANN202
        it = iter(values)
        return lambda *args, **kwargs: next(it)

    assert cal.READINGS == 5
    monkeypatch.setattr(cal, "measure_matmul", readings(40.0, 90.0, 85.0, 80.0, 88.0))
    monkeypatch.setattr(cal, "measure_memory_bandwidth", readings(9.0, 10.0, 30.0, 11.0, 10.5))
    assert cal.probe() == (85.0, 10.5)
    fp32, bf16 = (40.0, 90.0, 85.0, 80.0, 88.0), (1.0, 2.0, 3.0, 2.5, 9.0)
    monkeypatch.setattr(cal, "measure_matmul", readings(*fp32, *bf16))
    monkeypatch.setattr(cal, "measure_memory_bandwidth", readings(9.0, 10.0, 30.0, 11.0, 10.5))
    others = [
        n for n in dir(cal) if n.startswith("measure_") and n not in ("measure_matmul", "measure_compute")
    ]
    for name in others:
        if name != "measure_memory_bandwidth":
            monkeypatch.setattr(cal, name, lambda *args, **kwargs: {})
    got = cal.measure_compute()
    assert got["peak_flops"] == {"fp32": 85.0, "bf16": 2.5} and got["memory_bandwidth"] == 10.5
