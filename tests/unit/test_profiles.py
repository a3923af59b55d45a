"""spmd.profiles: the H100 profile's published efficiencies, its roofline variant, and the
``efficiency=`` override that gives the roofline of any profile (issue 22)."""

from __future__ import annotations

from spmd.profiles import PROFILES, get_profile


def test_h100_has_published_op_efficiencies_with_a_source_and_a_roofline_variant() -> None:
    achievable, roofline = PROFILES["h100-80gb"], PROFILES["h100-80gb-roofline"]
    assert set(achievable.op_efficiency) == {"matmul", "attention", "memory"}
    assert all(0 < e < 1 for e in achievable.op_efficiency.values())
    assert "arXiv" in achievable.sources["op_efficiency"]
    assert roofline.op_efficiency == {} and roofline.compute_efficiency == 1.0
    assert roofline.peak_flops == achievable.peak_flops


def test_an_efficiency_override_applies_to_every_op_class() -> None:
    """``efficiency=1.0`` (spmd.plan / --efficiency) is the roofline, whatever the profile's classes."""
    assert PROFILES["h100-80gb"].op_efficiency  # what the override must clear
    prof = get_profile("h100-80gb", compute_efficiency=1.0)
    assert prof.op_efficiency == {} and prof.compute_efficiency == 1.0
    assert get_profile("h100-80gb").op_efficiency == PROFILES["h100-80gb"].op_efficiency


def test_each_measured_h100_figure_names_its_published_measurement() -> None:
    """h100-80gb's achievable figures are published measurements, each with its source: GEMM
    (MAMF), FlashAttention-2 and HBM (BabelStream) on an H100 SXM, NCCL bus bandwidth per
    collective, overlap slowdown."""
    prof = PROFILES["h100-80gb"]
    assert set(prof.bandwidth_by_kind) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert all(b < prof.intra_node_bandwidth for k, b in prof.bandwidth_by_kind.items() if k != "all_reduce")
    assert 0 < prof.comm_compute_overlap < 1
    for field, cited in (
        ("op_efficiency", "794.5"),
        ("op_efficiency", "327.9"),
        ("op_efficiency", "Triad 2.97"),
        ("bandwidth_by_kind", "nccl-tests"),
        ("comm_compute_overlap", "arXiv:2507.03114"),
    ):
        assert cited in prof.sources[field]


def test_torchtitans_gpu_is_h100_80gb_on_its_hbm2e_at_the_nvl_peak() -> None:
    """h100-hbm2e-500w: torchtitan's Table 1 GPU (2.4 TB/s HBM2e, peak between NVL and SXM: the
    NVL figure), with h100-80gb's achievable fractions and interconnect."""
    tt, sxm = PROFILES["h100-hbm2e-500w"], PROFILES["h100-80gb"]
    assert tt.memory_bandwidth == 2.4e12 and "torchtitan" in tt.sources["memory_bandwidth"]
    assert tt.peak_flops["bf16"] == 1671e12 / 2 < sxm.peak_flops["bf16"]
    assert "NVL" in tt.sources["peak_flops"]
    same = ("op_efficiency", "bandwidth_by_kind", "comm_compute_overlap", "intra_node_bandwidth")
    assert all(getattr(tt, f) == getattr(sxm, f) for f in same)
    assert get_profile("h100-hbm2e-500w") is tt


def test_h200_is_the_h100s_compute_with_hbm3e_and_is_found_by_name(monkeypatch) -> None:
    """h200-141gb: the H100's peak and measured fractions, 4.8 TB/s memory; a GPU named "NVIDIA
    H200" gets it for the automatic placements' cost decision (it had no profile: every clean class
    was sharded there)."""
    import torch

    from spmd.parallel import auto_tp_solve

    h100, h200 = PROFILES["h100-80gb"], PROFILES["h200-141gb"]
    assert h200.peak_flops["bf16"] == h100.peak_flops["bf16"] and h200.memory_bandwidth == 4.8e12
    assert h200.op_efficiency == h100.op_efficiency and h200.device_type == "cuda"
    assert "H200" in h200.sources["peak_flops"]
    assert "nccl-tests on 8x H200" in h200.sources["bandwidth_by_kind"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in (("NVIDIA H200", "h200-141gb"), ("NVIDIA H100 80GB HBM3", "h100-80gb")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert auto_tp_solve.local_profile() is PROFILES[want]
