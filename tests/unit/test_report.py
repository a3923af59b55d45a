"""CompiledStep.report(): the predicted peak against MemTracker's measured one, and the report's forms.

The measured peak is MemTracker's over cached calls of the compiled step (after the first,
compiling call), counting the state that is live anyway: parameters, optimizer state and
the batch are registered with ``track_external`` before the calls.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd
from spmd.parallel import sharding
from tests.models import TinyGPT, train_step


def _gpt_step(parallel_mode=None):
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, d_model=64, n_layers=2, n_heads=4, seq=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (4, 33), generator=g)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    step = spmd.compile(parallel_mode=parallel_mode)(train_step)
    step(model, opt, x, y)  # compile (and run once)
    return step, (model, opt, x, y)


def _measured_peak(step, args) -> int:
    mt = MemTracker()
    mt.track_external(*args)
    with mt:
        for _ in range(2):
            step(*args)
            mt.reset_mod_stats()
    snap = mt.get_tracker_snapshot("peak")
    return snap[torch.device("cpu")]["Total"]


@pytest.fixture
def fake_world_2():
    assert not dist.is_initialized(), "a process group leaked from another test"
    saved = dict(sharding._DEFAULT_MESHES)
    sharding._DEFAULT_MESHES.clear()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()
        sharding._DEFAULT_MESHES.update(saved)


def test_predicted_peak_matches_measured_world_size_1() -> None:
    step, args = _gpt_step()
    predicted = step.report().peak_memory_bytes
    measured = _measured_peak(step, args)
    print(f"\nTinyGPT step, W=1: predicted peak {predicted} B, measured (MemTracker) {measured} B")
    assert abs(predicted - measured) <= 0.10 * measured


def test_predicted_peak_matches_measured_fully_shard_fake_world_2(fake_world_2) -> None:
    """The same under the fake process group at W=2 (one process): sharded state, gathered
    parameters and reduce-scattered gradients. Collectives return garbage values but real buffers."""
    step, args = _gpt_step(spmd.DataParallel("fully_shard"))
    rep = step.report()
    assert rep.world_size == 2 and "all_gather" in rep.collectives
    measured = _measured_peak(step, args)
    print(
        f"\nTinyGPT step, fully_shard W=2 (fake): predicted {rep.peak_memory_bytes} B, measured {measured} B"
    )
    assert abs(rep.peak_memory_bytes - measured) <= 0.10 * measured


def test_report_contents_and_forms(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    step = spmd.compile(dump_dir=str(tmp_path))(train_step)
    with pytest.raises(RuntimeError, match="not been called"):
        step.report()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    step(model, opt, x, y)
    rep = step.report()
    n_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert rep.world_size == 1 and rep.parallel_style == "replicate" and rep.stage == "final"
    assert rep.collectives == {} and rep.comm_bytes == 0
    assert rep.param_bytes == rep.grad_bytes == n_param_bytes
    assert rep.optim_state_bytes == n_param_bytes  # one momentum buffer per parameter
    assert rep.input_bytes == x.numel() * 4 + y.numel() * 8
    assert rep.num_params == rep.num_grads == 4
    assert rep.num_nodes == len(step.graphs["final"].graph.nodes)
    assert rep.peak_memory_bytes >= rep.param_bytes + rep.optim_state_bytes + rep.input_bytes
    assert set(rep.peak_by_phase) == {"forward", "backward", "optimizer"}
    assert max(rep.peak_by_phase.values()) == rep.peak_memory_bytes
    assert rep.trace_s is not None and rep.compile_s is not None and rep.compile_s >= rep.trace_s
    d = json.loads(rep.to_json())
    assert d == json.loads(json.dumps(rep.to_dict()))
    assert d["param_bytes"] == n_param_bytes and d["comm_bytes"] == 0
    text = str(rep)
    for word in ("world size", "params", "grads", "optimizer state", "predicted peak", "collectives"):
        assert word in text
    traced = step.report("traced")
    assert traced.stage == "traced" and traced.param_bytes == rep.param_bytes
    with pytest.raises(spmd.ConfigError, match="no such stage"):
        step.report("nope")
    # dump_dir: the report sits next to the stages
    where = tmp_path / "train_step" / "rank0"
    assert json.loads((where / "report.json").read_text())["param_bytes"] == n_param_bytes
    assert "predicted peak" in (where / "report.txt").read_text()


def test_report_str_lists_collectives() -> None:
    from spmd.reporting.report import CollectiveStats, StepReport

    rep = StepReport(
        world_size=8,
        parallel_style="fully_shard",
        collectives={"all_gather": CollectiveStats(3, 3 << 20), "reduce_scatter": CollectiveStats(2, 1024)},
        param_bytes=1 << 20,
        grad_bytes=1 << 20,
        optim_state_bytes=2 << 20,
        buffer_bytes=0,
        input_bytes=64,
        peak_memory_bytes=5 << 20,
        peak_node="mm",
        peak_by_phase={"forward": 4 << 20},
        num_nodes=10,
        num_params=2,
        num_grads=2,
    )
    lines = str(rep).splitlines()
    assert any("all_gather" in ln and "3" in ln and "3.00 MiB" in ln for ln in lines)
    assert any("reduce_scatter" in ln and "1.0 KiB" in ln for ln in lines)
    assert any(ln.split()[:1] == ["total"] and "5" in ln for ln in lines)
    assert rep.comm_bytes == (3 << 20) + 1024


def test_report_and_dump_split_collectives_by_mesh_dimension() -> None:
    """FSDP x TP on a (dp_shard=4, tp=2) mesh of the fake process group: the report and the dump
    tell tensor parallelism's collectives (activations' all-reduces on tp) from the data
    dimension's (parameters' all-gathers and gradients' reduce-scatters on dp_shard)."""
    from spmd import models
    from spmd.parallel import tp_plans
    from spmd.reporting.dump import annotated_code
    from spmd.simulate import fake_copy, fake_world, fresh_copy

    model, opt, x, y = models.build("tiny")
    mode = spmd.DataParallel("fully_shard", tp_size=2, tp_plan=tp_plans.gpt())
    step = spmd.compile(parallel_mode=mode)(models.train_step)
    rep = spmd.simulate(step, model, opt, x, y, world_size=8)
    by_dim = rep.collectives_by_dim
    assert set(by_dim) == {"tp", "dp_shard"}
    assert "all_reduce" in by_dim["tp"] and "reduce_scatter" not in by_dim["tp"]
    assert set(by_dim["dp_shard"]) == {"all_gather", "reduce_scatter"}
    for kind, c in rep.collectives.items():  # the split adds up to the totals
        parts = [kinds[kind] for kinds in by_dim.values() if kind in kinds]
        assert (sum(p.count for p in parts), sum(p.bytes for p in parts)) == (c.count, c.bytes)
    assert sum(rep.comm_bytes_by_dim().values()) == rep.comm_bytes
    text = str(rep)
    assert "collectives by mesh dimension:" in text and "\n    tp " in text and "\n    dp_shard " in text
    assert json.loads(rep.to_json())["collectives_by_dim"]["tp"]["all_reduce"]["count"] > 0

    sim = fresh_copy(step)
    args, _ = fake_copy((model, opt, x, y), {})
    with fake_world(8):
        sim.lower(*args)
        code = annotated_code(sim.graphs["final"])
    colls = [line for line in code.splitlines() if "_c10d_functional." in line and "wait_tensor" not in line]
    assert colls and all("| tp, " in line or "| dp_shard, " in line for line in colls)
    assert any(
        "| tp, " in line and "ranks [0, 1]" in line for line in colls
    )  # consecutive ranks per tp group
    assert any("| dp_shard, " in line and "ranks [0, 2, 4, 6]" in line for line in colls)
