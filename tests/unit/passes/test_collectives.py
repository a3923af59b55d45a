"""passes.collectives: the vocabulary every pass asks, and the emitters partitioners use."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import collectives as C
from passes.meta import MODULE, PHASE, ROLE, Phase, Role
from tests.unit.passes.graphs import Builder, aten, c10d, inputs_for


def test_kinds_are_read_from_the_op_not_the_name():
    """x -> add (named "all_reduce") ; x -> all_reduce -> wait

    Only the real collective is one, whatever the nodes are called.
    """
    b = Builder()
    x = b.input("x", 4)
    fake = b.op(aten.add.Tensor, x, x)
    fake.name = "all_reduce"
    wait = b.all_reduce(x, "sum")
    b.finish(fake, wait)
    coll = wait.args[0]
    assert not C.is_collective(fake) and not C.is_wait(fake)
    assert C.is_collective(coll) and not C.is_wait(coll)
    assert C.is_wait(wait) and not C.is_collective(wait)
    assert C.collectives(b.graph) == [coll]
    assert (C.kind_of(coll), C.reduce_op_of(coll), C.group_of(coll)) == (C.Kind.ALL_REDUCE, "sum", "0")
    assert C.group_size_of(coll) is None


def test_group_and_sizes_of_each_kind():
    """p -> all_gather(W=4, "g1") ; g -> reduce_scatter(avg, W=4) ; b -> broadcast(src 0)"""
    b = Builder(group="g1", world_size=4)
    p = b.input("p", 2, 3)
    g = b.input("g", 8, 3, role=Role.GRAD)
    buf = b.input("buf", 5, role=Role.BUFFER)
    ag = b.all_gather(p).args[0]
    rs = b.reduce_scatter(g).args[0]
    bc = b.op(c10d.broadcast.default, buf, 0, "g1", role=Role.COMM)
    w = b.op(C.WAIT, bc, role=Role.COMM)
    b.finish(ag.next, rs.next, w)
    assert [C.kind_of(n) for n in (ag, rs, bc)] == [
        C.Kind.ALL_GATHER,
        C.Kind.REDUCE_SCATTER,
        C.Kind.BROADCAST,
    ]
    assert [C.group_of(n) for n in (ag, rs, bc)] == ["g1"] * 3
    assert [C.group_size_of(n) for n in (ag, rs, bc)] == [4, 4, None]
    assert [C.reduce_op_of(n) for n in (ag, rs, bc)] == [None, "avg", None]
    # bytes: the gathered output, the unsharded input, the tensor
    assert [C.bytes_of(n) for n in (ag, rs, bc)] == [4 * 6 * 4, 24 * 4, 5 * 4]


def test_coalesced_collective_vocabulary():
    """[a, b] -> all_reduce_coalesced -> getitem 0, 1 -> wait, wait"""
    b = Builder()
    a, c = b.input("a", 3), b.input("c", 2, 2, dtype=torch.bfloat16)
    waits = b.coalesced(c10d.all_reduce_coalesced.default, [a, c], "sum", "0")
    b.finish(*waits)
    coll = C.collectives(b.graph)[0]
    assert C.is_coalesced(coll) and C.kind_of(coll) is C.Kind.ALL_REDUCE
    assert C.inputs_of(coll) == [a, c]
    assert C.waits_of(coll) == waits
    assert [C.collective_of(w) for w in waits] == [coll, coll]
    assert C.bytes_of(coll) == 3 * 4 + 4 * 2


def test_wait_of_and_collective_of_are_inverse():
    """x -> all_gather -> wait"""
    b = Builder()
    wait = b.all_gather(b.input("x", 2))
    b.finish(wait)
    coll = wait.args[0]
    assert C.wait_of(coll) is wait and C.collective_of(wait) is coll and C.waits_of(coll) == [wait]


def test_emitters_set_val_and_comm_meta():
    """x (module "layers.1", phase backward) -> all_reduce / all_gather / reduce_scatter, each + wait"""
    b = Builder(world_size=4)
    x = b.input("x", 8, 3, role=Role.GRAD, module="layers.1")
    x.meta[PHASE] = Phase.BACKWARD
    pairs = [
        C.emit_all_reduce(b.graph, x, reduce_op="avg", group_name="0"),
        C.emit_all_gather(b.graph, x, group_size=4, group_name="0"),
        C.emit_reduce_scatter(b.graph, x, reduce_op="sum", group_size=4, group_name="0"),
    ]
    for (coll, wait), shape in zip(pairs, [(8, 3), (32, 3), (2, 3)]):
        for n in (coll, wait):
            assert tuple(n.meta["val"].shape) == shape and n.meta["val"].dtype == torch.float32
            assert (n.meta[ROLE], n.meta[PHASE], n.meta[MODULE]) == (Role.COMM, Phase.BACKWARD, "layers.1")
        assert wait.args == (coll,)


def test_emitted_collectives_run_with_the_shapes_in_meta(world):
    """x -> all_reduce(avg), all_gather, reduce_scatter(avg), each + wait -> outputs

    Real gloo at W=1 (each is the identity); the fake group at W=2 (shapes only).
    """
    b = Builder(group=world.group, world_size=world.size)
    x = b.input("x", 4, 3, role=Role.GRAD)
    waits = [b.all_reduce(x), b.all_gather(x), b.reduce_scatter(x)]
    gm = b.finish(*waits)
    (t,) = inputs_for(gm)
    outs = gm(t)
    for out, wait in zip(outs, waits):
        assert out.shape == wait.meta["val"].shape
        if world.real:
            assert torch.equal(out, t)


def test_graph_module_codegen_names_the_ops():
    """The generated code calls the functional collectives by their real op names."""
    b = Builder()
    gm = b.finish(b.all_reduce(b.input("x", 2)))
    assert isinstance(gm, fx.GraphModule)
    assert "_c10d_functional.all_reduce.default" in gm.code
    assert "_c10d_functional.wait_tensor.default" in gm.code
