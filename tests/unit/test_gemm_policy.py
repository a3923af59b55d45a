"""spmd.backend.gemm_policy: inductor_gemm='auto' picks ATen or oneDNN per matmul shape from timings.

Timings are injected (a fake timer) except in one test that times a tiny shape for real; the
cache lives in a tmp dir. The lowered graph (spmd.backend.inductor_rewrites.for_inductor, no inductor
compile) must call oneDNN for exactly the shapes decided so.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import spmd
from spmd.backend import gemm_policy
from spmd.backend.gemm_policy import ATEN, ONEDNN, Gemm
from spmd.backend.inductor_rewrites import for_inductor

ONEDNN_OP = torch.ops.spmd_lowering.onednn_mm.default


def _mlp_graph() -> fx.GraphModule:
    """x(16x8) -> addmm(b1, x, w1ᵀ) -> relu -> mm(., w2ᵀ): two matmuls of different shapes
    (8 -> 32 with bias, 32 -> 4 without)."""

    def f(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.nn.functional.linear(x, w1, b1)) @ w2.t()

    args = (torch.randn(16, 8), torch.randn(32, 8), torch.randn(32), torch.randn(4, 32))
    return make_fx(f, decomposition_table=torch._decomp.core_aten_decompositions())(*args)


def _shapes(gm: fx.GraphModule) -> list[Gemm]:
    return [g for n in gm.graph.nodes if (g := gemm_policy.gemm_of(n)) is not None]


def _timer(fast_onednn: set[tuple[int, int, int]], calls: list[Gemm] | None = None):
    """A fake timer: oneDNN takes 1 ms where (m, k, n) is in ``fast_onednn``, else 3 ms; ATen 2 ms."""

    def timer(g: Gemm) -> tuple[float, float]:
        if calls is not None:
            calls.append(g)
        return 2.0, (1.0 if (g.m, g.k, g.n) in fast_onednn else 3.0)

    return timer


def test_gemm_of_reads_shape_layout_and_bias() -> None:
    shapes = _shapes(_mlp_graph())
    assert sorted((g.m, g.k, g.n, g.bias) for g in shapes) == [(16, 8, 32, True), (16, 32, 4, False)]
    assert all(g.b_stride[0] == 1 for g in shapes)  # the weights enter transposed


def test_choice_needs_a_margin_and_ties_keep_aten() -> None:
    assert gemm_policy.choose(10.0, 8.0) == ONEDNN
    assert gemm_policy.choose(10.0, 10.0) == ATEN
    assert gemm_policy.choose(10.0, 10.0 * (1 - gemm_policy._MARGIN / 2)) == ATEN
    assert gemm_policy.choose(10.0, 12.0) == ATEN


def test_policy_picks_per_shape_and_lowered_graph_follows(tmp_path, monkeypatch) -> None:
    """The shape whose fake timing favours oneDNN becomes spmd_lowering::onednn_mm; the other
    stays aten.mm; 'aten' rewrites none and 'onednn' only those over its size floor (none here)."""
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_policy, "time_gemm", _timer({(16, 32, 4)}))
    gm = _mlp_graph()
    lowered = for_inductor(gm, gemm="auto")
    targets = [n.target for n in lowered.graph.nodes if n.op == "call_function"]
    assert targets.count(ONEDNN_OP) == 1
    dnn = next(n for n in lowered.graph.nodes if n.target is ONEDNN_OP)
    assert tuple(dnn.meta["val"].shape) == (16, 4) and len(dnn.args) == 2  # the mm, no bias
    assert torch.ops.aten.addmm.default in targets and torch.ops.aten.mm.default not in targets
    x = torch.randn(16, 8), torch.randn(32, 8), torch.randn(32), torch.randn(4, 32)
    torch.testing.assert_close(lowered(*x), gm(*x))
    assert for_inductor(gm, gemm="aten") is gm
    assert for_inductor(gm, gemm="onednn") is gm  # 16x32x4 is below _ONEDNN_MIN_MACS


def test_cache_round_trips_and_is_keyed_by_machine(tmp_path, monkeypatch) -> None:
    """A second decision reads every shape from the cache (no timing); another thread count is
    another machine key, so it times again; an unreadable cache file is ignored."""
    shapes = _shapes(_mlp_graph())
    calls: list[Gemm] = []
    first = gemm_policy.decide_here(shapes, timer=_timer({(16, 8, 32)}, calls), directory=str(tmp_path))
    assert len(calls) == 2 and not any(d.cached for d in first.values())
    assert {(g.m, d.choice) for g, d in first.items()} == {(16, ONEDNN)} | {(16, ATEN)}

    def never(g: Gemm) -> tuple[float, float]:
        raise AssertionError(f"timed {g} although it is cached")

    again = gemm_policy.decide_here(shapes, timer=never, directory=str(tmp_path))
    assert {g: d.choice for g, d in again.items()} == {g: d.choice for g, d in first.items()}
    assert all(d.cached for d in again.values())
    data = json.loads((tmp_path / "gemm_policy.json").read_text())
    assert list(data) == [gemm_policy.machine_key()]
    assert {e["choice"] for e in data[gemm_policy.machine_key()].values()} == {ATEN, ONEDNN}

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        calls.clear()
        gemm_policy.decide_here(shapes, timer=_timer(set(), calls), directory=str(tmp_path))
        assert len(calls) == 2
    finally:
        torch.set_num_threads(threads)

    (tmp_path / "gemm_policy.json").write_text("{not json")
    calls.clear()
    gemm_policy.decide_here(shapes, timer=_timer(set(), calls), directory=str(tmp_path))
    assert len(calls) == 2


def test_time_gemm_times_both_libraries_on_the_layout() -> None:
    """A real timing of a tiny transposed matmul with bias: both medians positive; the oneDNN
    call computes the same product."""
    g = Gemm(8, 4, 6, (1, 8), (1, 4), True)
    aten_ms, onednn_ms = gemm_policy.time_gemm(g)
    assert aten_ms > 0 and onednn_ms > 0
    gen = torch.Generator().manual_seed(0)
    a, b = gemm_policy._strided(8, 4, (1, 8), gen), gemm_policy._strided(4, 6, (1, 4), gen)
    bias = torch.randn(6, generator=gen)
    assert a.stride() == (1, 8) and b.stride() == (1, 4)
    torch.testing.assert_close(gemm_policy.onednn_matmul(a, b, bias), torch.addmm(bias, a, b))


def test_bad_gemm_values_are_config_errors() -> None:
    for bad in ("cublas", None, "AUTO"):
        with pytest.raises(spmd.errors.ConfigError, match="inductor_gemm.*'auto'"):
            spmd.compile(backend="inductor", inductor_gemm=bad)
    spmd.compile(backend="inductor", inductor_gemm="auto")  # accepted


def test_without_gloo_every_rank_keeps_aten(tmp_path) -> None:
    """A default group that cannot send objects (here the fake backend; NCCL alone likewise) gets
    ATen for every matmul, the same on every rank, and times nothing."""
    from tests.unit.fake_pg import fake_process_group

    def never(g: Gemm) -> tuple[float, float]:
        raise AssertionError("timed without a way to agree")

    with fake_process_group(4, rank=1):
        got = gemm_policy.decide(_shapes(_mlp_graph()), timer=never, directory=str(tmp_path))
    assert [d.choice for d in got.values()] == [ATEN, ATEN]
