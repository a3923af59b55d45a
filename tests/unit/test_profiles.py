"""spmd.profiles: the H100 profile's published efficiencies, its roofline variant, and the
``efficiency=`` override that gives the roofline of any profile (issue 22)."""

from __future__ import annotations

from spmd.profiles import PROFILES, get_profile


def test_h100_has_published_op_efficiencies_with_a_source_and_a_roofline_variant() -> None:
    achievable, roofline = PROFILES["h100-80gb"], PROFILES["h100-80gb-roofline"]
    assert set(achievable.op_efficiency) == {"matmul", "attention"}
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
