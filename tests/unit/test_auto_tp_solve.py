"""The cost-based decision of automatic tensor parallelism (spmd.parallel.auto_tp_solve): the rule,
the times it compares, and where the profile comes from. The choices it makes on traced models are
in tests/unit/test_auto_tp.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from passes.cost_model import GroupInfo, collective_time
from spmd.parallel import auto_tp_solve as solve
from spmd.profiles import PROFILES


def test_the_rule() -> None:
    """Shard what saves time; what only saves memory while it costs at most 5% of the step; never
    what costs time and saves no memory; replicate the rest."""
    step = 1e-3
    assert solve.decide(2e-6, 1e-6, 0, step)  # saves time
    assert solve.decide(0.0, 49e-6, 1, step)  # within 5% of the step, for memory
    assert not solve.decide(0.0, 51e-6, 1 << 30, step)  # more than 5%
    assert not solve.decide(0.0, 1e-6, 0, step)  # costs time, saves nothing
    assert (
        solve.clause(False, 51e-6, step, True) == "costs 51.0 us a step, more than 5% of the step's 1.00 ms"
    )


def test_collective_times_are_the_cost_models() -> None:
    """A split's collectives cost what passes.cost_model.collective_time says on the tp group's
    link, within a node while tp fits in one, plus the launch and host time the step's estimate
    charges each collective and its wait."""
    h100 = PROFILES["h100-80gb"]
    comms = [("all_reduce", 1 << 20), ("all_reduce", 1 << 20)]
    one = collective_time("all_reduce", 1 << 20, GroupInfo(8, False), h100)
    assert solve.comm_s(comms, 8, h100) == pytest.approx(2 * one)
    across = collective_time("all_reduce", 1 << 20, GroupInfo(16, True), h100)
    assert solve.comm_s(comms[:1], 16, h100) == pytest.approx(across)
    cpu = dataclasses.replace(h100, op_overhead_s=1e-5, collective_host_s=3e-5)
    assert solve.comm_s(comms[:1], 8, cpu) == pytest.approx(one + 2 * 1e-5 + 3e-5)
    assert solve.collectives(comms + [("all_gather", 4)]) == "2 all-reduces, 1 all-gather"


def test_local_profile_is_the_calibrated_cpu_one(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without a GPU the choice prices on this machine's calibrated cpu-local profile,
    and on none when it was never calibrated (every class DTensor accepts is then sharded)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("SPMD_PROFILE_DIR", str(tmp_path))
    assert solve.local_profile() is None
    mine = dataclasses.replace(PROFILES["a100-80gb"], name="cpu-local", device_type="cpu")
    (tmp_path / "cpu-local.json").write_text(json.dumps(mine.to_dict()))
    got = solve.local_profile()
    assert got is not None and got.name == "cpu-local" and got.peak_flops == mine.peak_flops
