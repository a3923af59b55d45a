"""Device profiles for the cost model (:mod:`passes.cost_model`): published GPU numbers and
this machine's, measured by ``python -m spmd.calibrate``.

Every number names its source in the profile's ``sources``. The GPU profiles are datasheet
peaks; ``h100-80gb`` also carries the fraction of peak that attention reaches in a published
H100 measurement and an assumed fraction for matmuls (``op_efficiency``; never fitted to a
training run's throughput), so its times aim at achievable ones. ``h100-80gb-roofline`` and
``a100-80gb`` are the datasheet roofline (efficiency 1.0: a lower bound on the time);
``spmd.plan(..., efficiency=x)`` applies one efficiency to every op class instead
(``efficiency=1.0``: the roofline of any profile).
``cpu-local`` is measured on this machine and cached in ``~/.cache/spmd/cpu-local.json``
(``SPMD_PROFILE_DIR`` or ``--out`` to move it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from passes.cost_model import DeviceProfile
from spmd.errors import ConfigError

__all__ = ["PROFILES", "get_profile", "profile_path"]

_H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), SXM column"
_A100_DATASHEET = "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100), 80GB SXM"
_NCCL_TUNING = (
    "NCCL src/graph/tuning.cc hwLat, Ring/Simple protocol: NVLink 3.4 us, network 14 us per step "
    "(NCCL's own cost model)"
)

# Where h100-80gb's op_efficiency comes from (issue 22): one published figure, one assumption.
_FA3 = (
    "attention 0.35: Shah et al., FlashAttention-3 (arXiv:2407.08608, 2024), abstract: FlashAttention-2 "
    "(the kernel torch's SDPA runs on an H100) reaches 35% utilization on the H100. matmul 0.80: an "
    "assumption, not a measurement we could cite -- Dao, FlashAttention-2 (arXiv:2307.08691), abstract, "
    "sets attention's 25-40% against 'optimized matrix-multiply (GEMM) operations' without a figure; "
    "large bf16 GEMMs are commonly reported at 70-90% of the dense peak, and a step's GEMMs are smaller "
    "and more varied than a benchmark's"
)
_H100_ROOFLINE = DeviceProfile(
    name="h100-80gb-roofline",
    # Datasheet: BF16/FP16 Tensor Core 1,979 TFLOPS *with sparsity*: dense is half.
    peak_flops={"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 66.9e12, "fp64": 33.5e12},
    memory_bandwidth=3.35e12,  # HBM3 3.35 TB/s
    # NVLink 900 GB/s is both directions together; a ring uses one direction per link.
    intra_node_bandwidth=450e9,
    # DGX H100: 8 ConnectX-7 NICs at 400 Gb/s, one per GPU = 50 GB/s per rank.
    inter_node_bandwidth=50e9,
    intra_node_latency_s=3.4e-6,
    inter_node_latency_s=14e-6,
    gpus_per_node=8,
    sources={
        "peak_flops": _H100_DATASHEET + " (dense = half the sparse figure)",
        "memory_bandwidth": _H100_DATASHEET,
        "intra_node_bandwidth": _H100_DATASHEET + ": NVLink 900 GB/s bidirectional, halved",
        "inter_node_bandwidth": "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s (one per GPU)",
        "latency": _NCCL_TUNING,
        "gpus_per_node": "NVIDIA DGX H100 datasheet: 8 GPUs per system",
    },
)

PROFILES: dict[str, DeviceProfile] = {
    "h100-80gb": dataclasses.replace(
        _H100_ROOFLINE,
        name="h100-80gb",
        op_efficiency={"matmul": 0.80, "attention": 0.35},
        sources={**_H100_ROOFLINE.sources, "op_efficiency": _FA3},
    ),
    "h100-80gb-roofline": _H100_ROOFLINE,
    "a100-80gb": DeviceProfile(
        name="a100-80gb",
        # Datasheet: BF16/FP16 Tensor Core 312 TFLOPS dense (624 with sparsity); FP32 19.5.
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "fp64": 9.7e12},
        memory_bandwidth=2.039e12,  # HBM2e 2,039 GB/s
        intra_node_bandwidth=300e9,  # NVLink 600 GB/s bidirectional, halved
        inter_node_bandwidth=25e9,  # DGX A100: 8x ConnectX-6 200 Gb/s HDR, one per GPU
        intra_node_latency_s=3.4e-6,
        inter_node_latency_s=14e-6,
        gpus_per_node=8,
        sources={
            "peak_flops": _A100_DATASHEET,
            "memory_bandwidth": _A100_DATASHEET,
            "intra_node_bandwidth": _A100_DATASHEET + ": NVLink 600 GB/s bidirectional, halved",
            "inter_node_bandwidth": "NVIDIA DGX A100 datasheet: 8x ConnectX-6 200 Gb/s HDR (one per GPU)",
            "latency": _NCCL_TUNING,
            "gpus_per_node": "NVIDIA DGX A100 datasheet: 8 GPUs per system",
        },
    ),
}

CPU_LOCAL = "cpu-local"


def profile_path(path: str | os.PathLike[str] | None = None) -> Path:
    """Where the calibrated ``cpu-local`` profile is cached."""
    if path is not None:
        return Path(path)
    root = os.environ.get("SPMD_PROFILE_DIR") or os.path.join(Path.home(), ".cache", "spmd")
    return Path(root) / f"{CPU_LOCAL}.json"


def get_profile(device: str | DeviceProfile | os.PathLike[str], **overrides: Any) -> DeviceProfile:
    """A profile by name (``"h100-80gb"``, ``"a100-80gb"``, ``"cpu-local"``), a path to a
    profile json, or a :class:`DeviceProfile`; ``overrides`` replace fields
    (``compute_efficiency=0.5``, ``gpus_per_node=4``)."""
    if isinstance(device, DeviceProfile):
        prof = device
    elif str(device) in PROFILES:
        prof = PROFILES[str(device)]
    else:
        path = profile_path() if str(device) == CPU_LOCAL else Path(device)
        if not path.is_file():
            if str(device) == CPU_LOCAL:
                raise ConfigError(
                    f"spmd: no calibrated cpu-local profile at {path}. Run `python -m spmd.calibrate` first "
                    "(about a minute)."
                )
            raise ConfigError(
                f"spmd: unknown device {str(device)!r}; known: {sorted([*PROFILES, CPU_LOCAL])}, "
                "or a path to a profile json written by `python -m spmd.calibrate`."
            )
        prof = DeviceProfile.from_dict(json.loads(path.read_text()))
    clean = {k: v for k, v in overrides.items() if v is not None}
    if not clean:
        return prof
    if "compute_efficiency" in clean and "op_efficiency" not in clean:
        clean["op_efficiency"] = {}  # one efficiency for every op class, as asked
    return dataclasses.replace(prof, **clean)
