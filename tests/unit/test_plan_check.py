"""benchmarks/plan_validation/plan_check.py's summary: the ten original rows apart, and which orderings
are noise."""

from __future__ import annotations

import pytest

from benchmarks.plan_validation import plan_check


def _row(model: str, measured: float, iqr: float, predicted: float) -> dict[str, object]:
    return {
        "model": model,
        "config": "c",
        "measured_step_ms": measured,
        "measured_iqr": iqr,
        "predicted_step_ms": predicted,
        "predicted_step_ms_roofline": predicted,
        "predicted_exposed_comm_ms": 0.0,
        "measured_peak_bytes": 100,
        "predicted_peak_bytes": 100,
    }


def test_rows_within_each_others_noise_are_counted_and_the_original_rows_summarized_apart() -> None:
    """100 and 104 ms with 10% IQRs (+-5 ms each) overlap; 100 and 200 do not. The encoder row is
    in the summary over all rows only."""
    rows = [
        _row("gpt", 100.0, 0.1, 100.0),
        _row("gpt", 104.0, 0.1, 110.0),
        _row("overhead", 200.0, 0.1, 150.0),
    ]
    rows.append(_row("encoder", 50.0, 0.0, 100.0))
    summ = plan_check.summaries(rows)
    orig = summ["original"]
    assert orig["configurations"] == 3 and summ["configurations"] == 4
    assert orig["pairs"] == 3 and orig["pairs_within_noise"] == 1
    assert orig["median_abs_step_error"] == pytest.approx(6 / 104)  # errors 0, 6/104, 50/200
    assert summ["max_abs_step_error"] == 1.0  # the encoder row: 100 predicted for 50 measured
    text = plan_check.table(rows, summ)
    assert "the ten overhead and GPT rows" in text and "all rows" in text and "| 10% |" in text


def test_the_25th_percentile_and_the_machine_load_are_printed_beside_the_median() -> None:
    """Each row's 25th percentile gets its own summary (here it matches the predictions exactly,
    where the median is 10% above them); per model, the share of the cores other processes took
    during the timed rounds and the probes' speed against the calibration's are printed."""
    rows = []
    for model, ms in (("gpt", 100.0), ("gpt", 200.0), ("overhead", 300.0)):
        r = _row(model, ms * 1.1, 0.1, ms)
        r.update(measured_step_ms_p25=ms, measured_cpu_ms=ms / 2)
        r["machine"] = {
            "others_cpu_share": 0.25,
            "steal_share": 0.0,
            "matmul_vs_calibration": 0.9,
            "bandwidth_vs_calibration": 0.75,
        }
        if model == "overhead":  # a record with the probes' absolute readings (rank 0's)
            r["machine"].update(
                matmul_flops_calibration=80e9,
                matmul_flops_rounds=72e9,
                bandwidth_calibration=20e9,
                bandwidth_rounds=15e9,
            )
        rows.append(r)
    summ = plan_check.summaries(rows)
    assert summ["median_abs_step_error"] == pytest.approx(0.1 / 1.1)
    assert summ["p25"]["median_abs_step_error"] == 0.0
    text = plan_check.table(rows, summ)
    assert "step time (25th percentile) over 3 configurations" in text
    assert "gpt 25% / 0%" in text and "| 50.0 |" in text  # the machine line, the CPU column
    assert "gpt 0.90 / 0.75," in text  # no absolute readings in the record: the ratios alone
    assert "overhead 0.90 / 0.75 (80.0 -> 72.0 GFLOP/s, 20.0 -> 15.0 GB/s)" in text
