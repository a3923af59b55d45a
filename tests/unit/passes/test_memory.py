"""passes.memory: exact peaks of small hand-built graphs (every tensor is 4x4 float32 = 64 B unless said).

Placeholders are live for the whole step; a fresh result is allocated when produced and freed
after its last use through any alias; views, in-place ops and waits add nothing.
"""

from __future__ import annotations

import operator

import torch

from passes.memory import estimate_peak_memory, tensor_bytes
from passes.meta import Phase, Role
from tests.unit.passes.graphs import Builder, aten

B = 64  # bytes of one 4x4 float32


def test_chain_frees_after_last_use() -> None:
    """x -> a=relu(x) -> b=neg(a) -> out(b): at neg, x + a + b are live; a is freed after it."""
    b = Builder()
    x = b.input("x", 4, 4)
    a = b.op(aten.relu.default, x)
    out = b.op(aten.neg.default, a)
    est = estimate_peak_memory(b.finish(out))
    assert est.baseline_bytes == B
    assert (est.peak_bytes, est.peak_node) == (3 * B, out.name)
    assert est.profile == [(a.name, 2 * B), (out.name, 3 * B)]


def test_placeholders_are_never_freed_and_dead_results_are_freed_at_once() -> None:
    """x, y inputs; d=relu(x) has no user (freed right away); c=add(x, y); e=neg(c); out(e)."""
    b = Builder()
    x, y = b.input("x", 4, 4), b.input("y", 4, 4)
    d = b.op(aten.relu.default, x)
    c = b.op(aten.add.Tensor, x, y)
    e = b.op(aten.neg.default, c)
    est = estimate_peak_memory(b.finish(e))
    live = dict(est.profile)
    assert est.baseline_bytes == 2 * B
    assert live[d.name] == 3 * B  # allocated, then freed after itself
    assert live[c.name] == 3 * B
    assert live[e.name] == 4 * B
    assert est.peak_bytes == 4 * B and est.peak_node == e.name


def test_views_add_no_bytes_but_keep_their_base_alive() -> None:
    """a=relu(x); v=view(a); t=t(x); n=neg(t); c=add(v, view(t(n))); u=_unsafe_view(c) -> out(u).

    ``a`` stays live until ``c`` (through the view ``v``); views and the transpose cost nothing;
    ``_unsafe_view`` (no alias annotation in its schema) is an alias by its fake storage."""
    b = Builder()
    x = b.input("x", 4, 4)
    a = b.op(aten.relu.default, x)
    v = b.op(aten.view.default, a, [16])
    t = b.op(aten.t.default, x)
    n = b.op(aten.neg.default, t)
    nv = b.op(aten.view.default, b.op(aten.t.default, n), [16])
    c = b.op(aten.add.Tensor, v, nv)
    u = b.op(aten._unsafe_view.default, c, [4, 4])
    est = estimate_peak_memory(b.finish(u))
    live = dict(est.profile)
    assert live[v.name] == 2 * B and live[t.name] == 2 * B
    assert live[n.name] == 3 * B  # x, a (alive through v), n
    assert live[c.name] == 4 * B
    assert live[u.name] == 2 * B  # a and n freed after c; c lives on as u, the output
    assert est.peak_bytes == 4 * B and est.peak_node == c.name


def test_schema_aliases_hold_when_the_value_was_made_afresh() -> None:
    """A pass may give a view a fresh fake value (``new_empty``) that shares no storage with its
    base: the op's schema (``view(Tensor(a) self) -> Tensor(a)``) still makes it an alias."""
    b = Builder()
    x = b.input("x", 4, 4)
    a = b.op(aten.relu.default, x)
    v = b.op(aten.view.default, a, [16])
    v.meta["val"] = v.meta["val"].new_empty((16,))
    r = b.op(aten.neg.default, v)
    est = estimate_peak_memory(b.finish(r))
    assert dict(est.profile)[v.name] == 2 * B
    assert est.peak_bytes == 3 * B


def test_in_place_ops_add_no_bytes() -> None:
    """a=relu(x); add_(a, x) (returns a); mul_(x, 2) (writes a placeholder) -> out(a)."""
    b = Builder()
    x = b.input("x", 4, 4)
    a = b.op(aten.relu.default, x)
    a2 = b.op(aten.add_.Tensor, a, x)
    m = b.op(aten.mul_.Tensor, x, 2.0)
    est = estimate_peak_memory(b.finish(a2))
    live = dict(est.profile)
    assert live[a2.name] == 2 * B and live[m.name] == 2 * B
    assert est.peak_bytes == 2 * B


def test_foreach_in_place_ops_allocate_nothing() -> None:
    """An optimizer-like in-place foreach update of two placeholders."""
    b = Builder()
    p, g = b.input("p", 4, 4), b.input("g", 4, 4, role=Role.INPUT)
    b.phase = Phase.OPTIMIZER
    f = b.op(aten._foreach_add_.List, [p], [g])
    s = b.op(aten.sum.default, p)
    est = estimate_peak_memory(b.finish(s))
    assert dict(est.profile)[f.name] == 2 * B
    assert est.peak_bytes == 2 * B + 4  # the 0-d float32 sum


def test_wait_returns_its_collectives_buffer() -> None:
    """g -> all_reduce -> wait -> m=mul(wait, 2) -> out(m). The collective allocates; its wait does
    not (its fake value is a fresh tensor, but at run time it is the collective's buffer)."""
    b = Builder(world_size=2)
    g = b.input("g", 4, 4, role=Role.GRAD)
    w = b.all_reduce(g)
    coll = w.args[0]
    m = b.op(aten.mul.Tensor, w, 2.0)
    est = estimate_peak_memory(b.finish(m))
    live = dict(est.profile)
    assert (live[coll.name], live[w.name], live[m.name]) == (2 * B, 2 * B, 3 * B)
    assert est.peak_bytes == 3 * B


def test_all_gather_allocates_the_gathered_size() -> None:
    """A 4x4 shard gathered over 2 ranks: an 8x4 buffer (128 B) until its last use."""
    b = Builder(world_size=2)
    p = b.input("p", 4, 4)
    w = b.all_gather(p)
    r = b.op(aten.relu.default, w)
    est = estimate_peak_memory(b.finish(r))
    assert dict(est.profile)[w.name] == B + 2 * B
    assert est.peak_bytes == B + 2 * B + 2 * B
    assert est.peak_node == r.name


def test_getitem_picks_one_output_of_a_multi_output_node() -> None:
    """native_layer_norm -> (out 64 B, mean 16 B, rstd 16 B); only out is read (by relu).

    mean and rstd live until the node's last getitem (as in fx's generated code), out until relu."""
    b = Builder()
    x, w, bias = b.input("x", 4, 4), b.input("w", 4), b.input("b", 4)
    ln = b.op(aten.native_layer_norm.default, x, [4], w, bias, 1e-5)
    out = b.graph.call_function(operator.getitem, (ln, 0))
    out.meta.update(ln.meta)
    out.meta["val"] = ln.meta["val"][0]
    r = b.op(aten.relu.default, out)
    est = estimate_peak_memory(b.finish(r))
    live = dict(est.profile)
    base = B + 16 + 16
    assert est.baseline_bytes == base
    assert live[ln.name] == base + B + 16 + 16
    assert live[out.name] == base + B + 32
    assert live[r.name] == base + B + B  # mean and rstd were freed after the getitem
    assert est.peak_bytes == base + 2 * B


def test_peak_by_phase() -> None:
    """forward: a=relu(x) (live 2B); backward: g=mul(a, a) (3B; a freed after), h=neg(g) (3B; g
    freed after); optimizer: add_(x, h) allocates nothing (2B: x and h)."""
    b = Builder()
    x = b.input("x", 4, 4)
    a = b.op(aten.relu.default, x)
    b.phase = Phase.BACKWARD
    g = b.op(aten.mul.Tensor, a, a)
    h = b.op(aten.neg.default, g)
    b.phase = Phase.OPTIMIZER
    u = b.op(aten.add_.Tensor, x, h)
    est = estimate_peak_memory(b.finish(u))
    assert {k: (v.peak_bytes, v.peak_node) for k, v in est.by_phase.items()} == {
        "forward": (2 * B, a.name),
        "backward": (3 * B, g.name),
        "optimizer": (2 * B, u.name),
    }
    assert {k: v.allocated_bytes for k, v in est.by_phase.items()} == {
        "forward": B,
        "backward": 2 * B,
        "optimizer": 0,
    }
    assert est.peak_bytes == 3 * B and est.peak_node == g.name


def test_tensor_bytes_counts_the_whole_storage() -> None:
    t = torch.empty(8, 4)
    assert tensor_bytes(t) == 128
    assert tensor_bytes(t[:2]) == 128


def test_a_collective_holds_its_input_until_its_wait() -> None:
    """c=relu(x); rs=reduce_scatter(c); n=neg(x); wait(rs) -> out(n, wait).

    ``c``'s last reader is the reduce-scatter, but the collective in flight holds it (c10d's work
    keeps its tensors until it is waited): ``c`` is live while ``neg`` runs and freed after the
    wait. (Without this the estimate was 7-13% under MemTracker on sharded steps whose peak falls
    while a flat-gradient reduce-scatter or a copy-in all-gather is in flight.)"""
    b = Builder(world_size=2)
    x = b.input("x", 4, 4)
    c = b.op(aten.relu.default, x)
    wait = b.reduce_scatter(c)
    n = b.op(aten.neg.default, x)
    wait.prepend(n)  # the collective's wait after neg: neg runs while it is in flight
    est = estimate_peak_memory(b.finish(n, wait))
    live = dict(est.profile)
    assert live[n.name] == 3 * B + B // 2  # x, c (held), the reduce-scatter's half, n
    assert est.peak_bytes == 3 * B + B // 2 and est.peak_node == n.name
