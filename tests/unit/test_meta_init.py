"""Meta-device initialisation at world size 1 (no process group): the model built under
``torch.device("meta")`` is materialised in ``prepare`` with ``reset_parameters`` (or the
``param_init_fn``) in ``model.modules()`` order, which for these models is construction order,
so it equals the normally built model bit for bit and trains like eager.
The 2-rank tests (sharding, memory, DDP parity) are in tests/dist/test_meta_init.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd
from tests import models


def _meta_and_normal(name: str) -> tuple[nn.Module, nn.Module]:
    ctor = models.MODELS[name][0]
    torch.manual_seed(0)
    normal = ctor()
    with torch.device("meta"):
        meta = ctor()
    torch.manual_seed(0)  # materialisation runs at the first call, from this RNG state
    return meta, normal


@pytest.mark.parametrize("name", ["tinygpt", "convbn"])
def test_meta_model_equals_normal_model_and_trains_like_eager(name: str) -> None:
    meta, normal = _meta_and_normal(name)
    opt = torch.optim.AdamW(meta.parameters(), lr=1e-2, fused=True)  # over the meta parameters
    ref_opt = torch.optim.AdamW(normal.parameters(), lr=1e-2, fused=True)
    step = spmd.compile()(models.train_step)
    batches = models.batches(name, 3)
    spmd.DataParallel().distribute(meta, opt)
    for (n, p), (_, q) in zip(meta.named_parameters(), normal.named_parameters()):
        assert not p.is_meta and torch.equal(p, q), n
    for (n, b), (_, c) in zip(meta.named_buffers(), normal.named_buffers()):
        assert not b.is_meta and torch.equal(b, c), n
    if name == "tinygpt":
        assert meta.head.weight is meta.tok.weight  # tied weights stay tied
    for x, y in batches:
        assert torch.equal(step(meta, opt, x, y), models.train_step(normal, ref_opt, x, y))
    for (n, p), (_, q) in zip(meta.named_parameters(), normal.named_parameters()):
        assert torch.equal(p, q), n


def test_module_without_reset_parameters_names_the_tensor_and_the_fix() -> None:
    with torch.device("meta"):
        m = models.FrozenUnused()  # the root owns `scale` and `unused` and has no reset_parameters
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    x, y = models.batches("frozen_unused", 1)[0]
    with pytest.raises(spmd.ConfigError, match=r"'scale' is on the meta device.*param_init_fn"):
        spmd.compile()(models.train_step)(m, opt, x, y)


def test_param_init_fn_is_called_on_each_module_with_meta_tensors() -> None:
    with torch.device("meta"):
        m = models.FrozenUnused()
    seen: list[str] = []
    names = {id(mod): n for n, mod in m.named_modules()}

    def init(mod: nn.Module) -> None:
        seen.append(names[id(mod)])
        assert all(t.device.type == "cpu" for t in mod.parameters(recurse=False))  # allocated first
        if isinstance(mod, nn.Linear):
            mod.reset_parameters()
        else:
            nn.init.constant_(mod.scale, 0.5)
            nn.init.zeros_(mod.unused)

    spmd.DataParallel(param_init_fn=init).distribute(m)
    assert seen == ["", "fc1", "fc2"]
    assert torch.equal(m.scale, torch.full((16,), 0.5)) and not m.scale.requires_grad
    assert not any(p.is_meta for p in m.parameters())


def test_param_init_fn_must_be_callable() -> None:
    with pytest.raises(spmd.ConfigError, match="param_init_fn must be a function"):
        spmd.DataParallel(param_init_fn="reset")  # type: ignore[arg-type]


def test_partly_meta_model_is_refused_not_reinitialised() -> None:
    """Only a model whose parameters are all on meta is materialised; re-initialising one
    module of a half-loaded model would overwrite real values, so the device check refuses it."""
    m = models.build("mlp")
    m.net[2].to("meta")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = models.batches("mlp", 1)[0]
    with pytest.raises(spmd.InvalidArgumentsError, match="parameters are on different devices"):
        spmd.compile()(models.train_step)(m, opt, x, y)
