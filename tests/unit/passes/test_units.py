"""passes.units.assign_units: which gathers and reduce-scatters travel together.

Forward of five tiny blocks, each gathered on its own (W=2, 800 bytes gathered per block)::

    p0 -> all_gather -> wait -> mul ... p4 -> all_gather -> wait -> mul

With ``min_unit_bytes=2000`` the blocks group in the order the step needs them: blocks 0-2
(2400 bytes), then blocks 3-4 (1600 bytes, short of the threshold), which join the group
before them: one unit, one collective after bucketing.
"""

from __future__ import annotations

import torch

from passes import collectives as C
from passes.prefetch import default_unit_of
from passes.units import UNIT, assign_units
from tests.unit.passes.graphs import Builder

aten = torch.ops.aten


def _blocks(n: int, numel: int = 100) -> torch.fx.GraphModule:
    b = Builder()
    outs = []
    for i in range(n):
        b.module = f"blocks.{i}"
        p = b.input(f"p{i}", numel, module=b.module)
        outs.append(b.op(aten.mul.Tensor, b.all_gather(p), 2.0))
    return b.finish(*outs)


def _units(gm: torch.fx.GraphModule) -> list[str]:
    return [c.meta[UNIT] for c in C.collectives(gm.graph)]


def test_short_remainder_joins_the_group_before_it() -> None:
    gm = assign_units(_blocks(5), unit_of=default_unit_of, min_unit_bytes=2000)
    assert _units(gm) == ["blocks.0..blocks.4"] * 5


def test_groups_reach_the_threshold_and_no_remainder_is_left_alone() -> None:
    gm = assign_units(_blocks(6), unit_of=default_unit_of, min_unit_bytes=2000)
    assert _units(gm) == ["blocks.0..blocks.2"] * 3 + ["blocks.3..blocks.5"] * 3
    # 7 blocks: the seventh (800 bytes) would be a unit of its own; it joins blocks 3-5.
    gm = assign_units(_blocks(7), unit_of=default_unit_of, min_unit_bytes=2000)
    assert _units(gm) == ["blocks.0..blocks.2"] * 3 + ["blocks.3..blocks.6"] * 4


def test_no_threshold_keeps_every_block_its_own_unit() -> None:
    gm = assign_units(_blocks(3), unit_of=default_unit_of, min_unit_bytes=0)
    assert _units(gm) == ["blocks.0", "blocks.1", "blocks.2"]
