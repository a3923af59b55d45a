"""Issue #36 on 2 gloo ranks: CTC losses and branches on data against DDP bit for bit, checks on data
raising alike on every rank (world size 1 against eager:
tests/unit/test_eager_branches.py)."""

from __future__ import annotations

import pytest

from tests.dist import workers_eager_branches as w
from tests.dist.launcher import run_ranks


@pytest.mark.timeout(300)
def test_ctc_loss_matches_ddp() -> None:
    results = run_ranks(w.ctc_parity, 2, 3, timeout=240)
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.timeout(300)
def test_data_check_fires_alike_on_both_ranks() -> None:
    """A batch out of range on rank 1 only: both ranks raise DataCheckError naming the line (rank 0
    learns it through the check's all-reduce), in replicate and fully_shard; no hang, nothing stepped."""
    results = run_ranks(w.data_checks_on_ranks, 2, 2, timeout=240)
    for rank, lines in enumerate(results):
        problems = [ln for ln in lines if not ln.startswith("raised ")]
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
        assert sorted(lines) == ["raised fully_shard True True", "raised replicate True True"], lines


@pytest.mark.timeout(400)
def test_hf_wav2vec2_ctc_matches_ddp() -> None:
    pytest.importorskip("transformers")
    results = run_ranks(w.wav2vec2_parity, 2, 3, timeout=350)
    for rank, problems in enumerate(results):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.timeout(200)
def test_ranks_reading_other_checks_diverge_instead_of_hanging() -> None:
    """Ranks whose first batches took other sides of a branch and so read other conditions would
    all-reduce different check vectors before every step: refused at compile on both ranks."""
    results = run_ranks(w.ranks_read_other_checks, 2, timeout=150)
    assert results == [["diverged True"], ["diverged True"]], results
