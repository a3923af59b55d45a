"""passes.cleanup.drop_identity_views: views that are their input's own layout go, nothing else."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.cleanup import check_identity_views, drop_identity_views
from passes.invariants import check_invariants
from passes.meta import GRAD_OF, Phase, Role
from tests.unit.passes.graphs import Builder, assert_untouched, aten, clone_gm, flat, inputs_for


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _graph() -> fx.GraphModule:
    """
    x @ w.t() -> t -> t -> detach -> mul_ (in place: writes mm's buffer) -> out
    x -> detach -> relu ; a transpose that changes the layout (one t) stays
    """
    b = Builder()
    w = b.input("w", 4, 8, role=Role.ACTIVATION)
    x = b.input("x", 3, 8, role=Role.INPUT)
    b.phase = Phase.BACKWARD
    g = b.op(aten.mm.default, x, b.op(aten.t.default, w))  # 3 x 4
    tt = b.op(aten.t.default, b.op(aten.t.default, g))
    d = b.op(aten.detach.default, tt)
    scaled = b.op(aten.mul_.Scalar, d, 0.5)
    r = b.op(aten.relu.default, b.op(aten.detach.default, x))
    return b.finish(scaled, r)


def test_detach_and_double_transposes_go_with_the_same_results():
    gm = _graph()
    ref = clone_gm(gm)
    assert drop_identity_views(gm) is gm
    assert _targets(gm) == ["aten.t.default", "aten.mm.default", "aten.mul_.Scalar", "aten.relu.default"]
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul_.Scalar)
    assert mul.args[0].target is aten.mm.default  # writes mm's buffer in place, as it wrote the view
    args = inputs_for(ref)
    assert all(torch.equal(a, b) for a, b in zip(flat(gm(*args)), flat(ref(*args))))
    assert check_identity_views(gm) == []
    check_invariants(gm)


def test_an_output_a_gradient_and_a_layout_change_stay():
    b = Builder()
    x = b.input("x", 3, 8, role=Role.INPUT)
    one_t = b.op(aten.t.default, x)  # changes the layout
    grad = b.op(aten.detach.default, b.op(aten.relu.default, x), role=Role.GRAD)
    grad.meta[GRAD_OF] = "w"
    returned = b.op(aten.detach.default, b.op(aten.mul.Tensor, one_t, 2.0))  # the graph's output
    gm = b.finish(returned, grad)
    assert_untouched(drop_identity_views, gm)
    assert sum(n.target is aten.detach.default for n in gm.graph.nodes) == 2


def test_the_eager_pipeline_drops_them_and_inductors_does_not():
    import spmd
    from spmd.pipeline import backend_pipeline

    gm = _graph()
    names = {
        b: [p.name for p in backend_pipeline(spmd.DataParallel("replicate"), gm, backend=b).passes]
        for b in ("eager", "inductor")
    }
    assert names["eager"][0] == "drop_identity_views" and "drop_identity_views" not in names["inductor"]
