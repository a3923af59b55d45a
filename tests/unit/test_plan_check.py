"""benchmarks/plan_check.py's summary: the ten original rows apart, and which orderings are noise."""

from __future__ import annotations

import pytest

from benchmarks import plan_check


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
