"""passes.prefetch: each FSDP unit's all-gathers are grouped and issued ``depth`` units ahead.

The graphs here are what the partitioner emits: every parameter gathered right before its first
use. ``_schedule`` prints a graph in short, one token per node: ``AG1m`` / ``W1m`` are the
all-gather / wait of ``layers.1.mlp``'s parameter, ``mul1m`` and ``pad1m`` its compute and its
input pad, ``|`` the start of backward.
"""

from __future__ import annotations

import functools

import pytest
import torch.fx as fx

from passes import collectives as C
from passes.invariants import check_invariants, fingerprint
from passes.meta import MODULE, PHASE, Phase, Role
from passes.prefetch import default_unit_of, prefetch_all_gathers
from tests.unit.passes.graphs import (
    Builder,
    assert_untouched,
    aten,
    c10d,
    check_same_results,
    clone_gm,
)

_SHORT = {C.Kind.ALL_GATHER: ("AG", "W"), C.Kind.ALL_REDUCE: ("AR", "WR")}
_OPS = {"constant_pad_nd": "pad"}


def _tag(module: str) -> str:
    """``layers.1.mlp`` -> ``1m``; anything else (the root) -> ``""``."""
    parts = module.split(".")
    return f"{parts[1]}{parts[2][0]}" if len(parts) == 3 and parts[0] == "layers" else ""


def _schedule(gm: fx.GraphModule) -> str:
    out, phase = [], Phase.FORWARD
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.meta[PHASE] is not phase:
            out.append("|")
            phase = n.meta[PHASE]
        if C.is_collective(n):
            name = _SHORT[C.kind_of(n)][0]
        elif C.is_wait(n):
            name = _SHORT[C.kind_of(C.collective_of(n))][1]
        else:
            op = n.target._opname
            name = _OPS.get(op, op)
        out.append(name + _tag(n.meta[MODULE]))
    return " ".join(out)


def _gather(b: Builder, p: fx.Node, module: str, *, pad: bool) -> fx.Node:
    """p -> [constant_pad_nd] -> all_gather -> wait, all of ``module``; returns the wait."""
    b.module = module
    x = b.op(aten.constant_pad_nd.default, p, [0, 1]) if pad else p
    wait = b.all_gather(x)
    for n in (C.collective_of(wait), wait):
        n.meta[MODULE] = module  # as the partitioner records it: the module that uses the parameter
    return wait


def _model(
    units: int = 3,
    *,
    subs: tuple[str, ...] = ("attn", "mlp"),
    pad: bool = False,
    backward: bool = False,
    world_size: int = 2,
    group: str = "0",
) -> fx.GraphModule:
    """
    forward, per unit i and sub s in order:      p_is -> [pad] -> AG -> W -> h = mul(h, W)
    backward (if asked), units and subs reversed: mul(h, g) first, then the same, regathered
    Shards are 4 floats (3 padded to 4); gathered, 4 * world_size, the size of x.
    """
    b = Builder(group=group, world_size=world_size)
    h = b.input("x", 4 * world_size, role=Role.INPUT)
    params = {
        (i, s): b.input(f"p{i}{s[0]}", 3 if pad else 4, module=f"layers.{i}.{s}")
        for i in range(units)
        for s in subs
    }
    for (i, s), p in params.items():
        h = b.op(aten.mul.Tensor, h, _gather(b, p, f"layers.{i}.{s}", pad=pad))
    if backward:
        b.phase, b.module = Phase.BACKWARD, ""
        h = b.op(aten.mul.Tensor, h, b.input("g", 4 * world_size, role=Role.GRAD))
        for (i, s), p in reversed(params.items()):
            h = b.op(aten.mul.Tensor, h, _gather(b, p, f"layers.{i}.{s}", pad=pad))
    return b.finish(h)


def _same_collectives(before: fx.GraphModule, after: fx.GraphModule) -> None:
    """The pass moves gathers; it never adds, drops or changes one."""

    def kinds(gm: fx.GraphModule) -> list[str]:
        return sorted(repr(f[1:]) for f in fingerprint(gm))  # without the position

    assert kinds(after) == kinds(before)


# ----------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        ("blocks.3.attn.qkv", "blocks.3"),
        ("tok_emb", "tok_emb"),
        ("transformer.h.11.mlp", "transformer.h.11"),
        ("layers.0", "layers.0"),
        ("lm_head.weight", "lm_head"),
        ("", ""),
    ],
)
def test_default_unit_is_the_path_up_to_the_first_index(path, unit):
    node = fx.Graph().placeholder("p")
    node.meta[MODULE] = path
    assert default_unit_of(node) == unit


# ----------------------------------------------------------------------------- depth


def test_depth_1_issues_each_unit_when_the_one_before_starts(world):
    """
    before: AG0a W0a mul0a AG0m W0m mul0m ; AG1a W1a mul1a AG1m W1m mul1m ; AG2a W2a ... (at first use)
    after:  unit 0 at the start, unit 1 right after W0a, unit 2 right after W1a
    """
    gm = _model(world_size=world.size, group=world.group)
    ref = clone_gm(gm)

    assert prefetch_all_gathers(gm) is gm  # rewritten in place

    assert _schedule(gm) == (
        "AG0a AG0m W0a AG1a AG1m mul0a W0m mul0m W1a AG2a AG2m mul1a W1m mul1m W2a mul2a W2m mul2m"
    )
    check_invariants(gm)
    _same_collectives(ref, gm)
    check_same_results(ref, gm, world)


def test_depth_2_issues_two_units_at_the_start():
    """
    before: AG0a W0a mul0a AG0m W0m mul0m ; AG1a ... ; AG2a ... ; AG3a ...   (4 units, at first use)
    after:  units 0, 1 at the start (in that order); unit 2 right after W0a, unit 3 right after W1a
    """
    gm = prefetch_all_gathers(_model(4), forward_prefetch=2)
    assert _schedule(gm) == (
        "AG0a AG0m AG1a AG1m W0a AG2a AG2m mul0a W0m mul0m "
        "W1a AG3a AG3m mul1a W1m mul1m "
        "W2a mul2a W2m mul2m "
        "W3a mul3a W3m mul3m"
    )
    check_invariants(gm)


def test_depth_0_groups_each_unit_at_its_own_first_wait():
    """
    before: AG0a W0a mul0a AG0m W0m mul0m ; AG1a W1a ... ; AG2a W2a ...
    after:  AG0a AG0m W0a mul0a W0m mul0m ; AG1a AG1m W1a ...   (no look-ahead, only grouping)
    """
    gm = prefetch_all_gathers(_model(), forward_prefetch=0)
    assert _schedule(gm) == (
        "AG0a AG0m W0a mul0a W0m mul0m AG1a AG1m W1a mul1a W1m mul1m AG2a AG2m W2a mul2a W2m mul2m"
    )
    check_invariants(gm)


def test_a_depth_beyond_the_units_issues_everything_at_the_start():
    """AG0a W0a mul0a ... AG2m W2m mul2m with depth 5 -> all six gathers first, units in order"""
    gm = prefetch_all_gathers(_model(), forward_prefetch=5)
    assert _schedule(gm) == (
        "AG0a AG0m AG1a AG1m AG2a AG2m W0a mul0a W0m mul0m W1a mul1a W1m mul1m W2a mul2a W2m mul2m"
    )
    check_invariants(gm)


def test_forward_and_backward_are_prefetched_each_in_its_own_phase(world):
    """
    forward: units 0, 1, 2 gathered at first use; backward: mul(h, g), then units 2, 1, 0 regathered
    after (forward depth 1, backward depth 2): backward's first two units go to the start of
    backward (before mul(h, g), never into forward); unit 0 right after unit 2's first wait
    """
    gm = _model(backward=True, world_size=world.size, group=world.group)
    ref = clone_gm(gm)

    prefetch_all_gathers(gm, forward_prefetch=1, backward_prefetch=2)

    assert _schedule(gm) == (
        "AG0a AG0m W0a AG1a AG1m mul0a W0m mul0m W1a AG2a AG2m mul1a W1m mul1m W2a mul2a W2m mul2m | "
        "AG2m AG2a AG1m AG1a mul W2m AG0m AG0a mul2m W2a mul2a "
        "W1m mul1m W1a mul1a "
        "W0m mul0m W0a mul0a"
    )
    check_invariants(gm)
    _same_collectives(ref, gm)
    check_same_results(ref, gm, world)


def test_a_custom_unit_function_decides_the_grouping():
    """the 3-unit model with unit_of = the sub-module kind: two units, "attn" (first used first) and "mlp\""""
    gm = prefetch_all_gathers(_model(), unit_of=lambda n: n.meta[MODULE].split(".")[-1])
    assert _schedule(gm) == (
        "AG0a AG1a AG2a W0a AG0m AG1m AG2m mul0a W0m mul0m W1a mul1a W1m mul1m W2a mul2a W2m mul2m"
    )
    check_invariants(gm)


# ----------------------------------------------------------------------------- what moves


_PADDED = {  # the 4-unit model with padded shards, prefetched at depth 1 and 2
    1: "pad0a AG0a pad0m AG0m W0a pad1a AG1a pad1m AG1m mul0a W0m mul0m "
    "W1a pad2a AG2a pad2m AG2m mul1a W1m mul1m "
    "W2a pad3a AG3a pad3m AG3m mul2a W2m mul2m "
    "W3a mul3a W3m mul3m",
    2: "pad0a AG0a pad0m AG0m pad1a AG1a pad1m AG1m W0a pad2a AG2a pad2m AG2m mul0a W0m mul0m "
    "W1a pad3a AG3a pad3m AG3m mul1a W1m mul1m "
    "W2a mul2a W2m mul2m "
    "W3a mul3a W3m mul3m",
}


@pytest.mark.parametrize("depth", [1, 2])
def test_an_input_chain_moves_with_its_gather(world, depth):
    """
    before: pad0a AG0a W0a mul0a pad0m AG0m W0m mul0m ; pad1a AG1a ... (4 units, shards padded 3 -> 4)
    after:  each pad right before its gather, wherever the gather goes; units in order at the start
    """
    gm = _model(4, pad=True, world_size=world.size, group=world.group)
    ref = clone_gm(gm)

    prefetch_all_gathers(gm, forward_prefetch=depth)

    assert _schedule(gm) == _PADDED[depth]
    check_invariants(gm)
    _same_collectives(ref, gm)
    check_same_results(ref, gm, world)


def test_a_gather_of_a_computed_tensor_stays_put():
    """
    AG0a W0a h=mul0a ; h -> AG1a -> W1a -> slice -> mul1a(h, .) ; AG2a W2a mul2a
    unit 1 gathers an activation (h, also read by mul1a): it cannot be issued before h exists
    after: unit 1 where it was; unit 2 still right after W1a
    """
    b = Builder()
    x = b.input("x", 8, role=Role.INPUT)
    p0, p2 = b.input("p0", 4, module="layers.0.attn"), b.input("p2", 4, module="layers.2.attn")
    h = b.op(aten.mul.Tensor, x, _gather(b, p0, "layers.0.attn", pad=False))
    full = _gather(b, h, "layers.1.attn", pad=False)
    h = b.op(aten.mul.Tensor, h, b.op(aten.slice.Tensor, full, 0, 0, 8))
    h = b.op(aten.mul.Tensor, h, _gather(b, p2, "layers.2.attn", pad=False))
    gm = b.finish(h)
    ref = clone_gm(gm)

    prefetch_all_gathers(gm)

    assert _schedule(gm) == "AG0a W0a mul0a AG1a W1a AG2a slice1a mul1a W2a mul2a"
    check_invariants(gm)
    _same_collectives(ref, gm)


def test_a_gather_fed_by_another_collective_stays_put():
    """
    AG0a W0a mul0a ; p1 -> AR1a -> WR1a -> AG1a -> W1a -> mul1a
    the chain back to p1 runs through an all-reduce and its wait: neither is the gather's to move
    """
    b = Builder()
    x = b.input("x", 8, role=Role.INPUT)
    p0, p1 = b.input("p0", 4, module="layers.0.attn"), b.input("p1", 4, module="layers.1.attn")
    h = b.op(aten.mul.Tensor, x, _gather(b, p0, "layers.0.attn", pad=False))
    reduced = b.all_reduce(p1)
    h = b.op(aten.mul.Tensor, h, _gather(b, reduced, "layers.1.attn", pad=False))
    gm = b.finish(h)
    assert _schedule(gm) == "AG0a W0a mul0a AR1a WR1a AG1a W1a mul1a"
    assert_untouched(prefetch_all_gathers, gm)


# ----------------------------------------------------------------------------- no-ops


def test_no_gathers_returns_the_same_untouched_module():
    """g -> all_reduce -> wait -> mul   (nothing to prefetch)"""
    b = Builder()
    b.phase = Phase.BACKWARD
    wait = b.all_reduce(b.input("g", 4, role=Role.GRAD, module="layers.0.attn"))
    gm = b.finish(b.op(aten.mul.Tensor, wait, 2.0))
    assert_untouched(prefetch_all_gathers, gm)


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("pad", [False, True], ids=["plain", "padded"])
def test_a_prefetched_graph_has_nothing_left_to_move(depth, pad):
    """forward and backward, 4 units, prefetched once; a second run returns the same untouched gm"""
    gm = prefetch_all_gathers(
        _model(4, pad=pad, backward=True), forward_prefetch=depth, backward_prefetch=depth
    )
    assert_untouched(
        functools.partial(prefetch_all_gathers, forward_prefetch=depth, backward_prefetch=depth), gm
    )


def test_one_unit_already_grouped_returns_the_same_untouched_module():
    """AG0a AG0m W0a mul0a W0m mul0m   (one unit, its gathers adjacent before its first wait)"""
    b = Builder()
    h = b.input("x", 8, role=Role.INPUT)
    params = [b.input(f"p{s}", 4, module=f"layers.0.{s}") for s in ("attn", "mlp")]
    colls = []
    for p in params:
        b.module = p.meta[MODULE]
        colls.append(b.op(c10d.all_gather_into_tensor.default, p, 2, "0", role=Role.COMM))
    for p, coll in zip(params, colls):
        b.module = p.meta[MODULE]
        h = b.op(aten.mul.Tensor, h, b.op(C.WAIT, coll, role=Role.COMM))
    gm = b.finish(h)
    assert _schedule(gm) == "AG0a AG0m W0a mul0a W0m mul0m"
    assert_untouched(prefetch_all_gathers, gm)
