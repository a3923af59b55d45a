"""passes.cleanup.fold_view_chains: the no-op views autograd's trace leaves are dropped.

x --t--> a --t--> b --detach--> d --> mm(y, d)        becomes        mm(y, x)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.cleanup import fold_view_chains
from passes.meta import ROLE, Role

aten = torch.ops.aten


def _graph(grad_role: bool = False, shared_root: bool = False) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    w = g.call_function(aten.mul.Tensor, (x, 2.0))
    a = g.call_function(aten.t.default, (w,))
    b = g.call_function(aten.t.default, (a,))
    d = g.call_function(aten.detach.default, (b,))
    m = g.call_function(aten.mm.default, (y, d))
    outs = [m]
    if shared_root:
        outs.append(g.call_function(aten.sum.default, (w,)))
    if grad_role:
        d.meta[ROLE] = Role.GRAD
        w.meta[ROLE] = Role.ACTIVATION
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g), {"w": w, "d": d, "m": m}


def _targets(gm: fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_chain_folds_to_its_root_with_the_same_result() -> None:
    gm, nodes = _graph()
    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.randn(5, 3)
    before = gm(x, y)
    assert fold_view_chains(gm) is gm
    assert _targets(gm) == [aten.mul.Tensor, aten.mm.default]
    assert nodes["m"].args[1] is nodes["w"]
    assert torch.equal(gm(x, y)[0], before[0])


def test_gradient_view_folds_only_onto_a_private_root() -> None:
    """A view with the gradient role is found by later passes and the report: it folds only when
    its root is used by nothing else, and then the root carries the role."""
    gm, nodes = _graph(grad_role=True, shared_root=True)
    fold_view_chains(gm)
    assert aten.detach.default in _targets(gm)  # kept: w is read by the sum too
    gm, nodes = _graph(grad_role=True)
    fold_view_chains(gm)
    assert aten.detach.default not in _targets(gm)
    assert nodes["w"].meta[ROLE] is Role.GRAD


def test_returned_or_written_views_stay_and_no_op_is_untouched() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    d1 = g.call_function(aten.detach.default, (x,))
    d2 = g.call_function(aten.detach.default, (x,))
    g.call_function(aten.add_.Tensor, (d2, 1.0))
    g.output((d1, d2))
    gm = fx.GraphModule(torch.nn.Module(), g)
    code = gm.code
    assert fold_view_chains(gm) is gm
    assert gm.code == code
    assert _targets(gm).count(aten.detach.default) == 2
