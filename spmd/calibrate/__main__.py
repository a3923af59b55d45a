"""``python -m spmd.calibrate``: measure this machine's profile and write it (see :mod:`spmd.calibrate`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from spmd.calibrate import calibrate
from spmd.profiles import profile_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m spmd.calibrate",
        description="Measure this machine's compute and gloo profile for spmd.plan.",
    )
    p.add_argument("--out", default=None, help=f"profile json to write (default {profile_path()})")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the compute measurements")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    prof = calibrate(args.threads)
    out = profile_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=out.parent, delete=False, suffix=".tmp") as f:
        json.dump(prof.to_dict(), f, indent=2)
    os.replace(f.name, out)
    d = prof.to_dict()
    print(f"calibrated in {time.perf_counter() - t0:.1f} s -> {out}")
    for k in (
        "peak_flops",
        "memory_bandwidth",
        "op_overhead_s",
        "view_overhead_s",
        "per_tensor_s",
        "intra_node_latency_s",
        "bandwidth_by_kind",
        "comm_compute_overlap",
        "collective_host_s",
        "mixed_call_factor",
        "mixed_call_curve",
    ):
        print(f"  {k}: {d[k]}")
    print(f"  op_curves: {', '.join(sorted(d['op_curves']))}")
    for k, v in sorted(d["call_costs"].items()):
        print(f"  call_costs[{k}]: " + ", ".join(f"{n} {s * 1e6:.1f} us" for n, s in v.items()))
    print(f"  fresh_alloc_curve: {len(d['fresh_alloc_curve'])} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
