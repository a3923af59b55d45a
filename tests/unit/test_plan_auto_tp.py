"""spmd.plan with automatic tensor-parallel placements (``tp_plan="auto"``) on the fake process group.

Each tp size is a ``DataParallel(style, tp_size=t, tp_plan="auto")`` row: the placements are
chosen while the row lowers, its code runs (simulate gives the same report), and the table says
what was sharded. The command line searches tp with automatic placements for any model that is
not of the Llama family. The built-in GPT (tiny: 2 blocks, lowered exactly) on the H100 profile.
"""

from __future__ import annotations

import argparse

import pytest

import spmd
from spmd import models
from spmd.plan import NamedPlan, _scaled_batch, plan, tp_summary
from spmd.plan.__main__ import default_tp_plan

W = 8


@pytest.fixture(scope="module")
def auto_rows() -> spmd.Plan:
    return plan(
        spmd.compile()(models.train_step),
        *models.build("tiny", batch=2, fake=True),
        world_size=W,
        device="h100-80gb",
        styles=("fully_shard",),
        prefetch=(1,),
        min_unit_mb=(1.0,),
        reshard=(True,),
        remat=(None,),
        tp_plan="auto",
        tp=(1, 2),
        jobs=2,  # tp 1 and tp 2 in processes of their own
    )


def test_auto_tp_row_runs_as_its_code_and_names_its_placements(auto_rows: spmd.Plan) -> None:
    rows = {r.options.get("tp_size", 1): r for r in auto_rows.rows}
    assert set(rows) == {1, 2}
    tp = rows[2]
    assert tp.options["tp_plan"] == "auto" and tp.mesh == "dp_shard 4 x tp 2"
    assert "tp_plan='auto'" in tp.expression and "tp_plans" not in tp.code
    # the choice was made, priced on the plan's device (at this size nothing pays on an H100: the
    # classes DTensor accepts replicate, their lines give the times), and is what the run reports
    assert tp.tp_choices and rows[1].tp_choices == []
    assert all("on h100-80gb: costs" in c or "DTensor redistributes" in c for c in tp.tp_choices)
    scope: dict = {}
    exec(tp.code.replace("spmd.compile(", "step = spmd.compile(", 1), scope)
    step = scope["step"](models.train_step)
    assert step.parallel_mode.tp_size == 2 and step.parallel_mode.tp_plan == "auto"
    model, optim, idx, tgt = models.build("tiny", batch=2, fake=True)
    (idx, tgt), _ = _scaled_batch((idx, tgt), {}, 2)
    rep = spmd.simulate(step, model, optim, idx, tgt, world_size=W, device="h100-80gb")
    assert rep.tp_choices == tp.tp_choices
    assert rep.peak_memory_bytes == tp.peak_bytes and rep.comm_bytes_by_dim() == tp.comm_bytes_by_dim
    text = str(auto_rows)
    line = f"tp 2: auto: {tp_summary(tp.tp_choices)}"
    assert line in text.splitlines() and " replicated (" in line
    assert f"best: {auto_rows.best.code}" in text


def test_tp_summary_counts_classes_by_verdict() -> None:
    choices = [
        "tok.weight: vocabulary-parallel embedding and tied vocabulary-parallel head, sharded: saves x",
        "b.*.qkv.weight -> b.*.proj.weight (x4): column -> row, replicated: DTensor redistributes",
        "b.*.fc.weight -> b.*.out.weight (x4): column -> row, sharded: saves y",
    ]
    assert tp_summary(choices) == (
        "2 classes sharded (tok.weight; b.*.fc.weight -> b.*.out.weight), "
        "1 class replicated (b.*.qkv.weight -> b.*.proj.weight)"
    )
    assert tp_summary([]) == "nothing to shard: every parameter replicates"


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"hf_config": None, "preset": None, "model": None, "tp_plan": None, **kw})


def test_command_line_picks_auto_placements_outside_the_llama_family() -> None:
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128}
    assert default_tp_plan(_args(hf_config=gpt2)) == "auto"
    assert default_tp_plan(_args(model="tiny")) == "auto"
    llama = default_tp_plan(_args(preset="llama3.1-8b"))
    assert isinstance(llama, NamedPlan) and repr(llama) == "tp_plans.llama(sequence_parallel=True)"
    assert default_tp_plan(_args(preset="llama3.1-8b", tp_plan="auto")) == "auto"
    assert repr(default_tp_plan(_args(preset="llama3.1-8b", tp_plan="llama"))) == "tp_plans.llama()"
    mixtral = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128}
    assert (
        repr(default_tp_plan(_args(hf_config=mixtral))) == "tp_plans.llama(mlp=False, sequence_parallel=True)"
    )
    assert repr(default_tp_plan(_args(hf_config=mixtral, tp_plan="llama"))) == "tp_plans.llama(mlp=False)"


def test_one_choice_per_trace_and_tp_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two configurations that partition differently (replicate, fully_shard) but run the same
    forward at one tp size: the placements are chosen once and the second row reuses the choice
    (no second undistributed trace and DTensor check); both rows show the same choice."""
    from spmd.parallel import auto_tp

    calls = []
    real = auto_tp.choose

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(auto_tp, "choose", counting)
    p = plan(
        spmd.compile()(models.train_step),
        *models.build("tiny", batch=2, fake=True),
        world_size=W, device="h100-80gb", styles=("replicate", "fully_shard"), prefetch=(1,),
        min_unit_mb=(1.0,), reshard=(True,), remat=(None,), tp_plan="auto", tp=(2,), exact=True,
    )  # fmt: skip
    tp_rows = [r for r in p.rows if r.options.get("tp_size") == 2]
    assert len(tp_rows) == 2 and len(calls) == 1
    assert tp_rows[0].tp_choices == tp_rows[1].tp_choices and tp_rows[0].tp_choices
