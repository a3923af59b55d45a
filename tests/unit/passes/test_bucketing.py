"""passes.bucketing: adjacent compatible collectives share one flat buffer; results stay bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx

from passes import collectives as C
from passes.bucketing import bucket_collectives, module_prefix
from passes.dedup import dedup_collectives
from passes.invariants import check_invariants, fingerprint
from passes.meta import GRAD_OF, MODULE, PHASE, ROLE, Phase, Role
from tests.unit.passes.graphs import (
    Builder,
    assert_untouched,
    aten,
    c10d,
    check_same_results,
    clone_gm,
    colls,
    inputs_for,
    run_ranks,
)

KiB = 1 / 1024  # in MiB, the unit of bucket_cap_mb


def _index(gm: fx.GraphModule, node: fx.Node) -> int:
    return list(gm.graph.nodes).index(node)


def _check_same_on_ranks(before: fx.GraphModule, after: fx.GraphModule, w: int) -> None:
    """Simulated ranks with different data each: every rank's every output identical, bit for bit,
    with the same strides (kernels downstream may round differently on other strides)."""
    per_rank = [inputs_for(before, seed=r) for r in range(w)]
    for ref, out in zip(run_ranks(before, per_rank), run_ranks(after, per_rank)):
        assert all(torch.equal(o, r) for o, r in zip(out, ref))
        assert [o.stride() for o in out] == [r.stride() for r in ref]


def _sizes(gm: fx.GraphModule) -> list[tuple]:
    """(kind, input shape) of each collective, in order."""
    return [(f[1], f[2][0]) for f in fingerprint(gm)]


# ----------------------------------------------------------------------------- one bucket per kind


def _grads(b: Builder, shapes, *, op: str = "avg") -> tuple[list[fx.Node], list[fx.Node]]:
    """g_i -> all_reduce -> wait_i, one after another in backward; returns (grads, waits)."""
    b.phase = Phase.BACKWARD
    grads, waits = [], []
    for i, shape in enumerate(shapes):
        g = b.input(f"g{i}", *shape, role=Role.GRAD, module=f"layers.{i}")
        wait = b.all_reduce(g, op)
        wait.meta[ROLE], wait.meta[GRAD_OF] = Role.GRAD, f"layers.{i}.weight"  # as the partitioner marks it
        grads.append(g)
        waits.append(wait)
    return grads, waits


def test_gradients_are_all_reduced_in_one_bucket(world):
    """
    g0 (4,3) -> all_reduce -> wait ; g1 (5,) -> all_reduce -> wait ; g2 (2,2,2) -> all_reduce -> wait
    -> optimizer: mul(wait_i, 2)
    after: cat(flat g0, g1, flat g2) -> all_reduce -> wait -> split -> view x3 -> mul x3
    """
    b = Builder(group=world.group, world_size=world.size)
    _, waits = _grads(b, [(4, 3), (5,), (2, 2, 2)])
    b.phase = Phase.OPTIMIZER
    outs = [b.op(aten.mul.Tensor, w, 2.0, role=Role.UPDATE) for w in waits]
    gm = b.finish(*outs)
    ref = clone_gm(gm)

    assert bucket_collectives(gm) is gm  # rewritten in place

    assert _sizes(gm) == [("all_reduce", (25,))]
    coll = C.collectives(gm.graph)[0]
    assert (coll.meta[ROLE], coll.meta[PHASE], coll.meta[MODULE]) == (Role.COMM, Phase.BACKWARD, "layers")
    # each consumer reads a piece that stands for its old wait, metadata included
    pieces = [o.args[0] for o in outs]
    assert [p.meta[GRAD_OF] for p in pieces] == [f"layers.{i}.weight" for i in range(3)]
    assert [tuple(p.meta["val"].shape) for p in pieces] == [(4, 3), (5,), (2, 2, 2)]
    check_invariants(gm)
    check_same_results(ref, gm, world)


SHAPES = [(2, 3), (1,), (3, 2, 2), (1, 5)]  # one-row shards gather to strided blocks


def _one_run(kind: str, w: int) -> fx.GraphModule:
    """x_i -> <kind> -> wait_i for the SHAPES (dim 0 times w for reduce-scatter); outputs: the waits
    and add(wait_i, 1) each."""
    b = Builder(world_size=w)
    waits = []
    for i, shape in enumerate(SHAPES):
        if kind == "reduce_scatter":
            x = b.input(f"g{i}", shape[0] * w, *shape[1:], role=Role.GRAD)
            wait = b.reduce_scatter(x)
        elif kind == "all_gather":
            wait = b.all_gather(b.input(f"p{i}", *shape))
        else:
            wait = b.all_reduce(b.input(f"g{i}", *shape, role=Role.GRAD))
        waits.append(wait)
    return b.finish(*waits, *[b.op(aten.add.Tensor, wait, 1.0) for wait in waits])


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_layout_is_exact_on_several_ranks(kind, w):
    """
    x0, x1, x2 -> <kind> each -> wait -> add     (simulated ranks, different data on each)
    after: one <kind> on the packed buffer; every rank's outputs bit for bit as before
    """
    gm = _one_run(kind, w)
    ref = clone_gm(gm)
    bucket_collectives(gm)
    assert colls(gm) == [kind]
    check_invariants(gm)
    _check_same_on_ranks(ref, gm, w)


def test_non_contiguous_and_scalar_inputs(world):
    """g (3,4) -> t -> all_reduce ; s () -> all_reduce ; h (W*2, 3) -> t -> t -> reduce_scatter ..."""
    b = Builder(group=world.group, world_size=world.size)
    gt = b.op(aten.t.default, b.input("g", 3, 4, role=Role.GRAD))
    s = b.input("s", role=Role.GRAD)
    w1, w2 = b.all_reduce(gt), b.all_reduce(s)
    h = b.op(aten.t.default, b.op(aten.t.default, b.input("h", 2 * world.size, 3)))
    k = b.input("k", world.size, role=Role.GRAD)
    w3, w4 = b.reduce_scatter(h), b.reduce_scatter(k)
    gm = b.finish(w1, w2, w3, w4)
    ref = clone_gm(gm)
    bucket_collectives(gm)
    assert colls(gm) == ["all_reduce", "reduce_scatter"]
    check_invariants(gm)
    check_same_results(ref, gm, world)


# ----------------------------------------------------------------------------- what cuts a run


def test_cap_closes_buckets_and_a_large_tensor_is_alone():
    """
    sizes in floats: a 100, b 100, c 100, d 500, e 60, f 60 -> all_reduce each, cap 1 KiB (256 floats)
    after: [a, b] [c] [d] [e, f]
    """
    b = Builder()
    _grads(b, [(100,), (100,), (100,), (500,), (60,), (60,)])
    gm = b.finish(*[n for n in b.graph.nodes if C.is_wait(n)])
    bucket_collectives(gm, bucket_cap_mb=1 * KiB)
    assert _sizes(gm) == [
        ("all_reduce", (200,)),
        ("all_reduce", (100,)),
        ("all_reduce", (500,)),
        ("all_reduce", (120,)),
    ]


def test_collectives_are_never_reordered_across_another_kind():
    """g0 -> all_reduce ; p -> all_gather ; g1 -> all_reduce   (the two all_reduces are not adjacent)"""
    b = Builder()
    w0 = b.all_reduce(b.input("g0", 3, role=Role.GRAD))
    wp = b.all_gather(b.input("p", 3))
    w1 = b.all_reduce(b.input("g1", 3, role=Role.GRAD))
    gm = b.finish(w0, wp, w1)
    assert_untouched(bucket_collectives, gm)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"op": "sum"}, id="reduce-op"),
        pytest.param({"group": "other"}, id="group"),
        pytest.param({"dtype": torch.bfloat16}, id="dtype"),
        pytest.param({"phase": Phase.OPTIMIZER}, id="phase"),
    ],
)
def test_a_different_key_cuts_the_run(change):
    """a -> all_reduce ; b -> all_reduce ; c -> all_reduce(<changed>) ; d -> all_reduce(<changed>)"""
    b = Builder()
    b.phase = Phase.BACKWARD
    waits = []
    for i in range(4):
        changed = i >= 2
        x = b.input(f"x{i}", 3, dtype=change.get("dtype", torch.float32) if changed else torch.float32)
        if changed and "phase" in change:
            b.phase = change["phase"]
        op = change.get("op", "avg") if changed else "avg"
        waits.append(b.all_reduce(x, op, group=change.get("group") if changed else None))
    gm = b.finish(*waits)
    bucket_collectives(gm)
    assert _sizes(gm) == [("all_reduce", (6,)), ("all_reduce", (6,))]
    assert [C.reduce_op_of(c) for c in C.collectives(gm.graph)] == ["avg", change.get("op", "avg")]


def test_a_result_used_before_the_next_collective_cuts_the_run():
    """g0 -> all_reduce -> wait -> neg ; g1 -> all_reduce -> wait   (neg cannot wait for g1's bucket)"""
    b = Builder()
    y = b.op(aten.neg.default, b.all_reduce(b.input("g0", 3, role=Role.GRAD)))
    gm = b.finish(y, b.all_reduce(b.input("g1", 3, role=Role.GRAD)))
    assert_untouched(bucket_collectives, gm)


def test_a_collective_that_depends_on_another_is_not_merged_with_it():
    """g0 -> all_reduce -> wait -> view -> all_reduce    (even through a movable view)"""
    b = Builder()
    w0 = b.all_reduce(b.input("g0", 3, role=Role.GRAD))
    w1 = b.all_reduce(b.op(aten.view.default, w0, [3]))
    gm = b.finish(w1)
    assert_untouched(bucket_collectives, gm)


def test_an_input_written_before_the_bucket_reads_it_cuts_the_run():
    """p -> all_gather ; p.add_(1) ; q -> all_gather    (a bucket at q would send the updated p)"""
    b = Builder()
    p = b.input("p", 3)
    wp = b.all_gather(p)
    b.op(aten.add_.Scalar, p, 1.0)
    wq = b.all_gather(b.input("q", 3))
    gm = b.finish(wp, wq)
    assert_untouched(bucket_collectives, gm)


def test_coalesced_and_broadcast_are_left_alone_and_cut_runs():
    """
    a -> all_reduce ; [b, c] -> all_reduce_coalesced ; d -> all_reduce ; buf -> broadcast ; e -> all_reduce
    """
    b = Builder()
    wa = b.all_reduce(b.input("a", 3))
    co = b.coalesced(c10d.all_reduce_coalesced.default, [b.input("b", 3), b.input("c", 3)], "avg", "0")
    wd = b.all_reduce(b.input("d", 3))
    bc = b.op(c10d.broadcast.default, b.input("buf", 3, role=Role.BUFFER), 0, "0", role=Role.COMM)
    wb = b.op(C.WAIT, bc, role=Role.COMM)
    we = b.all_reduce(b.input("e", 3))
    gm = b.finish(wa, *co, wd, wb, we)
    assert_untouched(bucket_collectives, gm)


# ----------------------------------------------------------------------------- placement


def test_views_of_a_gathered_parameter_move_after_the_bucket(world):
    """
    the partitioner's per-parameter emission, in forward:
      w (flat shard) -> all_gather -> wait -> slice -> view(4,4) -> t
      bias (shard)   -> all_gather -> wait
      addmm(bias_full, x, w_t)
    after: one all_gather; slice/view/t moved after its wait, before addmm
    """
    b = Builder(group=world.group, world_size=world.size)
    n = 16 // world.size + 1  # padded flat shard
    w = b.input("w", n, module="fc")
    bias = b.input("bias", 4 // world.size, module="fc")
    x = b.input("x", 2, 4, role=Role.INPUT)
    full = b.all_gather(w)
    wt = b.op(aten.t.default, b.op(aten.view.default, b.op(aten.slice.Tensor, full, 0, 0, 16), [4, 4]))
    bfull = b.all_gather(bias)
    y = b.op(aten.addmm.default, bfull, x, wt)
    gm = b.finish(y)
    ref = clone_gm(gm)

    bucket_collectives(gm)

    assert colls(gm) == ["all_gather"]
    bucket_wait = C.wait_of(C.collectives(gm.graph)[0])
    assert _index(gm, bucket_wait) < _index(gm, wt) < _index(gm, y)
    check_invariants(gm)
    check_same_results(ref, gm, world)


def test_bucket_waits_where_the_earliest_member_waited():
    """
    g0 -> rs0 ; relu(x) ; g1 -> rs1 ; exp(x) ; wait0 ; wait1 -> optimizer
    after: bucket rs where rs1 was, its wait where wait0 was (after exp: overlap kept)
    """
    b = Builder()
    b.phase = Phase.BACKWARD
    x = b.input("x", 3, role=Role.ACTIVATION)
    g0, g1 = b.input("g0", 4, role=Role.GRAD), b.input("g1", 2, 2, role=Role.GRAD)
    rs0 = b.op(c10d.reduce_scatter_tensor.default, g0, "avg", 2, "0", role=Role.COMM)
    r = b.op(aten.relu.default, x)
    rs1 = b.op(c10d.reduce_scatter_tensor.default, g1, "avg", 2, "0", role=Role.COMM)
    e = b.op(aten.exp.default, r)
    w0, w1 = b.op(C.WAIT, rs0, role=Role.COMM), b.op(C.WAIT, rs1, role=Role.COMM)
    b.phase = Phase.OPTIMIZER
    upd = [b.op(aten.mul.Tensor, w, 0.1, role=Role.UPDATE) for w in (w0, w1)]
    gm = b.finish(e, *upd)
    ref = clone_gm(gm)

    bucket_collectives(gm)

    (coll,) = C.collectives(gm.graph)
    wait = C.wait_of(coll)
    assert _index(gm, r) < _index(gm, coll) < _index(gm, e) < _index(gm, wait) < _index(gm, upd[0])
    check_invariants(gm)
    _check_same_on_ranks(ref, gm, 2)


# ----------------------------------------------------------------------------- module mode


def _units(cap_mb: float = 25.0, **kwargs) -> fx.GraphModule:
    b = Builder()
    b.phase = Phase.BACKWARD
    waits = []
    for mod in ("layers.1.fc2", "layers.1.fc1", "layers.0.fc2", "layers.0.fc1", "emb"):
        waits.append(b.all_reduce(b.input(mod.replace(".", "_"), 8, role=Role.GRAD, module=mod)))
    gm = b.finish(*waits)
    return bucket_collectives(gm, bucket_cap_mb=cap_mb, mode="module", **kwargs)


def test_module_mode_makes_one_bucket_per_unit():
    """grads of layers.1.fc2, layers.1.fc1, layers.0.fc2, layers.0.fc1, emb -> all_reduce each"""
    gm = _units()
    assert _sizes(gm) == [("all_reduce", (16,)), ("all_reduce", (16,)), ("all_reduce", (8,))]
    assert [c.meta[MODULE] for c in C.collectives(gm.graph)] == ["layers.1", "layers.0", "emb"]
    check_invariants(gm)


def test_module_mode_ignores_the_cap_and_takes_any_unit_function():
    assert len(colls(_units(cap_mb=1e-6))) == 3
    assert _sizes(_units(unit_of=lambda n: "everything")) == [("all_reduce", (40,))]
    assert len(colls(_units(unit_of=module_prefix(1)))) == 2


def test_options_are_validated():
    gm = _one_run("all_reduce", 2)
    with pytest.raises(ValueError, match="mode"):
        bucket_collectives(gm, mode="fsdp")
    with pytest.raises(ValueError, match="unit_of"):
        bucket_collectives(gm, unit_of=module_prefix(2))
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_collectives(gm, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="depth"):
        module_prefix(0)


def test_nothing_to_do_returns_the_same_untouched_module():
    """p -> all_gather -> wait (one collective) ; and a graph with none"""
    b = Builder()
    gm = b.finish(b.all_gather(b.input("p", 3)))
    assert_untouched(bucket_collectives, gm)
    b = Builder()
    empty = b.finish(b.op(aten.neg.default, b.input("x", 3)))
    assert_untouched(functools.partial(bucket_collectives, mode="module"), empty)


# ----------------------------------------------------------------------------- a whole step


def _fsdp_step(w: int, group: str = "0") -> fx.GraphModule:
    """
    A fully_shard step of y = relu(x @ w1.T) @ w2.T with w1 tied into a second use:
    forward:  w1 -> ag -> wait ; w2 -> ag -> wait ; w1 -> ag -> wait (the tie) ; mm, relu, mm, mm
    backward: g1 (full) -> rs -> wait ; g2 -> rs -> wait
    optimizer: w1.sub_(0.1 * wait) ; w2.sub_(0.1 * wait)
    """
    b = Builder(group=group, world_size=w)
    w1, w2 = b.input("w1", 8 // w, 4, module="l1"), b.input("w2", 8 // w, 8, module="l2")
    x = b.input("x", 3, 4, role=Role.INPUT)
    g1, g2 = b.input("g1", 8, 4, role=Role.GRAD), b.input("g2", 8, 8, role=Role.GRAD)
    f1, f2, f1b = b.all_gather(w1), b.all_gather(w2), b.all_gather(w1)
    h = b.op(aten.relu.default, b.op(aten.mm.default, x, b.op(aten.t.default, f1)))
    y = b.op(aten.mm.default, b.op(aten.mm.default, h, b.op(aten.t.default, f2)), f1b)
    b.phase = Phase.BACKWARD
    r1, r2 = b.reduce_scatter(g1), b.reduce_scatter(g2)
    b.phase = Phase.OPTIMIZER
    for p, r in ((w1, r1), (w2, r2)):
        b.op(aten.sub_.Tensor, p, b.op(aten.mul.Tensor, r, 0.1, role=Role.UPDATE), role=Role.UPDATE)
    return b.finish(y, w1, w2)


def test_dedup_then_bucketing_on_a_whole_step(world):
    gm = _fsdp_step(world.size, world.group)
    ref = clone_gm(gm)
    gm = bucket_collectives(dedup_collectives(gm))
    assert _sizes(gm) == [("all_gather", (8 // world.size * 12,)), ("reduce_scatter", (96,))]
    check_invariants(gm)
    check_same_results(ref, gm, world)


@pytest.mark.parametrize("w", [2, 4])
def test_whole_step_is_exact_on_simulated_ranks(w):
    gm = _fsdp_step(w)
    ref = clone_gm(gm)
    gm = bucket_collectives(dedup_collectives(gm))
    assert colls(gm) == ["all_gather", "reduce_scatter"]
    _check_same_on_ranks(ref, gm, w)


def test_bucketing_composes_with_functools_partial():
    """The pipeline binds options with functools.partial; the bound pass is still a gm -> gm function."""
    gm = _one_run("all_reduce", 2)
    out = functools.partial(bucket_collectives, bucket_cap_mb=1e-6)(gm)
    assert out is gm and len(colls(gm)) == len(SHAPES)
