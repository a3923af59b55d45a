"""spmd.Override: swap an untraceable submodule for a traceable stand-in, then see the graph."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import spmd
from passes import meta
from tests import models

LIMIT = 2.0  # the gate's threshold; the test batches fall on both sides of it


class Gate(nn.Module):
    """Normalises its output only when the norm is large: Python control flow on a tensor value."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        n = h.norm()
        if n > LIMIT:
            h = h / n
        return h


class GateStandIn(nn.Module):
    """The same computation with torch.where, reusing the original's Linear (and so its parameters)."""

    def __init__(self, orig: Gate):
        super().__init__()
        self.fc = orig.fc

    def forward(self, x):
        h = self.fc(x)
        n = h.norm()
        return torch.where(n > LIMIT, h / n, h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), Gate())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.body(x)))


class GateOverride(spmd.Override):
    def __init__(self, *, return_graph: bool = False):
        self.asked: list[str] = []
        self.seen: list[tuple[fx.GraphModule, list[torch.Tensor]]] = []
        self.return_graph = return_graph

    def replacement(self, fqn, orig_submodule):
        self.asked.append(fqn)
        return GateStandIn(orig_submodule) if isinstance(orig_submodule, Gate) else orig_submodule

    def transform(self, gm, flat_state):
        self.seen.append((gm, list(flat_state)))
        return gm.graph if self.return_graph else gm


def _build():
    torch.manual_seed(0)
    return Net()


def _batches(steps):
    g = torch.Generator().manual_seed(7)
    # alternate small and large inputs so that both branches of the gate are taken
    return [
        ((0.1 if i % 2 else 3.0) * torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        for i in range(steps)
    ]


def test_data_dependent_submodule_fails_without_override():
    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(spmd.DataDependentControlFlowError, match="'body.1'"):
        spmd.compile()(models.train_step)(model, opt, *_batches(1)[0])


@pytest.mark.parametrize("return_graph", [False, True], ids=["returns_gm", "returns_graph"])
def test_override_compiles_and_trains_like_eager_with_stand_in(return_graph):
    model = _build()
    orig_gate = model.body[1]
    orig_params = [orig_gate.fc.weight, orig_gate.fc.bias]

    eager = models.twin(model)
    eager.body[1] = GateStandIn(eager.body[1])

    override = GateOverride(return_graph=return_graph)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    eopt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9, foreach=True)
    step = spmd.compile(module_override=[override])(models.train_step)
    norms: list[float] = []
    eager.body[1].fc.register_forward_hook(lambda mod, args, out: norms.append(out.detach().norm().item()))
    for x, y in _batches(8):
        assert torch.equal(step(model, opt, x, y), models.train_step(eager, eopt, x, y))
    assert min(norms) < LIMIT < max(norms)  # both branches of the where were exercised

    # the swap: the stand-in sits at body.1 and trains the original's parameters
    assert isinstance(model.body[1], GateStandIn)
    assert [model.body[1].fc.weight, model.body[1].fc.bias] == orig_params
    assert "body.1" in override.asked and "body" in override.asked
    assert not any(fqn.startswith("body.1.") for fqn in override.asked)  # no descent into a replaced module
    for (n, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(orig_params[0].detach(), _build().body[1].fc.weight.detach())

    # transform ran once, on the graph with the stand-in's nodes, with one tensor per placeholder
    assert len(override.seen) == 1
    gm, flat_state = override.seen[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(flat_state) == len(placeholders)
    for ph, t in zip(placeholders, flat_state):
        assert tuple(ph.meta["val"].shape) == tuple(t.shape), ph.name
    where = [n for n in gm.graph.nodes if n.target is torch.ops.aten.where.self]
    assert where and all(n.meta[meta.MODULE] == "body.1" for n in where)
    fwd_modules = {
        n.meta[meta.MODULE] for n in gm.graph.nodes if n.meta.get(meta.PHASE) is meta.Phase.FORWARD
    }
    assert {"body.0", "body.1", "body.1.fc", "head"} <= fwd_modules


def test_override_that_keeps_everything_changes_nothing():
    class Keep(spmd.Override):
        def replacement(self, fqn, orig_submodule):
            return orig_submodule

    model = models.build("mlp")
    modules = list(model.modules())
    opt = models.make_optimizer("sgd_momentum_foreach", model)
    spmd.compile(module_override=Keep())(models.train_step)(model, opt, *models.batches("mlp", 1)[0])
    assert list(model.modules()) == modules
