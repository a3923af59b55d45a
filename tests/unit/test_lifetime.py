"""A compiled step does not keep the model alive: ``del step, model, optim`` frees the parameters
and the optimizer state at once, as with DDP, without waiting for Python's cycle collector (on a
GPU the memory stayed allocated: a hook of the step's Executable held the step and its entry)."""

from __future__ import annotations

import gc
import weakref

import pytest

import spmd
from tests import models


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_dropping_the_step_frees_the_model_without_the_cycle_collector(style: str) -> None:
    # torch imports dynamo lazily in the first optimizer's __init__, and that import leaves its
    # frames (and the model they name) in a cycle once: not the step's doing, so done beforehand.
    models.make_optimizer("adamw_fused", models.build("mlp"))
    gc.collect()
    gc.disable()
    try:
        model = models.build("mlp")
        optim = models.make_optimizer("adamw_fused", model)
        step = spmd.compile(parallel_mode=spmd.DataParallel(style))(models.train_step)
        for x, y in models.batches("mlp", 2):
            step(model, optim, x, y)
        held = [next(model.parameters()), next(iter(optim.state.values()))["exp_avg"], model, step]
        refs = [weakref.ref(o) for o in held]
        del held, step, model, optim
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert not alive, f"still alive without gc.collect(): {alive}"
    finally:
        gc.enable()
