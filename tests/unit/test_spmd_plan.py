"""spmd.plan (spmd/plan/): the configuration search, its table and its command line.

The tiny built-in GPT at world size 8 on the H100 profile: rows come back fitting first and
fastest first, each row's expression builds the configuration it names, the shared trace
and partition give the graph a fresh ``spmd.simulate`` gives, and the command line takes a
Hugging Face config file.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import spmd
from passes.cost_model import estimate_step_time
from spmd import models
from spmd.plan import PlanRow, _group_info, fold, parse_bytes, plan
from spmd.plan.__main__ import main as plan_main
from spmd.profiles import get_profile
from spmd.simulate import fake_copy, fake_world, fresh_copy
from spmd.simulate.__main__ import main as simulate_main

W = 8


@pytest.fixture(scope="module")
def tiny_plan() -> spmd.Plan:
    model, optim, idx, targets = models.build("tiny", batch=2, fake=True)
    step = spmd.compile()(models.train_step)
    return plan(
        step,
        model,
        optim,
        idx,
        targets,
        world_size=W,
        device="h100-80gb",
        styles=("replicate", "fully_shard"),
        prefetch=(0, 1),
        min_unit_mb=(1.0,),
        remat=(None, "selective"),
        refine=None,  # every configuration of the grid
    )


def test_rows_are_sorted_and_each_expression_builds_its_configuration(tiny_plan: spmd.Plan) -> None:
    rows = tiny_plan.rows
    # replicate + fully_shard x {reshard, no reshard} x {prefetch 0, 1} x {remat None, selective}
    assert len(rows) == 9
    assert tiny_plan.best is rows[0]
    assert [r.step_s for r in rows] == sorted(r.step_s for r in rows)
    for r in rows:
        assert r.step_s > 0 and r.peak_bytes > 0 and r.fits is None
        assert r.tokens_per_s == pytest.approx(tiny_plan.tokens_per_step / r.step_s)
        compiled = eval(r.expression, {"spmd": spmd, "torch": torch})(models.train_step)
        assert isinstance(compiled, spmd.CompiledStep)
        want = {k: v for k, v in r.options.items() if k != "remat"}
        assert compiled.parallel_mode == spmd.DataParallel(**want)
        assert compiled.remat == r.options.get("remat")
    assert tiny_plan.tokens_per_step == 2 * models.CONFIGS["tiny"].seq  # the token ids' size
    assert json.loads(tiny_plan.to_json())["rows"][0]["expression"] == rows[0].expression
    assert "best: " + rows[0].code in str(tiny_plan)


def test_one_trace_serves_every_sharded_configuration(tiny_plan: spmd.Plan) -> None:
    """replicate and fully_shard trace once each; the eight fully_shard rows reuse one trace."""
    assert tiny_plan.traces == 2


def test_a_reused_trace_gives_the_graph_a_fresh_simulation_gives(tiny_plan: spmd.Plan) -> None:
    """The prefetch-1 rows reuse the trace and the partition of the prefetch-0 rows (the plan
    shares its trace graph instead of copying it, skips the traced-graph passes and keeps lazy
    GraphModules): the same peak, collectives and predicted time as a step lowered from scratch."""
    model, optim, idx, targets = models.build("tiny", batch=2, fake=True)
    prof = get_profile("h100-80gb")
    for r in tiny_plan.rows:
        if r.options["parallel_style"] == "fully_shard" and r.options["forward_prefetch"] == 1:
            step = eval(r.expression, {"spmd": spmd, "torch": torch})(models.train_step)
            rep = spmd.simulate(step, model, optim, idx, targets, world_size=W)
            assert rep.peak_memory_bytes == r.peak_bytes
            assert rep.comm_bytes == r.comm_bytes
            with fake_world(W):
                args, kw = fake_copy((model, optim, idx, targets), {})
                gm = fresh_copy(step).lower(*args, **kw)["final"]
                cost = estimate_step_time(gm, prof, _group_info(prof.gpus_per_node))
            assert (cost.step_s, cost.exposed_comm_s, cost.flops) == (r.step_s, r.exposed_comm_s, r.flops)


def test_a_budget_puts_what_does_not_fit_last(tiny_plan: spmd.Plan) -> None:
    by_peak = sorted(tiny_plan.rows, key=lambda r: r.peak_bytes)
    assert by_peak[0].options["parallel_style"] == "fully_shard"  # holds less than replicate
    budget = by_peak[0].peak_bytes
    tight = tiny_plan.with_budget(budget)
    fits = [r.fits for r in tight.rows]
    assert fits[0] is True and False in fits
    assert fits == sorted(fits, reverse=True)  # every fitting row before every other
    for group in (True, False):
        times = [r.step_s for r in tight.rows if r.fits is group]
        assert times == sorted(times)
    assert all(r.fits == (r.peak_bytes <= budget) for r in tight.rows)


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes(1024) == 1024
    with pytest.raises(spmd.ConfigError, match="80GiB"):
        parse_bytes("eighty")


def _tiny_llama_json(tmp_path) -> str:
    path = tmp_path / "tiny_llama.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 64,
                "max_position_embeddings": 64,
            }
        )
    )
    return str(path)


def test_command_lines_take_a_hugging_face_config_file(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    cfg = _tiny_llama_json(tmp_path)
    common = ["--hf-config", cfg, "--batch", "2", "--seq", "16"]
    args = [
        "--world-size",
        "4",
        "--device",
        "a100-80gb",
        "--styles",
        "replicate",
        "--memory-per-rank",
        "1GiB",
        "--tp",
        "1",  # a Llama config: tp sizes are searched by default (tests/unit/test_plan_tp.py)
    ]
    assert plan_main([*common, *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["device"] == "a100-80gb" and out["tokens_per_step"] == 32
    assert [r["fits"] for r in out["rows"]] == [True]
    assert out["rows"][0]["expression"] == "spmd.compile(parallel_mode=spmd.DataParallel('replicate'))"
    assert simulate_main([*common, "--world-size", "4", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world_size"] == 4 and rep["collectives"]["all_gather"]["count"] > 0


def test_the_tiny_gpt_is_planned_exactly(tiny_plan: spmd.Plan) -> None:
    """Two blocks are too few to fold (a folded search lowers copies with 3 and 6): every row exact."""
    assert tiny_plan.fold is None
    assert all(r.exact and r.extrapolated is None for r in tiny_plan.rows)


def _blocks(n: int, **attrs: object) -> torch.nn.Module:
    class Block(torch.nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.layer_idx = i  # each block's own index: not a difference
            for k, v in attrs.items():
                setattr(self, k, v(i) if callable(v) else v)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.layers = torch.nn.ModuleList(Block(i) for i in range(n))

    return Net()


def test_only_identical_blocks_fold() -> None:
    assert fold.find_layers(_blocks(8), min_layers=8) == fold.Layers(path="layers", count=8)
    assert fold.find_layers(_blocks(7), min_layers=8) is None  # too few
    # a setting that differs between blocks (a sliding-window layer among full ones)
    assert fold.find_layers(_blocks(8, window=lambda i: 4 if i % 2 else None), min_layers=8) is None
    net = _blocks(8)
    net.layers[3].lin = torch.nn.Linear(4, 4, bias=False)  # another parameter set
    assert fold.find_layers(net, min_layers=8) is None
    net = _blocks(8)
    net.layers[5].lin.weight = net.layers[0].lin.weight  # shared between blocks
    assert fold.find_layers(net, min_layers=8) is None
    net = _blocks(8)
    net.layers[2].lin.weight = torch.nn.Parameter(torch.zeros(4, 4))
    net.emb.weight = net.layers[2].lin.weight  # tied to a tensor outside the blocks
    assert fold.find_layers(net, min_layers=8) is None


def test_a_remat_budget_given_as_a_fraction_is_not_extrapolated() -> None:
    """Its knapsack chooses over the whole step: measured 17-25% off in peak
    (benchmarks/results/plan-validation.md)."""
    assert not fold.extrapolates({"parallel_style": "fully_shard", "remat": 0.5})
    for remat in (None, "selective", "full"):
        assert fold.extrapolates({"parallel_style": "fully_shard", "remat": remat})
    assert fold.extrapolates({"parallel_style": "replicate"})


# Llama-shaped, 4 blocks: folded on copies with 1 and 2 of them.
_LLAMA4 = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}


def test_a_folded_search_extrapolates_the_exact_predictions() -> None:
    """A 4-block Hugging Face Llama at 32 ranks with bf16 compute, fully_shard with prefetch 0 and 1
    (the 8B and 70B checks, every style and remat policy, are in
    benchmarks/results/plan-validation.md): each configuration
    is lowered on copies with 1 and 2 blocks and extrapolated in depth; the best row is then
    lowered exactly (and keeps its extrapolation), the other one stays extrapolated. Both
    extrapolations give the peak, step time, FLOPs and bytes on the wire of the 4-block lowering
    within ``tol`` (floating-point rounding: every block adds the same nodes, collectives and saved
    activations, so the quantities are linear in the block count)."""
    pytest.importorskip("transformers")
    tol = 1e-6
    built = models.build_hf(_LLAMA4, batch=2, seq=32)
    step = spmd.compile()(models.causal_lm_step)
    common = dict(
        world_size=32,
        mixed_precision=spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        styles=("fully_shard",),
        min_unit_mb=(1.0,),
        reshard=(True,),
        remat=(None,),
    )
    folded = plan(step, *built, fold_depths=(1, 2), prefetch=(0, 1), **common)
    assert folded.fold == {"layers": "model.layers", "depth": 4, "folded": [1, 2]}
    best, other = folded.rows
    assert best.exact and best.extrapolated is not None
    assert not other.exact and other.extrapolated is None
    exact_other = plan(step, *built, exact=True, prefetch=(other.options["forward_prefetch"],), **common)
    assert exact_other.fold is None and exact_other.best.label == other.label
    keys = ("peak_bytes", "step_s", "flops", "comm_bytes")
    for got, want in ((best.extrapolated, best), (vars(other), exact_other.best)):
        for k in keys:
            assert got[k] == pytest.approx(getattr(want, k), rel=tol), k
    assert best.step_s <= exact_other.best.step_s  # the exact best is the best


def _row(label: str, peak: int, step_s: float) -> PlanRow:
    return PlanRow(
        label=label,
        expression="",
        options={},
        peak_bytes=peak,
        fits=None,
        step_s=step_s,
        tokens_per_s=1 / step_s,
        exposed_comm_s=0.0,
        comm_s=0.0,
        compute_s=step_s,
        flops=0.0,
        comm_bytes=0,
        lower_s=1.0,
        exact=False,
    )


def test_the_folded_rows_lowered_exactly_are_the_best_and_those_near_the_budget() -> None:
    """Exact lowering (here a stand-in: the exact step is 1 s slower than the extrapolated one
    for row "a") goes to the rows near the budget, then to the best row until the best is exact."""
    rows = [_row("a", 50, 1.0), _row("b", 60, 1.5), _row("c", 99, 3.0), _row("d", 200, 0.5)]
    lowered: list[str] = []

    def exact(r: PlanRow) -> PlanRow:
        lowered.append(r.label)
        return dataclasses.replace(r, step_s=r.step_s + (1.0 if r.label == "a" else 0.0), exact=True)

    out = fold.confirm(rows, 100, 0.05, exact, fold.LINEAR)
    # c (99 within 5% of 100) first; then a, the best, is slower exactly; then b, the new best
    assert lowered == ["c", "a", "b"]
    assert [r.label for r in out] == ["b", "a", "c", "d"]  # d does not fit
    assert out[0].exact and out[1].extrapolated == {
        k: getattr(rows[0], k)
        for k in ("peak_bytes", "step_s", "exposed_comm_s", "comm_s", "compute_s", "flops", "comm_bytes")
    }
    assert out[1].lower_s == 2.0  # the copies' lowerings and the exact one
    assert not out[3].exact


def test_a_peak_that_moves_between_the_copies_is_extrapolated_from_deeper_ones() -> None:
    """Extrapolation through two copies holds only where both peaks are the same point of the step.
    Llama 3.1 70B shapes at 1,024 ranks, fully_shard, prefetch 0, selective remat (before the
    reductions were issued as gradients are made): the 3-block copy peaked late in backward
    (block 1), the 6-block copy early (block 5, the first backward block), and the extrapolated
    171 GiB was 232 GiB exactly. A third copy as much deeper again, peaking where the longer one
    does, gives that peak's growth; else the full model is lowered. Here a stand-in lowering gives
    such peak sites."""
    path = "model.layers"
    assert fold.same_site(("backward", "model.layers.2.mlp"), ("backward", "model.layers.5.mlp"), path, 3, 6)
    assert fold.same_site(("backward", "model.layers.1.mlp"), ("backward", "model.layers.1.attn"), path, 3, 6)
    assert fold.same_site(("backward", "lm_head"), ("backward", "lm_head"), path, 3, 6)
    assert not fold.same_site(("backward", "model.layers.1"), ("backward", "model.layers.5.mlp"), path, 3, 6)
    assert not fold.same_site(("forward", "lm_head"), ("backward", "lm_head"), path, 3, 6)
    assert not fold.same_site(("backward", "lm_head"), ("backward", "model.layers.5"), path, 3, 6)

    sites = {3: ("backward", "model.layers.1.mlp"), 6: ("backward", "model.layers.5.mlp")}
    asked: list[int | None] = []

    def lower(opts: dict, depth: int | None) -> PlanRow:
        asked.append(depth)
        row = _row("r", 10 * (depth or 80), 1.0)
        return dataclasses.replace(row, peak_site=sites.get(depth or 0, ("", "")), exact=depth is None)

    rows = fold.folded_search([{"parallel_style": "fully_shard"}], fold.Layers(path, 80), (3, 6), lower, 1)
    # a third copy (9 blocks) peaks elsewhere again: the full model is lowered
    assert asked == [3, 6, 9, None] and rows[0].exact and rows[0].peak_bytes == 800
    sites[9] = ("backward", "model.layers.8.mlp")  # the first backward block, as in 6: from 6 and 9
    asked.clear()
    rows = fold.folded_search([{"parallel_style": "fully_shard"}], fold.Layers(path, 80), (3, 6), lower, 1)
    assert asked == [3, 6, 9] and not rows[0].exact and rows[0].peak_bytes == 800
    sites[3] = ("backward", "model.layers.2.mlp")  # the first backward block in both: extrapolated
    asked.clear()
    rows = fold.folded_search([{"parallel_style": "fully_shard"}], fold.Layers(path, 80), (3, 6), lower, 1)
    assert asked == [3, 6] and not rows[0].exact and rows[0].peak_bytes == 800


def test_a_gpu_plan_lowers_as_on_the_gpu_and_says_which_graph_it_prices(monkeypatch) -> None:
    """spmd.plan traces on the CPU but lowers for its profile: on a GPU profile the chunked loss
    head has the accelerator's chunks (here 4 of ACCELERATOR_MIN_ROWS rows, where the CPU's rule
    gives 32 of 256), in the row and in the table. And it prices spmd's final graph: with
    backend="inductor" the graph before inductor (which plans its own buffers), which the row and
    the table say -- without calling inductor (a compile per configuration took minutes), and so
    does spmd.simulate. (spmd's entry to inductor is replaced by a stand-in that counts its calls.)"""
    from passes.linear_cross_entropy import ACCELERATOR_MIN_ROWS
    from spmd import api
    from spmd.backend.lowering import Lowered, graph_order
    from spmd.reporting.report import PEAK_FROM_INDUCTOR
    from tests.unit.test_simulate import _wide_vocab_lm

    lowered: list[int] = []

    def stand_in(gm, example_inputs, backend, **kwargs):  # noqa: ANN001, ANN003, ANN202
        lowered.append(len(gm.graph.nodes))
        return Lowered(gm, backend, "# stand-in", 0.0, graph_order(gm))

    monkeypatch.setattr(api, "compile_graph", stand_in)
    tokens = 4 * ACCELERATOR_MIN_ROWS
    step = spmd.compile(chunked_loss=True, backend="inductor")(models.train_step)
    p = plan(step, *_wide_vocab_lm(tokens), world_size=W, device="h100-80gb", styles=("replicate",))
    want = f"loss head: {tokens} tokens x vocab 1024, 4 chunk(s) of {ACCELERATOR_MIN_ROWS}"
    assert p.best.loss_heads == [want]
    assert f"chunked {want} (on h100-80gb)" in str(p)
    assert p.best.peak_from == PEAK_FROM_INDUCTOR
    assert f"peaks and step times predicted from {PEAK_FROM_INDUCTOR}" in str(p)
    assert lowered == []  # inductor was never asked to compile
    report = spmd.simulate(step, *_wide_vocab_lm(tokens), world_size=W, device="h100-80gb")
    assert report.backend == "inductor" and report.peak_from == PEAK_FROM_INDUCTOR
    assert report.lower_s is None and report.kept is None and "not lowered" in str(report)
    assert lowered == []  # inductor was never asked to compile
