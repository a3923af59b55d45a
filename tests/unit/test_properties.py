"""Property tests at world size 1: for any MLP shape and batch size, the compiled step equals
eager bit for bit (SGD and fused AdamW, whose traced math is eager's).

Hypothesis draws depth (1-4 Linear layers), widths (1-24, so 1-wide layers and odd sizes
occur) and batch size (1-6); each example trains three steps compiled and eager from the
same initial values and compares every loss, parameter and optimizer state tensor. The
world-size-2 counterpart runs a fixed random sample against DDP
(tests/dist/test_reliability.py::test_random_mlps_match_ddp).
"""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd
from tests import models
from tests.random_models import RandomMLP

OPTIMIZERS = ["sgd_momentum_foreach", "sgd_default", "adamw_fused", "adam_fused"]


@settings(max_examples=12, deadline=None, database=None)
@given(
    widths=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    batch=st.integers(1, 6),
    optim=st.sampled_from(OPTIMIZERS),
    seed=st.integers(0, 2**16),
)
def test_random_mlp_matches_eager_bitwise(widths: list[int], batch: int, optim: str, seed: int) -> None:
    torch.manual_seed(seed)
    compiled = RandomMLP(widths)
    eager = copy.deepcopy(compiled)
    co, eo = models.make_optimizer(optim, compiled), models.make_optimizer(optim, eager)
    step = spmd.compile()(models.train_step)
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(3):
        x, y = torch.randn(batch, widths[0], generator=g), torch.randint(0, 4, (batch,), generator=g)
        got, want = step(compiled, co, x, y), models.train_step(eager, eo, x, y)
        assert torch.equal(got, want), f"step {i}: loss {got.item()!r} != eager {want.item()!r}"
    assert step.num_graphs == 1
    for (n, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), f"parameter {n}: max diff {(p - q).abs().max().item():.3g}"
    cs, es = co.state_dict()["state"], eo.state_dict()["state"]
    assert cs.keys() == es.keys()
    for i, entries in es.items():
        for k, v in entries.items():
            assert torch.equal(cs[i][k], v), f"optimizer state #{i}.{k}"
