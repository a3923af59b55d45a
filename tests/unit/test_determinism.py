"""Determinism at world size 1: the same seed gives bit-identical losses and parameters, in one
process and across processes (a different PYTHONHASHSEED, so nothing may depend on the
iteration order of sets or dicts of strings). World size 2: tests/dist/test_reliability.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import spmd
from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(steps: int = 5) -> dict[str, list[torch.Tensor]]:
    """A fresh model, optimizer and compiled step from seed 0; dropout draws from the global RNG."""
    model = models.build("dropout")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile()(models.train_step)
    torch.manual_seed(1234)
    losses = [step(model, opt, x, y) for x, y in models.batches("dropout", steps)]
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()]}


def _assert_same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]], what: str) -> None:
    for key in ("losses", "params"):
        assert len(a[key]) == len(b[key])
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert torch.equal(x, y), f"{what}: {key}[{i}] differs"


def test_same_seed_same_bits_in_one_process():
    first, second = run(), run()
    _assert_same(first, second, "second run")
    assert len({x.item() for x in first["losses"]}) > 1, "the run did not train"


def test_same_seed_same_bits_across_processes(tmp_path):
    out = tmp_path / "run.pt"
    code = f"import torch; from tests.unit.test_determinism import run; torch.save(run(), {str(out)!r})"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    _assert_same(run(), torch.load(out), "the other process's run")
