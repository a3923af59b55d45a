"""passes.update_schedule (run by overlap_optimizer): foreach and for-loop optimizer updates
start right after their bucket's wait; a global quantity (a clip coefficient) holds them back."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from passes import collectives as C
from passes.invariants import InvariantViolation, check_invariants, fingerprint
from passes.meta import Phase, Role
from passes.optimizer_overlap import overlap_optimizer
from passes.scheduling import sink_waits
from passes.update_schedule import SPLIT_OF, is_foreach
from tests.unit.passes.graphs import Builder, assert_untouched, aten, check_same_results, clone_gm


def _buckets(world, *, foreach: bool, clip: bool = False) -> fx.GraphModule:
    """Momentum SGD over three parameters, one bucket each (waits sunk to their first use):

    foreach:  mul_([b0 b1 b2]) w0 w1 w2 add_([b0 b1 b2], [w0 w1 w2]) add_([p0 p1 p2], [b0 b1 b2])
    for-loop: mul_(b0) w0 add_(b0, w0) add_(p0, b0) mul_(b1) w1 ... (the chains run in
              parameter order, so the first wait is on g0's reduction, issued last)
    clip:     every gradient scaled by a coefficient summed over all three, before the update
    """
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    ps = [b.input(f"p{i}", 4 + i) for i in range(3)]
    bufs = [b.input(f"b{i}", 4 + i, role=Role.OPTIM_STATE) for i in range(3)]
    # Reduced in reverse order, as backward produces them.
    waits = [b.all_reduce(b.input(f"g{i}", 4 + i, role=Role.GRAD)) for i in (2, 1, 0)][::-1]
    b.phase = Phase.OPTIMIZER
    if clip:
        sums = [b.op(aten.sum.default, w, role=Role.UPDATE) for w in waits]
        coef = b.op(aten.add.Tensor, b.op(aten.add.Tensor, sums[0], sums[1]), sums[2], role=Role.UPDATE)
        b.op(aten._foreach_mul_.Tensor, waits, coef, role=Role.UPDATE)
    if foreach:
        b.op(aten._foreach_mul_.Scalar, bufs, 0.9, role=Role.UPDATE)
        b.op(aten._foreach_add_.List, bufs, waits, role=Role.UPDATE)
        b.op(aten._foreach_add_.List, ps, bufs, role=Role.UPDATE)
    else:
        for i in range(3):
            b.op(aten.mul_.Tensor, bufs[i], 0.9, role=Role.UPDATE)
            b.op(aten.add_.Tensor, bufs[i], waits[i], role=Role.UPDATE)
            b.op(aten.add_.Tensor, ps[i], bufs[i], role=Role.UPDATE)
    return sink_waits(b.finish(*ps, *bufs))


def _order(gm: fx.GraphModule) -> str:
    """Waits as ``w<i>`` (``g<i>``'s), updates as ``op[<first args>]``, in graph order."""
    out = []
    for n in gm.graph.nodes:
        if C.is_wait(n):
            out.append("w" + C.collective_of(n).args[0].name[-1])
        elif n.op == "call_function" and n.target in (aten.mul_.Tensor, aten.add_.Tensor):
            out.append(f"{n.target._schema.name[6:]}[{n.args[0].name}]")
        elif is_foreach(n) and C.is_wait(n.args[0][0]):
            out.append("clip")
        elif is_foreach(n) and n.args[0][0].op == "placeholder":
            name = n.target._schema.name[6:].removeprefix("_foreach_")
            out.append(f"{name}[{' '.join(a.name for a in n.args[0])}]")
    return " ".join(out)


def test_foreach_ops_split_per_bucket(world):
    """
    before: mul_[b0 b1 b2] w2 w1 w0 add_[b0 b1 b2] add_[p0 p1 p2]
    after:  mul_[b0 b1 b2] w2 add_[b2] add_[p2] w1 add_[b1] add_[p1] w0 add_[b0] add_[p0]
    """
    gm = _buckets(world, foreach=True)
    assert _order(gm) == "mul_[b0 b1 b2] w2 w1 w0 add_[b0 b1 b2] add_[p0 p1 p2]"
    ref = clone_gm(gm)
    assert overlap_optimizer(gm) is gm
    check_invariants(gm)
    assert fingerprint(gm) == fingerprint(ref)
    assert _order(gm) == "mul_[b0 b1 b2] w2 add_[b2] add_[p2] w1 add_[b1] add_[p1] w0 add_[b0] add_[p0]"
    assert all(SPLIT_OF in n.meta for n in gm.graph.nodes if is_foreach(n) and len(n.args[0]) == 1)
    check_same_results(ref, gm, world)


def test_for_loop_chains_move_up_to_their_wait(world):
    """
    before: mul_[b0] w0 add_[b0] add_[p0] mul_[b1] w1 add_[b1] add_[p1] mul_[b2] w2 ...
    after:  mul_[b0] mul_[b1] mul_[b2] w2 add_[b2] add_[p2] w1 ... w0 add_[b0] add_[p0]
    (waits in the order their reductions were issued: g2's first)
    """
    gm = _buckets(world, foreach=False)
    assert _order(gm) == (
        "mul_[b0] w0 add_[b0] add_[p0] mul_[b1] w1 add_[b1] add_[p1] mul_[b2] w2 add_[b2] add_[p2]"
    )
    ref = clone_gm(gm)
    assert overlap_optimizer(gm) is gm
    check_invariants(gm)
    assert _order(gm) == (
        "mul_[b0] mul_[b1] mul_[b2] w2 add_[b2] add_[p2] w1 add_[b1] add_[p1] w0 add_[b0] add_[p0]"
    )
    check_same_results(ref, gm, world)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_a_global_clip_holds_every_update_back(world, foreach):
    """Every gradient is scaled by a coefficient of all three: every update that reads a
    gradient stays after the clip, which needs the last wait (only the momentum decay, which
    reads no gradient, and the waits themselves move up)."""
    gm = _buckets(world, foreach=foreach, clip=True)
    ref = clone_gm(gm)
    overlap_optimizer(gm)
    check_invariants(gm)
    order = _order(gm).split(" ")
    clip = order.index("clip")
    assert {"w0", "w1", "w2"} <= set(order[:clip])
    assert not [x for x in order[:clip] if x.startswith("add_")]
    check_same_results(ref, gm, world)


def test_nothing_to_move_is_a_no_op(world):
    """One bucket, its wait right before the updates: nothing can start earlier."""
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    p = b.input("p", 4)
    w = b.all_reduce(b.input("g", 4, role=Role.GRAD))
    b.phase = Phase.OPTIMIZER
    b.op(aten.add_.Tensor, p, w, role=Role.UPDATE)
    assert_untouched(overlap_optimizer, b.finish(p))


def test_checker_catches_an_element_computed_twice(world):
    gm = _buckets(world, foreach=True)
    overlap_optimizer(gm)
    calls = [n for n in gm.graph.nodes if is_foreach(n) and SPLIT_OF in n.meta]
    c = calls[-1]
    info = c.meta[SPLIT_OF]
    twin = next(d for d in calls if d is not c and d.meta[SPLIT_OF]["source"] == info["source"])
    c.meta[SPLIT_OF] = {**info, "index": twin.meta[SPLIT_OF]["index"]}
    with pytest.raises(InvariantViolation) as err:
        check_invariants(gm)
    assert "optimizer-split" in err.value.rules
    assert "also computed by" in str(err.value)


def test_recorded_names_survive_strip_grad_tags() -> None:
    """The split invariant records which node each element reads; strip_grad_tags replaces a
    tag by its input (or, where the tag is written in place, by a clone of it). Found by
    tests/dist/test_ignored_and_styles.py: an ignored parameter's gradient reaches the foreach
    optimizer through its tag, and the recorded name changed when the tag went away."""
    from passes.cleanup import strip_grad_tags, untagged_name
    from passes.ops import TAG_GRAD

    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    for p in (x, y):
        p.meta["val"] = torch.zeros(3)
    tx, ty = g.call_function(TAG_GRAD, (x, "a")), g.call_function(TAG_GRAD, (y, "b"))
    g.call_function(torch.ops.aten.mul_.Tensor, (ty, 2.0))  # ty written in place: becomes a clone
    out = g.call_function(torch.ops.aten._foreach_add.List, ([tx, ty], [x, y]))
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    before = [untagged_name(a) for a in out.args[0]]
    strip_grad_tags(gm)
    assert [a.target for a in out.args[0]] != [TAG_GRAD, TAG_GRAD]  # the tags are gone
    assert [untagged_name(a) for a in out.args[0]] == before == ["x", "y"]
