"""spmd.backend.compile_once without inductor: the key, when sharing is on, and the leader/follower
protocol over a real store (a one-process gloo group; a second call with the same key plays the
follower). The 2-rank test with inductor is tests/dist/test_compile_once.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from spmd.backend.compile_once import Role, compile_once_per_host, graph_key, sharing_safe
from spmd.errors import LoweringError
from tests.dist.launcher import free_port
from tests.unit.fake_pg import fake_process_group


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _gm() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: x.sin() + 1)


def test_key_follows_what_inductor_compiles() -> None:
    gm, x = _gm(), torch.randn(4, 3)
    k = graph_key(gm, [x], ["opaque"])
    assert k == graph_key(_gm(), [torch.randn(4, 3)], ["opaque"])  # values do not matter
    assert k != graph_key(gm, [torch.randn(3, 3)], ["opaque"])  # shape
    assert k != graph_key(gm, [torch.randn(3, 4).t()], ["opaque"])  # strides
    assert k != graph_key(gm, [x.double()], ["opaque"])  # dtype
    assert k != graph_key(gm, [x], ["inline"])  # lowering options
    assert k != graph_key(fx.symbolic_trace(lambda x: x.cos() + 1), [x], ["opaque"])  # code


def test_sharing_only_with_a_real_group_and_the_cache_on() -> None:
    assert not sharing_safe({})  # no process group
    with fake_process_group(2):
        assert not sharing_safe({})  # one process stands for every rank
    with one_rank_group():
        assert not sharing_safe({})  # world size 1: nobody to share with


def test_leader_then_follower_then_failure() -> None:
    calls: list[str] = []
    with one_rank_group():
        out, role, wait = compile_once_per_host("k1", lambda: calls.append("lead") or 1)
        assert (out, role, wait) == (1, Role.LEADER, 0.0)
        out, role, _ = compile_once_per_host("k1", lambda: calls.append("follow") or 2)
        assert (out, role) == (2, Role.FOLLOWER)  # the leader is done: compile (a cache hit) at once

        def broken() -> int:
            calls.append("broken")
            raise RuntimeError("injected")

        with pytest.raises(RuntimeError, match="injected"):
            compile_once_per_host("k2", broken)
        with pytest.raises(LoweringError, match=r"rank 0 compiled .* Rank 0's error: RuntimeError: injected"):
            compile_once_per_host("k2", broken)  # the follower does not repeat the failing compile
        assert calls == ["lead", "follow", "broken"]

        dist.distributed_c10d._get_default_store().add("spmd/lower/k3/claims", 1)  # a leader that never ends
        with pytest.raises(LoweringError, match="did not finish"):
            compile_once_per_host("k3", lambda: 3, timeout_s=0.3)


def test_sharing_is_off_unless_asked(monkeypatch) -> None:
    """Off by default (no gain measured on 2 cores); the option or the env turns it on."""
    import spmd

    def step(model, x):
        return model(x).sum()

    monkeypatch.delenv("SPMD_SHARE_COMPILE", raising=False)
    assert not spmd.compile(backend="inductor")(step).share_compile
    assert spmd.compile(backend="inductor", share_compile=True)(step).share_compile
    monkeypatch.setenv("SPMD_SHARE_COMPILE", "1")
    assert spmd.compile(backend="inductor")(step).share_compile
