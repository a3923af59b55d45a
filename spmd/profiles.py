"""Device profiles for the cost model (:mod:`passes.cost_model`): published GPU numbers and
this machine's, measured by ``python -m spmd.calibrate``.

Every number names its source in the profile's ``sources``. The GPU profiles are datasheet
peaks; ``h100-80gb`` also carries published H100 measurements (never fitted to a training
run's throughput): the fraction of peak that attention and matmuls reach (``op_efficiency``),
NCCL's bus bandwidth per collective on one NVLink node, and how much an overlapped collective
slows the compute, so its times aim at achievable ones. ``h100-hbm2e-500w`` is the same on
torchtitan's Table 1 GPU (HBM2e at 2.4 TB/s, 500 W); ``h200-141gb`` the H200 SXM (the H100's
compute and fractions, HBM3e at 4.8 TB/s). ``h100-80gb-roofline`` and
``a100-80gb`` are the datasheet roofline (efficiency 1.0: a lower bound on the time);
``spmd.plan(..., efficiency=x)`` applies one efficiency to every op class instead
(``efficiency=1.0``: the roofline of any profile).
``cpu-local`` is measured on this machine and cached in ``~/.cache/spmd/cpu-local.json``
(``SPMD_PROFILE_DIR`` or ``--out`` to move it).

The GPU profiles say ``device_type="cuda"``: ``spmd.plan`` and ``spmd.simulate(device=...)``
lower a step for them as it is lowered on a GPU (the chunked loss head's chunks), though they
trace on the CPU; a profile json without the field is a CPU's.
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

# Where h100-80gb's achievable figures come from (issue 22): published measurements, none
# fitted to a training run's throughput.
_AZURE_H100 = (
    "Azure/AI-benchmarking-guide, 'Azure Results/ND_H100_v5_results.md' (commit f350e7e; NVIDIA H100 "
    "80GB HBM3, CUDA 12.6, PyTorch 2.4.0)"
)
_EFFICIENCY = (
    "attention 0.331: " + _AZURE_H100 + ", 'Flash Attention 2.0': 327.9 TFLOPS fwd + bwd at head dim "
    "128, batch 2, sequence 8192, causal (Benchmarks/NVIDIA/FlashAttention.py runs flash-attention's "
    "benchmarks/benchmark_flash_attention.py, which counts a causal kernel's FLOPs halved and the "
    "backward as 2.5x the forward, as the cost model's causal_share and torch's formula do) = 33.1% of "
    "989.5; Shah et al., FlashAttention-3 (arXiv:2407.08608), abstract, gives FlashAttention-2 35% on "
    "the H100. memory 0.876: the same file, 'HBM Bandwidth' (BabelStream, CUDA): Copy 2.90, Mul 2.90, "
    "Add 2.97, Triad 2.97 TB/s, their mean 2.935 of 3.35 TB/s. matmul 0.80: Bekman, "
    "ml-engineering (github.com/stas00/ml-engineering, compute/accelerator/README.md, 'Maximum "
    "Achievable Matmul FLOPS comparison table', commit 744d01e): H100 SXM bf16 MAMF 794.5 of 989 "
    "TFLOPS = 80.3% (best shape 2048x2048x13312, torch 2.7.0+cu126, mean of 100 iterations); and the "
    "Llama 3.1 8B step's forward projections (16384 tokens x 4096 -> 4096 for q/o, 1024 for k/v) in "
    "OpenXLA's measured sm_90 table (tensorflow/tensorflow third_party/xla/xla/service/gpu/model/"
    "matmul_interpolator_data.h, commit 372d578, bf16xbf16->bf16, b=4 x m=4096 rows, k=4096): "
    "n=4096 793.1 TFLOP/s (80.2%), n=1024 777.6 (78.6%); the table stops at 4096 (not the MLP's "
    "14336 nor the weight gradients' 16384-long reductions)"
)
# nccl-tests on one NVLink 4 / NVSwitch node (the DGX H100's fabric: 18 links, 900 GB/s both ways).
_NCCL_TESTS = (
    "Bekman, ml-engineering (github.com/stas00/ml-engineering, network/README.md, SHARP section, "
    "commit 744d01e): nccl-tests on 8x H200 (NVLink 4, NVSwitch, the H100 SXM's fabric), 16 GiB, "
    "NCCL 2.27.7, busbw: all-gather 361.4 GB/s, reduce-scatter 362.9 GB/s (ring; NVLS does not apply). "
    "all-reduce 478.87 GB/s: " + _AZURE_H100 + ", 'NCCL Bandwidth': AllReduce (NVLS) busbw at 8 GB on 8 "
    "H100 (400.61 at 134 MB, 438.46 at 536 MB)"
)
_OVERLAP = (
    "Lee et al., Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep "
    "Learning (arXiv:2507.03114, 2025), abstract: overlapping computation and communication slows "
    "the computation by 18.9% on average (max 40.0%; GPT and LLaMA models on 4x A100, H100, MI250, "
    "MI210): compute during a collective progresses at 1/1.189 of its rate = 0.841"
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
    device_type="cuda",
    sources={
        "peak_flops": _H100_DATASHEET + " (dense = half the sparse figure)",
        "memory_bandwidth": _H100_DATASHEET,
        "intra_node_bandwidth": _H100_DATASHEET + ": NVLink 900 GB/s bidirectional, halved",
        "inter_node_bandwidth": "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s (one per GPU)",
        "latency": _NCCL_TUNING,
        "gpus_per_node": "NVIDIA DGX H100 datasheet: 8 GPUs per system",
    },
)

_H100_ACHIEVABLE = dataclasses.replace(
    _H100_ROOFLINE,
    name="h100-80gb",
    op_efficiency={
        "matmul": 0.80,
        "attention": round(327.9e12 / 989.5e12, 3),
        "memory": round(2.935 / 3.35, 3),
    },
    bandwidth_by_kind={"all_gather": 361.4e9, "reduce_scatter": 362.9e9, "all_reduce": 478.87e9},
    comm_compute_overlap=round(1 / 1.189, 3),
    sources={
        **_H100_ROOFLINE.sources,
        "op_efficiency": _EFFICIENCY,
        "bandwidth_by_kind": _NCCL_TESTS,
        "comm_compute_overlap": _OVERLAP,
        "memory_bandwidth": _H100_DATASHEET + " (the achievable fraction: op_efficiency['memory'])",
    },
)
# torchtitan's Table 1 GPU (benchmarks/llama3_h100_202412_torchtitan.md, commit 820504e): "96GB
# HBM2e with 2.4 TB/sec peak memory bandwidth", the default 500W power limit, Grand Teton hosts of
# 8 NVLink-connected GPUs; its footnote: "the actual peak TFLOPs number is between SXM and NVL, and
# we don't know its exact value". The profile takes the NVL figure (the lower end; `peak_flops=`
# of h100-80gb gives the upper end) and h100-80gb's achievable fractions (measured on HBM3 and at
# 700 W: assumed to hold on its HBM2e and at 500 W).
_TORCHTITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Hardware; footnote 2)"
_H100_HBM2E = dataclasses.replace(
    _H100_ACHIEVABLE,
    name="h100-hbm2e-500w",
    peak_flops={"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60e12, "fp64": 30e12},
    memory_bandwidth=2.4e12,
    sources={
        **_H100_ACHIEVABLE.sources,
        "peak_flops": "NVIDIA H100 datasheet, H100 NVL column: BF16 1,671 TFLOPS with sparsity (835.5 "
        "dense), FP32 60 -- the lower end of " + _TORCHTITAN_H100 + ": 'between SXM and NVL' (the "
        "datasheet page was not opened when this was written: the figure as quoted in spec tables)",
        "memory_bandwidth": _TORCHTITAN_H100 + ": 96GB HBM2e, 2.4 TB/s peak, 500W power limit",
        "gpus_per_node": _TORCHTITAN_H100 + ": 8 H100 per host, NVLink",
    },
)

# H200 SXM: the H100's compute (same Hopper GPU) with 141 GB of HBM3e at 4.8 TB/s. The achievable
# fractions are h100-80gb's (measured on H100s; the same SMs); the collective bandwidths were measured
# on 8 H200s already (_NCCL_TESTS), the all-reduce's on H100s over the same NVLink 4 fabric.
_H200_DATASHEET = (
    "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column: BF16 "
    "1,979 TFLOPS with sparsity (989.5 dense), FP32 67, FP64 34, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s "
    "(the datasheet page was not opened when this was written: the figures as quoted in spec tables)"
)
_H200 = dataclasses.replace(
    _H100_ACHIEVABLE,
    name="h200-141gb",
    peak_flops={"bf16": 989.5e12, "fp16": 989.5e12, "fp32": 67e12, "fp64": 34e12},
    memory_bandwidth=4.8e12,
    sources={
        **_H100_ACHIEVABLE.sources,
        "peak_flops": _H200_DATASHEET,
        "memory_bandwidth": _H200_DATASHEET + " (the achievable fraction, op_efficiency['memory'], is "
        "the H100's BabelStream share: not measured on HBM3e)",
        "op_efficiency": "h100-80gb's (the same Hopper SMs): " + _EFFICIENCY,
        "intra_node_bandwidth": _H200_DATASHEET + ": NVLink 900 GB/s bidirectional, halved",
        "inter_node_bandwidth": "NVIDIA DGX H200: 8x ConnectX-7 400 Gb/s, one per GPU (as the DGX H100)",
        "gpus_per_node": "NVIDIA DGX H200: 8 GPUs per system",
    },
)

PROFILES: dict[str, DeviceProfile] = {
    "h100-80gb": _H100_ACHIEVABLE,
    "h200-141gb": _H200,
    "h100-80gb-roofline": _H100_ROOFLINE,
    "h100-hbm2e-500w": _H100_HBM2E,
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
        device_type="cuda",
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
