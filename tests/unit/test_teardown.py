"""A gloo group still alive at exit is named before the interpreter finalizes
(spmd/backend/teardown.py; the abort it prevents: benchmarks/results/crashes.md, "Teardown")."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

import spmd
from spmd.backend import teardown
from tests import models


def test_a_gloo_group_alive_at_exit_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    registered: list = []
    monkeypatch.setattr(teardown, "_registered", False)
    monkeypatch.setattr(teardown.atexit, "register", registered.append)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = models.build("mlp")
        optim = models.make_optimizer("sgd_default", model)
        step = spmd.compile(parallel_mode=spmd.DataParallel())(models.train_step)
        for _ in range(2):  # the second call registers nothing more
            step(model, optim, *next(iter(models.batches("mlp", 1))))
        assert registered.count(teardown.check_at_exit) == 1  # torch registers its own as it imports
        with pytest.warns(RuntimeWarning, match=r"destroy_process_group\(\).*#190489"):
            teardown.check_at_exit()
    finally:
        dist.destroy_process_group()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        teardown.check_at_exit()  # destroyed: nothing to say
