"""The summary and table of ``benchmarks/plan_validation/plan_check.py``: Spearman's rank correlation, the
errors
over the ten original rows and over all rows, and the printed table (split out of plan_check.py)."""

from __future__ import annotations

import statistics
from typing import Any

ORIGINAL = ("overhead", "gpt")  # the models of the ten rows compared across runs


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties; Pearson's r of the ranks)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def summary(records: list[dict[str, Any]], measured: str = "measured_step_ms") -> dict[str, Any]:
    """Spearman's rho and errors over the records (each with measured and predicted numbers);
    ``measured``: the record's statistic of the step time (the median, or the 25th percentile)."""
    ok = [r for r in records if r.get(measured) and r.get("predicted_step_ms")]
    meas = [r[measured] for r in ok]
    pred = [r["predicted_step_ms"] for r in ok]
    step_err = [abs(p - m) / m for p, m in zip(pred, meas)]
    peak_err = [
        abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        for r in ok
        if r.get("measured_peak_bytes")
    ]
    before = [r.get("predicted_step_ms_roofline") for r in ok]
    before_err = [abs(p - m) / m for p, m in zip(before, meas) if p]
    # Pairs of rows whose measured order is within the noise: their interquartile ranges overlap.
    iqr = [r.get("measured_iqr", 0.0) * r["measured_step_ms"] / 2 for r in ok]
    close = sum(
        1 for i in range(len(ok)) for j in range(i + 1, len(ok)) if abs(meas[i] - meas[j]) < iqr[i] + iqr[j]
    )
    return {
        "configurations": len(ok),
        "pairs_within_noise": close,
        "pairs": len(ok) * (len(ok) - 1) // 2,
        "median_iqr": statistics.median([r.get("measured_iqr", 0.0) for r in ok]) if ok else None,
        # The model before issue 22's measured costs, on the same graphs and run.
        "spearman_step_time_roofline": spearman([p or 0.0 for p in before], meas) if len(ok) > 1 else None,
        "median_abs_step_error_roofline": statistics.median(before_err) if before_err else None,
        "spearman_step_time": spearman(pred, meas) if len(ok) > 1 else None,
        "median_abs_step_error": statistics.median(step_err) if step_err else None,
        "max_abs_step_error": max(step_err) if step_err else None,
        "spearman_peak": spearman(
            [r["predicted_peak_bytes"] for r in ok], [r["measured_peak_bytes"] for r in ok]
        )
        if len(ok) > 1
        else None,
        "median_abs_peak_error": statistics.median(peak_err) if peak_err else None,
        "max_abs_peak_error": max(peak_err) if peak_err else None,
    }


def summaries(records: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`summary` over all rows, with ``"original"``: the same over the ten rows of the
    overhead and GPT models (the set compared across runs and in the docs)."""
    out = summary(records)
    out["original"] = summary([r for r in records if r.get("model") in ORIGINAL])
    # The same against each row's 25th percentile (see the module docstring), where recorded.
    if all(r.get("measured_step_ms_p25") for r in records):
        out["p25"] = summary(records, "measured_step_ms_p25")
        out["original_p25"] = summary(
            [r for r in records if r.get("model") in ORIGINAL], "measured_step_ms_p25"
        )
    return out


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:.1%}" if pct else f"{x:.3f}"


def _summary_line(summ: dict[str, Any], label: str, stat: str = "") -> str:
    return (
        f"step time{stat} over {summ['configurations']} configurations ({label}): Spearman "
        f"{_fmt(summ['spearman_step_time'])} (target >= 0.9), median |error| "
        f"{_fmt(summ['median_abs_step_error'], True)} (target <= 20%), max "
        f"{_fmt(summ['max_abs_step_error'], True)}; the roofline-only model on the same graphs: Spearman "
        f"{_fmt(summ.get('spearman_step_time_roofline'))}, median |error| "
        f"{_fmt(summ.get('median_abs_step_error_roofline'), True)}; measured: median IQR "
        f"{_fmt(summ.get('median_iqr'), True)}, {summ.get('pairs_within_noise', '-')} of "
        f"{summ.get('pairs', '-')} row pairs ordered within the noise (IQRs overlap)"
    )


def table(records: list[dict[str, Any]], summ: dict[str, Any]) -> str:
    lines = [
        "| model | configuration | measured ms | IQR | p25 ms | CPU ms | predicted ms | error "
        "| roofline-only ms | error | exposed comm ms (pred) | peak MiB (MemTracker) | predicted MiB "
        "| error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for r in records:
        e = (r["predicted_step_ms"] - r["measured_step_ms"]) / r["measured_step_ms"]
        pe = (r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        rl = r.get("predicted_step_ms_roofline") or float("nan")
        re_ = (rl - r["measured_step_ms"]) / r["measured_step_ms"]
        iqr = r.get("measured_iqr")
        p25, cpu = r.get("measured_step_ms_p25"), r.get("measured_cpu_ms")
        lines.append(
            f"| {r['model']} | {r['config']} | {r['measured_step_ms']:.1f} "
            f"| {'-' if iqr is None else f'{iqr:.0%}'} | {'-' if p25 is None else f'{p25:.1f}'} "
            f"| {'-' if cpu is None else f'{cpu:.1f}'} | {r['predicted_step_ms']:.1f} "
            f"| {e:+.0%} | {rl:.1f} | {re_:+.0%} | {r['predicted_exposed_comm_ms']:.1f} "
            f"| {r['measured_peak_bytes'] / mib:.1f} "
            f"| {r['predicted_peak_bytes'] / mib:.1f} | {pe:+.1%} |"
        )
    lines.append("")
    orig = summ.get("original")
    if orig and orig["configurations"] != summ["configurations"]:
        lines.append(_summary_line(orig, "the ten overhead and GPT rows"))
        lines.append(_summary_line(summ, "all rows"))
    else:
        lines.append(_summary_line(summ, "all rows"))
    if "p25" in summ:
        p25o = summ["original_p25"]
        if p25o["configurations"] != summ["p25"]["configurations"]:
            lines.append(_summary_line(p25o, "the ten overhead and GPT rows", " (25th percentile)"))
        lines.append(_summary_line(summ["p25"], "all rows", " (25th percentile)"))
    seen: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("machine"):
            seen.setdefault(r["model"], r["machine"])
    if seen:
        lines.append(
            "during the timed rounds, other processes used / the hypervisor took (steal) this share "
            "of the cores: "
            + ", ".join(f"{m} {v['others_cpu_share']:.0%} / {v['steal_share']:.0%}" for m, v in seen.items())
        )
        probed = {m: v for m, v in seen.items() if "matmul_vs_calibration" in v}
        if probed:
            lines.append(
                "the calibration's matmul rate / add bandwidth during the timed rounds, over the job's "
                "calibration (slower rank; 1.00: the machine as fast as when the predictions' "
                "constants were measured): "
                + ", ".join(
                    f"{m} {v['matmul_vs_calibration']:.2f} / {v['bandwidth_vs_calibration']:.2f}"
                    + _probe_values(v)
                    for m, v in probed.items()
                )
            )
    lines.append(
        f"peak: median |error| {_fmt(summ['median_abs_peak_error'], True)}, max "
        f"{_fmt(summ['max_abs_peak_error'], True)} (target <= 3%)"
    )
    return "\n".join(lines)


def _probe_values(machine: dict[str, float]) -> str:
    """`` (GFLOP/s and GB/s at the calibration -> in the rounds)`` where the record has them
    (rank 0's; records before they were kept have only the ratios)."""
    keys = ("matmul_flops_calibration", "matmul_flops_rounds", "bandwidth_calibration", "bandwidth_rounds")
    if not all(k in machine for k in keys):
        return ""
    mc, mr, bc, br = (machine[k] for k in keys)
    return f" ({mc / 1e9:.1f} -> {mr / 1e9:.1f} GFLOP/s, {bc / 1e9:.1f} -> {br / 1e9:.1f} GB/s)"
