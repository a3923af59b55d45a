"""dump_dir / SPMD_DUMP_DIR: every graph stage written as readable, annotated Python."""

from __future__ import annotations

import ast
import os

import spmd
from tests import models


def my_train_step(model, optim, x, y):
    return models.train_step(model, optim, x, y)


def _run(**options):
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile(**options)(my_train_step)
    step(model, opt, *models.batches("mlp", 1)[0])
    return step


def _check_stage_files(where, step):
    files = sorted(f for f in os.listdir(where) if f.endswith(".py"))
    assert files == [f"{i:02d}_{stage}.py" for i, stage in enumerate(step.graphs)]
    assert sorted(set(os.listdir(where)) - set(files)) == ["report.json", "report.txt"]
    assert files[0] == "00_traced.py" and files[-1].endswith("_final.py")
    for name in files:
        with open(os.path.join(where, name)) as f:
            src = f.read()
        ast.parse(src)  # readable means valid Python
        assert "def forward" in src
        assert "# forward | activation | net.0" in src
        assert "# optimizer | update" in src
    with open(os.path.join(where, "00_traced.py")) as f:
        traced = f.read()
    assert "# backward | grad | net.2" in traced  # the tag_grad nodes, before the pipeline strips them
    assert f"{len(step.graphs['traced'].graph.nodes)} nodes" in traced.splitlines()[0]


def test_dump_dir_writes_one_file_per_stage(tmp_path):
    step = _run(dump_dir=str(tmp_path))
    where = tmp_path / "my_train_step" / "rank0"
    assert where.is_dir()
    _check_stage_files(where, step)


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_DUMP_DIR", str(tmp_path / "env"))
    step = _run()
    _check_stage_files(tmp_path / "env" / "my_train_step" / "rank0", step)


def test_no_dump_without_option(tmp_path, monkeypatch):
    monkeypatch.delenv("SPMD_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    _run()
    assert os.listdir(tmp_path) == []


def test_micro_batches_are_named_in_the_dump() -> None:
    """A step that accumulates over micro-batches says which one each line belongs to."""
    from spmd.reporting.dump import annotated_code

    def accumulate(model, optim, x, y):
        for xb, yb in zip(x.chunk(2), y.chunk(2)):
            models.loss_fn(model(xb), yb).backward()
        optim.step()
        optim.zero_grad()

    model = models.build("mlp")
    step = spmd.compile()(accumulate)
    assert step(model, models.make_optimizer("adamw_fused", model), *models.batches("mlp", 1)[0]) is None
    code = annotated_code(step.graphs["traced"])
    assert "# micro-batch 0 forward | activation | net.0" in code
    assert "# micro-batch 1 backward | grad | net.2" in code
    assert "# optimizer | update" in code
    assert "micro-batch" not in annotated_code(_run().graphs["traced"])


def _lower_fully_shard(dump_dir=None):
    import torch

    torch.manual_seed(0)
    model = models.TinyGPT(n_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    options = {"dump_dir": dump_dir} if dump_dir else {}
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", min_unit_mb=0), **options)(
        models.train_step
    )
    step.lower(model, opt, *models.batches("tinygpt", 1)[0])
    return step


def _full_copy(gm):
    """A stage as spmd used to copy it: torch's own graph_copy, then a GraphModule."""
    import torch.fx as fx

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {})).meta = dict(gm.graph.output_node().meta)
    return fx.GraphModule(gm, graph)


def test_every_stage_is_the_graph_after_that_stage(tmp_path, monkeypatch):
    """step.graphs and the dump (cheap copies, built on lookup) show each stage exactly as a full
    GraphModule copy taken right after it does, in fully_shard at world size 2 where every pass
    rewrites the graph in place; a no-op pass's stage equals the one before it."""
    from passes.stages import Stages
    from spmd.reporting.dump import annotated_code
    from tests.unit.fake_pg import fake_process_group

    with fake_process_group(2):
        with monkeypatch.context() as m:  # the old way: a full copy right after each stage
            m.setattr(Stages, "record", lambda self, name, gm: self.__setitem__(name, _full_copy(gm)))
            old = _lower_fully_shard().graphs
            want = {name: gm.code for name, gm in old.items()}
            want_dump = {name: annotated_code(gm) for name, gm in old.items()}
        step = _lower_fully_shard(str(tmp_path))
    got = step.graphs
    assert list(got) == list(want) and len(want) >= 10
    assert len({want[s] for s in want}) >= 6  # the passes did rewrite the graph
    assert got._items["final"] is got["final"]  # the live graph, not a copy
    for i, stage in enumerate(want):
        assert got[stage].code == want[stage], stage
        with open(tmp_path / "train_step" / "rank0" / f"{i:02d}_{stage}.py") as f:
            src = f.read()
        assert src.split("\n", 1)[1] == want_dump[stage], stage
    assert got.recordings() < len(want) - 1  # no-op passes shared a copy
