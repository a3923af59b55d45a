"""passes.scheduling: waits sink to their first real use, and rise again to keep in-flight bytes in budget.

Nodes are named in the docstrings as in the assertions: ``_order`` lists the labelled nodes of
a graph in graph order, so a test states the whole schedule it expects.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch.fx as fx

from passes import collectives as C
from passes.invariants import check_invariants, fingerprint
from passes.meta import Phase, Role
from passes.scheduling import inflight_profile, limit_inflight, sink_waits
from tests.unit.passes.graphs import (
    Builder,
    assert_untouched,
    aten,
    c10d,
    check_same_results,
    clone_gm,
)


def _order(gm: fx.GraphModule, nodes: dict[str, fx.Node]) -> str:
    """The labels of ``nodes``, in graph order, space-separated."""
    where = {n: i for i, n in enumerate(gm.graph.nodes)}
    return " ".join(sorted(nodes, key=lambda k: where[nodes[k]]))


def _checked(graph_pass, gm: fx.GraphModule, world=None) -> fx.GraphModule:
    """Run ``graph_pass`` on ``gm`` (in place); the invariants hold, collectives are issued exactly as
    before, and (given a world) the results are unchanged."""
    ref = clone_gm(gm)
    assert graph_pass(gm) is gm
    check_invariants(gm)
    assert fingerprint(gm) == fingerprint(ref)
    if world is not None:
        check_same_results(ref, gm, world)
    return gm


# ----------------------------------------------------------------------------- sink_waits


def test_a_wait_moves_to_just_before_its_first_real_user(world):
    """
    before: g -> ar -> wait ; x -> relu -> exp ; mul(wait, exp)
    after:  ar relu exp wait mul    (relu and exp overlap the all-reduce)
    """
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    wait = b.all_reduce(b.input("g", 4, role=Role.GRAD))
    relu = b.op(aten.relu.default, b.input("x", 4, role=Role.ACTIVATION))
    exp = b.op(aten.exp.default, relu)
    mul = b.op(aten.mul.Tensor, wait, exp)
    gm = b.finish(mul)
    nodes = {"ar": C.collective_of(wait), "wait": wait, "relu": relu, "exp": exp, "mul": mul}

    _checked(sink_waits, gm, world)

    assert _order(gm, nodes) == "ar relu exp wait mul"


def test_a_gathered_parameters_view_chain_moves_with_its_wait(world):
    """
    before: p (padded shard) -> ag -> wait -> slice -> view(2, 2) -> detach ;
            x -> relu -> exp ; mul(detach, exp)
    after:  ag relu exp wait slice view detach mul   (the first real user is mul, not the slice)
    """
    b = Builder(group=world.group, world_size=world.size)
    wait = b.all_gather(b.input("p", 4))
    sl = b.op(aten.slice.Tensor, wait, 0, 0, 4)
    view = b.op(aten.view.default, sl, [2, 2])
    det = b.op(aten.detach.default, view)
    relu = b.op(aten.relu.default, b.input("x", 2, 2, role=Role.INPUT))
    exp = b.op(aten.exp.default, relu)
    mul = b.op(aten.mul.Tensor, det, exp)
    gm = b.finish(mul)
    nodes = {"ag": C.collective_of(wait), "wait": wait, "slice": sl, "view": view, "detach": det}
    nodes |= {"relu": relu, "exp": exp, "mul": mul}

    _checked(sink_waits, gm, world)

    assert _order(gm, nodes) == "ag relu exp wait slice view detach mul"


def test_a_buckets_split_moves_with_its_wait(world):
    """
    before: flat g (6) -> ar -> wait -> split(3) -> getitem 0, getitem 1 ; x -> relu -> exp ;
            add(getitem 0, exp) ; neg(getitem 1)
    after:  ar relu exp wait split get0 get1 add neg
    """
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    wait = b.all_reduce(b.input("g", 6, role=Role.GRAD))
    split = b.op(aten.split.Tensor, wait, 3)
    get0, get1 = b.op(operator.getitem, split, 0), b.op(operator.getitem, split, 1)
    relu = b.op(aten.relu.default, b.input("x", 3, role=Role.ACTIVATION))
    exp = b.op(aten.exp.default, relu)
    add = b.op(aten.add.Tensor, get0, exp)
    neg = b.op(aten.neg.default, get1)
    gm = b.finish(add, neg)
    nodes = {"ar": C.collective_of(wait), "wait": wait, "split": split, "get0": get0, "get1": get1}
    nodes |= {"relu": relu, "exp": exp, "add": add, "neg": neg}

    _checked(sink_waits, gm, world)

    assert _order(gm, nodes) == "ar relu exp wait split get0 get1 add neg"


def test_a_pass_through_read_only_later_stays_where_it_is():
    """
    before: ag -> wait ; relu(x) ; mul(wait, relu) ; view(wait) -> output
    after:  ag relu wait mul view   (the view is already after the first user: it does not move up);
    a second run has nothing to do
    """
    b = Builder()
    wait = b.all_gather(b.input("p", 4))
    relu = b.op(aten.relu.default, b.input("x", 8, role=Role.INPUT))
    mul = b.op(aten.mul.Tensor, wait, relu)
    view = b.op(aten.view.default, wait, [2, 4])
    gm = b.finish(mul, view)
    nodes = {"ag": C.collective_of(wait), "wait": wait, "relu": relu, "mul": mul, "view": view}

    _checked(sink_waits, gm)

    assert _order(gm, nodes) == "ag relu wait mul view"
    assert_untouched(sink_waits, gm)


def test_a_wait_read_only_by_the_output_sinks_to_the_end():
    """before: g -> ar -> wait ; relu(x) -> output(wait, relu)    after: ar relu wait"""
    b = Builder()
    b.phase = Phase.BACKWARD
    wait = b.all_reduce(b.input("g", 4, role=Role.GRAD))
    relu = b.op(aten.relu.default, b.input("x", 4, role=Role.ACTIVATION))
    gm = b.finish(wait, relu)
    _checked(sink_waits, gm)
    assert _order(gm, {"ar": C.collective_of(wait), "wait": wait, "relu": relu}) == "ar relu wait"


def test_waits_pass_each_other_but_collectives_keep_their_order():
    """
    before: ar0 w0 ; ar1 w1 ; ag2 w2 ; relu(x) ; use2(w2) ; use1(w1) ; use0(w0)
    after:  ar0 ar1 ag2 relu w2 use2 w1 use1 w0 use0   (collectives still ar0, ar1, ag2)
    """
    b = Builder()
    b.phase = Phase.BACKWARD
    w0 = b.all_reduce(b.input("g0", 4, role=Role.GRAD))
    w1 = b.all_reduce(b.input("g1", 4, role=Role.GRAD))
    w2 = b.all_gather(b.input("p2", 2))
    relu = b.op(aten.relu.default, b.input("x", 4, role=Role.ACTIVATION))
    uses = {f"use{i}": b.op(aten.mul.Tensor, w, relu) for i, w in ((2, w2), (1, w1), (0, w0))}
    gm = b.finish(*uses.values())
    nodes = {f"w{i}": w for i, w in enumerate((w0, w1, w2))} | uses | {"relu": relu}
    nodes |= {"ar0": C.collective_of(w0), "ar1": C.collective_of(w1), "ag2": C.collective_of(w2)}

    _checked(sink_waits, gm)

    assert _order(gm, nodes) == "ar0 ar1 ag2 relu w2 use2 w1 use1 w0 use0"


def test_coalesced_waits_sink_and_their_getitems_stay(world):
    """
    before: [a, c] -> ar_coalesced -> get0 -> w0, get1 -> w1 ; relu(x) ; add(w0, relu) ; mul(w1, relu)
    after:  ar get0 get1 relu w0 add w1 mul
    """
    b = Builder(group=world.group, world_size=world.size)
    b.phase = Phase.BACKWARD
    a, c = b.input("a", 4, role=Role.GRAD), b.input("c", 4, role=Role.GRAD)
    w0, w1 = b.coalesced(c10d.all_reduce_coalesced.default, [a, c], "sum", world.group)
    relu = b.op(aten.relu.default, b.input("x", 4, role=Role.ACTIVATION))
    add, mul = b.op(aten.add.Tensor, w0, relu), b.op(aten.mul.Tensor, w1, relu)
    gm = b.finish(add, mul)
    coll = C.collective_of(w0)
    nodes = {"ar": coll, "get0": w0.args[0], "get1": w1.args[0], "w0": w0, "w1": w1}
    nodes |= {"relu": relu, "add": add, "mul": mul}

    _checked(sink_waits, gm, world)

    assert _order(gm, nodes) == "ar get0 get1 relu w0 add w1 mul"


def test_waits_already_at_their_first_use_are_untouched():
    """
    ag -> wait -> mul(wait, x)
    ag -> wait -> slice -> view -> add(view, x)
    ag -> wait -> mul(wait, x) -> view(wait)  (a pass-through read after the first user)
    and a graph without collectives
    """
    for chain in ("mul", "slice-view-add", "mul-then-view"):
        b = Builder()
        wait, x = b.all_gather(b.input("p", 2)), b.input("x", 4, role=Role.INPUT)
        outs = []
        if chain == "slice-view-add":
            view = b.op(aten.view.default, b.op(aten.slice.Tensor, wait, 0, 0, 4), [4])
            outs.append(b.op(aten.add.Tensor, view, x))
        else:
            outs.append(b.op(aten.mul.Tensor, wait, x))
        if chain == "mul-then-view":
            outs.append(b.op(aten.view.default, wait, [2, 2]))
        assert_untouched(sink_waits, b.finish(*outs))
    b = Builder()
    assert_untouched(sink_waits, b.finish(b.op(aten.neg.default, b.input("x", 3))))


# ----------------------------------------------------------------------------- limit_inflight


def _all_issued_then_waited(sizes: list[int], group: str = "0") -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """
    backward, as sink_waits leaves it:  g_i (sizes[i] floats) -> ar_i ; relu_i   for each i
                                        w_i -> mul_i                             for each i
    Labels: ar_i, relu_i, w_i, mul_i.
    """
    b = Builder(group=group, world_size=1)
    b.phase = Phase.BACKWARD
    h = b.input("x", 4, role=Role.ACTIVATION)
    grads = [b.input(f"g{i}", n, role=Role.GRAD) for i, n in enumerate(sizes)]
    nodes: dict[str, fx.Node] = {}
    for i, g in enumerate(grads):
        nodes[f"ar{i}"] = b.op(c10d.all_reduce.default, g, "avg", group, role=Role.COMM)
        nodes[f"relu{i}"] = h = b.op(aten.relu.default, h)
    for i in range(len(sizes)):
        nodes[f"w{i}"] = b.op(C.WAIT, nodes[f"ar{i}"], role=Role.COMM)
        nodes[f"mul{i}"] = b.op(aten.mul.Tensor, nodes[f"w{i}"], 2.0, role=Role.GRAD)
    return b.finish(h, *[nodes[f"mul{i}"] for i in range(len(sizes))]), nodes


def _profile(gm: fx.GraphModule) -> list[int]:
    return [inflight for _, inflight in inflight_profile(gm)]


def test_a_budget_below_two_collectives_waits_on_each_before_the_next(world):
    """
    before: ar0 relu0 ar1 relu1 ar2 relu2 ar3 relu3 w0 mul0 w1 mul1 w2 mul2 w3 mul3   (64 bytes each)
    budget 100: before each ar_i, the oldest outstanding wait is pulled up
    after:  ar0 relu0 w0 ar1 relu1 w1 ar2 relu2 w2 ar3 relu3 mul0 mul1 mul2 w3 mul3
    """
    gm, nodes = _all_issued_then_waited([16] * 4, world.group)
    assert _profile(gm) == [64, 128, 192, 256]

    _checked(functools.partial(limit_inflight, max_inflight_bytes=100), gm, world)

    assert _order(gm, nodes) == "ar0 relu0 w0 ar1 relu1 w1 ar2 relu2 w2 ar3 relu3 mul0 mul1 mul2 w3 mul3"
    assert _profile(gm) == [64, 64, 64, 64]


def test_the_oldest_collective_is_waited_on_first():
    """
    the same four 64-byte all-reduces, budget 150 (two fit, not three)
    after: ar0 relu0 ar1 relu1 w0 ar2 relu2 w1 ar3 relu3 mul0 mul1 w2 mul2 w3 mul3
    """
    gm, nodes = _all_issued_then_waited([16] * 4)
    _checked(functools.partial(limit_inflight, max_inflight_bytes=150), gm)
    assert _order(gm, nodes) == "ar0 relu0 ar1 relu1 w0 ar2 relu2 w1 ar3 relu3 mul0 mul1 w2 mul2 w3 mul3"
    assert _profile(gm) == [64, 128, 128, 128]


def test_a_collective_larger_than_the_budget_runs_alone():
    """
    all-reduces of 64, 256, 64, 64 bytes; budget 150
    ar1 alone exceeds it: w0 comes before ar1, w1 before ar2; then ar2 and ar3 fit together
    """
    gm, nodes = _all_issued_then_waited([16, 64, 16, 16])
    _checked(functools.partial(limit_inflight, max_inflight_bytes=150), gm)
    assert _order(gm, nodes) == "ar0 relu0 w0 ar1 relu1 w1 ar2 relu2 ar3 relu3 mul0 mul1 w2 mul2 w3 mul3"
    assert _profile(gm) == [64, 256, 64, 128]


@pytest.mark.parametrize("budget", [0, 1, 63, 64, 100, 128, 200, 300, 512])
def test_the_profile_never_exceeds_the_budget(budget):
    """all-reduces of 64, 256, 32, 128, 64, 64 bytes, all issued before any wait; any budget"""
    gm, _ = _all_issued_then_waited([16, 64, 8, 32, 16, 16])
    _checked(functools.partial(limit_inflight, max_inflight_bytes=budget), gm)
    for coll, inflight in inflight_profile(gm):
        assert inflight <= max(budget, C.bytes_of(coll))  # over the budget only when alone
        if inflight > budget:
            assert inflight == C.bytes_of(coll)


def test_a_cap_of_one_collective_waits_on_each_before_the_next_whatever_the_bytes():
    """
    four 64-byte all-reduces, no byte budget, at most one collective in flight (spmd's setting
    for a gloo group with several threads)
    after: ar0 relu0 w0 ar1 relu1 w1 ar2 relu2 w2 ar3 relu3 mul0 mul1 mul2 w3 mul3
    a cap of two: one wait pulled up per collective from the third on
    """
    gm, nodes = _all_issued_then_waited([16] * 4)
    _checked(functools.partial(limit_inflight, max_inflight_bytes=None, max_inflight_collectives=1), gm)
    assert _order(gm, nodes) == "ar0 relu0 w0 ar1 relu1 w1 ar2 relu2 w2 ar3 relu3 mul0 mul1 mul2 w3 mul3"
    gm, nodes = _all_issued_then_waited([16] * 4)
    _checked(functools.partial(limit_inflight, max_inflight_bytes=None, max_inflight_collectives=2), gm)
    assert _order(gm, nodes) == "ar0 relu0 ar1 relu1 w0 ar2 relu2 w1 ar3 relu3 mul0 mul1 w2 mul2 w3 mul3"
    with pytest.raises(ValueError, match=">= 1"):
        limit_inflight(gm, max_inflight_collectives=0)


def test_auto_allows_twice_the_largest_collective():
    """
    all-reduces of 64, 128, 64, 64 bytes: "auto" is 256 bytes (unlimited, ar3 would make 320)
    after: w0 comes before ar3; the same schedule as an explicit 256
    """
    gm, nodes = _all_issued_then_waited([16, 32, 16, 16])
    assert _profile(gm) == [64, 192, 256, 320]
    explicit = _checked(functools.partial(limit_inflight, max_inflight_bytes=256), clone_gm(gm))

    _checked(limit_inflight, gm)  # "auto" is the default

    assert _order(gm, nodes) == "ar0 relu0 ar1 relu1 ar2 relu2 w0 ar3 relu3 mul0 w1 mul1 w2 mul2 w3 mul3"
    assert _profile(gm) == [64, 192, 256, 256]
    assert [n.name for n in explicit.graph.nodes] == [n.name for n in gm.graph.nodes]


def test_coalesced_waits_are_pulled_up_with_their_getitems():
    """
    [a, c] (4 floats each) -> ar_coalesced -> get0, get1 ; relu ; g (4 floats) -> ar ; relu ; w0 w1 w ...
    budget 40 bytes (the coalesced 32 plus 16 do not fit): get0 w0 get1 w1 move up before ar
    """
    b = Builder()
    b.phase = Phase.BACKWARD
    a, c, g = (b.input(name, 4, role=Role.GRAD) for name in "acg")
    w0, w1 = b.coalesced(c10d.all_reduce_coalesced.default, [a, c], "sum", "0")
    relu = b.op(aten.relu.default, b.input("x", 4, role=Role.ACTIVATION))
    ar = b.op(c10d.all_reduce.default, g, "avg", "0", role=Role.COMM)
    relu2 = b.op(aten.relu.default, relu)
    gm = b.finish(relu2, *[b.op(aten.mul.Tensor, w, 2.0) for w in (w0, w1, b.op(C.WAIT, ar, role=Role.COMM))])
    gm = sink_waits(gm)  # the coalesced waits now sit at the muls, after ar
    nodes = {"ar_co": C.collective_of(w0), "get0": w0.args[0], "get1": w1.args[0], "w0": w0, "w1": w1}
    nodes |= {"relu": relu, "ar": ar, "relu2": relu2}
    assert _order(gm, nodes) == "ar_co get0 get1 relu ar relu2 w0 w1"

    _checked(functools.partial(limit_inflight, max_inflight_bytes=40), gm)

    assert _order(gm, nodes) == "ar_co relu get0 w0 get1 w1 ar relu2"
    assert _profile(gm) == [32, 16]


def test_no_limit_or_a_budget_never_reached_returns_the_same_untouched_module():
    """the four 64-byte all-reduces (256 in flight at most): budget None, 256, 10**9; and "auto"
    on a graph without collectives"""
    for budget in (None, 256, 10**9):
        gm, _ = _all_issued_then_waited([16] * 4)
        assert_untouched(functools.partial(limit_inflight, max_inflight_bytes=budget), gm)
    b = Builder()
    assert_untouched(limit_inflight, b.finish(b.op(aten.neg.default, b.input("x", 3))))
