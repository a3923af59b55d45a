"""Issue #36 on 2 gloo ranks: CTC losses against DDP bit for bit (world size 1 against eager:
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
