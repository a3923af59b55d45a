"""The layout family at world size 2 against DDP, bit for bit: the models of
tests/layout_models.py in replicate, fully_shard (both reshard_after_forward settings)
and hybrid_shard (a 1 x 2 mesh), in one spawned job (process start is the expensive part).
The world-size-1 family is tests/unit/test_layouts.py."""

from __future__ import annotations

from tests import layout_models as L
from tests.dist import workers_layouts as w
from tests.dist.launcher import run_ranks

# Models whose batch norm returns another layout than torch's fake kernel says on this CPU
# build. spmd's trace knows the kernel's rule, so no model needs a fix-up; traced on torch's
# fake layouts (``torch_fake_layouts``: what a kernel with an unknown rule looks like) these
# must get the first run's fix-ups in every style.
MISMATCHING = {"transpose_batchnorm1d", "unfold", "as_strided", "transpose_batchnorm1d_dropout"}

# Every model in replicate and fully_shard; the styles that differ from those only in when
# parameters are gathered, on the batch-norm models traced on torch's fake layouts (keeps the
# job under a minute).
CASES = [(name, style, {}) for name in L.MODELS for style in ("replicate", "fully_shard")] + [
    (name, style, {**opts, "torch_fake_layouts": True})
    for name in sorted(MISMATCHING)
    for style, opts in [
        ("fully_shard", {"reshard_after_forward": False}),
        ("hybrid_shard", {"mesh_2d": True}),
    ]
]


def test_layout_family_matches_ddp() -> None:
    results = run_ranks(w.layout_family, 2, CASES, 3, timeout=400)
    for rank, lines in enumerate(results):
        problems = [ln for ln in lines if not ln.startswith("fixes ")]
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
        for ln in lines:
            if not ln.startswith("fixes "):
                continue
            tag, n = ln[len("fixes ") :].rsplit(" ", 1)
            assert (int(n) > 0) == ("torch_fake_layouts" in tag), f"rank {rank}: {tag}: {n} fix-ups"


def test_peer_dies_during_the_checking_first_run() -> None:
    """The first call runs the graph through the layout checker: a failed collective there is
    still a CollectiveError naming the collective, within the process group's timeout."""
    survivor, dead = run_ranks(
        w.killed_before_first_run, 2, "replicate", timeout=90, pg_timeout=10, may_die={1}
    )
    assert dead is None
    assert survivor["type"] == "CollectiveError" and survivor["step"] == 0, survivor
    assert "(collective #" in survivor["msg"] and survivor["seconds"] < 30, survivor
