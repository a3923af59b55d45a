"""passes.optimizer_overlap: the fused optimizer update is split per bucket and each piece runs
right after its bucket's wait; a global quantity (a clip coefficient) holds every piece back.

Hand-built graphs use ``_fused_sgd_`` (momentum 0: no state lists); tests/unit/test_pipeline.py
checks the pass on traced TinyGPT steps (replicate and fully_shard).
"""

from __future__ import annotations

import pytest
import torch.fx as fx

from passes import collectives as C
from passes.invariants import InvariantViolation, check_invariants, fingerprint
from passes.meta import Phase, Role, set_meta
from passes.optimizer_overlap import is_fused_optimizer, overlap_optimizer
from passes.scheduling import sink_waits
from tests.unit.passes.graphs import Builder, assert_untouched, aten, check_same_results, clone_gm

SGD = dict(
    weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0, nesterov=False, maximize=False, is_first_step=False
)


def _fused_sgd(b: Builder, params: list[fx.Node], grads: list[fx.Node]) -> fx.Node:
    node = b.graph.call_function(aten._fused_sgd_.default, (params, grads, []), dict(SGD))
    set_meta(node, role=Role.UPDATE, phase=Phase.OPTIMIZER)
    return node


def _three_buckets(world, clip: bool = False) -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """
    ar0 ar1 ar2 | w0 w1 w2 [clip: sums -> coef ; _foreach_mul_(grads, coef)] | sgd([p0 p1 p2])
    (waits sunk to their first use, as the pipeline leaves them)
    """
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    ps = [b.input(f"p{i}", 4 + i) for i in range(3)]
    waits = [b.all_reduce(b.input(f"g{i}", 4 + i, role=Role.GRAD)) for i in range(3)]
    b.phase = Phase.OPTIMIZER
    if clip:
        sums = [b.op(aten.sum.default, w, role=Role.UPDATE) for w in waits]
        coef = b.op(aten.add.Tensor, b.op(aten.add.Tensor, sums[0], sums[1]), sums[2], role=Role.UPDATE)
        b.op(aten._foreach_mul_.Tensor, waits, coef, role=Role.UPDATE)
    _fused_sgd(b, ps, waits)
    gm = sink_waits(b.finish(*ps))
    labels = {f"w{i}": w for i, w in enumerate(waits)} | {f"p{i}": p for i, p in enumerate(ps)}
    return gm, labels


def _order(gm: fx.GraphModule) -> str:
    """Waits as ``w<i>``, fused calls as ``sgd[<params>]``, in graph order."""
    out = []
    for n in gm.graph.nodes:
        if C.is_wait(n):
            out.append("w" + n.args[0].args[0].name[-1])
        elif is_fused_optimizer(n):
            out.append("sgd[" + " ".join(p.name for p in n.args[0]) + "]")
    return " ".join(out)


def test_each_bucket_updated_right_after_its_wait(world):
    """
    before: w0 w1 w2 sgd[p0 p1 p2]
    after:  w0 sgd[p0] w1 sgd[p1] w2 sgd[p2]   (p0's update overlaps bucket 1's reduction)
    """
    gm, _ = _three_buckets(world)
    assert _order(gm) == "w0 w1 w2 sgd[p0 p1 p2]"
    ref = clone_gm(gm)
    assert overlap_optimizer(gm) is gm
    check_invariants(gm)
    assert fingerprint(gm) == fingerprint(ref)
    assert _order(gm) == "w0 sgd[p0] w1 sgd[p1] w2 sgd[p2]"
    check_same_results(ref, gm, world)


def test_a_global_clip_holds_every_update_back(world):
    """Every update reads the clip coefficient, which needs all three buckets: nothing to split."""
    gm, _ = _three_buckets(world, clip=True)
    assert_untouched(overlap_optimizer, gm)


def test_no_fused_optimizer_is_a_no_op(world):
    b = Builder(group=world.group, world_size=world.size)
    w = b.all_reduce(b.input("g", 4, role=Role.GRAD))
    assert_untouched(overlap_optimizer, b.finish(b.op(aten.relu.default, w)))


def test_checker_catches_a_parameter_updated_twice(world):
    gm, labels = _three_buckets(world)
    overlap_optimizer(gm)
    calls = [n for n in gm.graph.nodes if is_fused_optimizer(n)]
    last = calls[-1]
    last.args = ([labels["p0"], *last.args[0]], [labels["w0"], *last.args[1]], [])
    with pytest.raises(InvariantViolation) as err:
        check_invariants(gm)
    assert "optimizer-split" in err.value.rules
    assert "p0 also updated" in str(err.value)


def test_checker_catches_changed_per_parameter_arguments(world):
    gm, labels = _three_buckets(world)
    overlap_optimizer(gm)
    call = next(n for n in gm.graph.nodes if is_fused_optimizer(n))
    call.args = (call.args[0], [labels["p1"]], [])  # p0 stepped with p1 as its gradient
    with pytest.raises(InvariantViolation) as err:
        check_invariants(gm)
    assert "per-parameter arguments of p0 changed" in str(err.value)
