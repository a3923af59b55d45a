"""spmd.backend.optimizer_checks: a fused optimizer state tensor of the wrong shape raises at
compile instead of being written past its end by the kernel."""

from __future__ import annotations

import pytest
import torch

import spmd
from tests import models


@pytest.mark.parametrize("which", ["exp_avg", "exp_avg_sq"])
def test_mismatched_fused_adam_state_raises(which: str) -> None:
    model = models.build("mlp")
    opt = models.make_optimizer("adamw_fused", model)
    step = spmd.compile()(models.train_step)
    batches = list(models.batches("mlp", 2))
    step(model, opt, *batches[0])
    p = next(iter(model.parameters()))
    # Smaller than the parameter: the kernel would write past its end (heap corruption on main).
    opt.state[p][which] = torch.zeros(3)
    with pytest.raises(spmd.SpmdError, match=r"has shape \[3\], its parameter \[16, 8\]") as err:
        step(model, opt, *batches[1])
    assert isinstance(err.value, spmd.ConfigError)
    assert "optimizer.state.clear()" in str(err.value)  # names the fix
