"""cross_step_prefetch on 2 gloo ranks: the first all-gather of step k+1 is issued at the end of
step k and carried between calls (passes/cross_step.py, spmd/backend/carry.py).

Bit for bit with DDP; and every way of changing the parameters or the graph between calls gives
exactly what a step that gathers itself gives.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.dist import workers_cross_step as w
from tests.dist.launcher import run_ranks

COMBOS = [("mlp", "adamw_fused"), ("tinygpt", "adam_fused"), ("nested", "sgd_momentum_foreach")]


@pytest.mark.timeout(600)
def test_bitwise_parity_with_ddp_and_graph_shows_carry() -> None:
    """Every step's loss and the final parameters equal DDP's; every call after the first used
    the carried gather; the final graph takes it as its last input and returns it last."""
    results = run_ranks(w.parity, 2, COMBOS, timeout=540)
    for r in results:
        assert not r["problems"], "\n".join(r["problems"])
        assert set(r["reused"].values()) == {5}, r["reused"]  # 6 steps: the first gathers itself
        assert r["in"] == ["carried_gather_0"]
        assert len(r["out"]) == 1
        assert "wait_tensor.default(carried_gather_0)" in r["code"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "what",
    ["load_state_dict", "dcp", "inplace", "to_local", "dot_data", "data", "shape", "eval", "eval_step"],
)
def test_change_between_calls_gives_fresh_gather_values(what: str, tmp_path: pathlib.Path) -> None:
    """A checkpoint load (``load_state_dict``, DCP), an in-place edit under no_grad,
    ``p.data = ...``, another input shape, a train call in eval mode and a separate eval step
    between train calls: the losses and parameters equal those of a step without carried
    gathers, bit for bit. (``dot_data``: an edit through ``p.to_local().data``, which no version
    counter shows, followed by ``invalidate_prefetch()``.)"""
    results = run_ranks(w.between_calls, 2, "tinygpt", what, False, str(tmp_path / "ckpt"), timeout=540)
    for r in results:
        assert not r["problems"], "\n".join(r["problems"])
        assert r["after_last"] == 0  # last_train_step=True drained it
        if what in ("eval_step", "data"):
            # eval does not write the parameters, and ``p.data = x`` on a DTensor parameter changes
            # neither its local shard nor its value (torch 2.13 DTensor: the assignment is lost,
            # with or without spmd): the carried gather stays valid.
            assert r["reused"] == 5 and r["issued"] == 1, r
        else:  # invalidated at the change (and, for a new graph, when going back)
            assert r["issued"] >= 2, r


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", ["load_state_dict", "dcp", "inplace"])
def test_without_validity_check_the_change_is_missed(what: str, tmp_path: pathlib.Path) -> None:
    """The scenarios above can fail: trusting the carried gather regardless of the edit gives
    other losses than a fresh gather."""
    results = run_ranks(w.between_calls, 2, "tinygpt", what, True, str(tmp_path / "ckpt"), timeout=540)
    assert all(r["problems"] for r in results)


def test_in_flight_gather_at_exit_does_not_warn(capfd: pytest.CaptureFixture[str]) -> None:
    """A step that ends training with its carried gather in flight (no last_train_step) leaves
    no unwaited collective: the compiled step's finalizer waits on it at exit."""
    results = run_ranks(w.leave_in_flight, 2)
    assert results == [1, 1]
    err = capfd.readouterr().err
    assert "unwaited collective" not in err, err[-2000:]


def test_unseen_edit_is_caught_in_debug_mode() -> None:
    """An edit through ``.data`` (no version counter moves) without ``invalidate_prefetch()``:
    with invariant checks on, the next call raises StalePrefetchError instead of using old values."""
    results = run_ranks(w.between_calls, 2, "tinygpt", "dot_data_unseen", timeout=540)
    assert all(r["problems"] == ["StalePrefetchError"] for r in results), results
