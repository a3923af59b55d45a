"""Shared-memory collectives (passes.shm_collectives, spmd.backend.shm) on real gloo ranks.

Each op gives gloo's bits (two and three ranks, several dtypes, tensors of many slot rounds);
compiled steps run their collectives through shared memory by default and train to the bits of
the gloo run (SPMD_SHM=0); a peer that dies is noticed in seconds, not at the group's timeout.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import workers_shm as w
from tests.dist.launcher import run_ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_ops_give_gloos_bits(world: int) -> None:
    problems = [p for r in run_ranks(w.ops_against_gloo, world, timeout=240) for p in r]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_steps_run_through_shared_memory_with_the_bits_of_gloo(style: str) -> None:
    """Every collective of the two-rank step runs through shared memory, and the parameters after
    three steps equal those of the same step on gloo bit for bit."""
    on = run_ranks(w.graph_collectives, 2, style, {}, timeout=540)
    off = run_ranks(w.graph_collectives, 2, style, {"SPMD_SHM": "0"}, timeout=540)
    kinds = [k for k, _ in on[0]["collectives"]]
    assert kinds and all(via for _, via in on[0]["collectives"]), on[0]["collectives"]
    assert not any(via for _, via in off[0]["collectives"]), off[0]["collectives"]
    # On gloo a two-rank reduce-scatter runs as an all-to-all (passes.gloo_collectives).
    assert kinds == ["reduce_scatter" if k == "all_to_all" else k for k, _ in off[0]["collectives"]]
    for rank in range(2):
        for a, b in zip(on[rank]["params"], off[rank]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(300)
def test_ranks_on_two_hosts_go_back_to_gloo() -> None:
    """The ranks say they run on two hosts: every collective runs on gloo again (where the pipeline
    put it, a reduce-scatter as itself) and training gives gloo's bits."""
    two = run_ranks(w.on_two_hosts, 2, "fully_shard", timeout=240)
    off = run_ranks(w.graph_collectives, 2, "fully_shard", {"SPMD_SHM": "0"}, timeout=240)
    assert not any(via for _, via in two[0]["collectives"]), two[0]["collectives"]
    for rank in range(2):
        for a, b in zip(two[rank]["params"], off[rank]["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.timeout(120)
def test_a_dead_peer_is_an_error_within_seconds() -> None:
    """The group's timeout is 60 s; the survivor names the dead rank long before, and refuses the
    group's next collective (its counters no longer agree with the dead rank's)."""
    survivor, dead = run_ranks(w.peer_exits, 2, timeout=90, pg_timeout=60, may_die={1})
    assert dead is None
    assert survivor["error"] is not None and "rank 1" in survivor["error"], survivor
    assert "exited" in survivor["error"], survivor
    assert survivor["seconds"] < 5, survivor
    assert survivor["then"] is not None and "failed earlier" in survivor["then"], survivor
