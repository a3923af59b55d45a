"""Meta-device initialisation on 2 gloo ranks: a model built under ``torch.device("meta")`` is
materialised module by module and sharded at once, starts where the normally built model
starts (bit for bit, same seed), trains like DDP, and never holds the full model on a rank."""

from __future__ import annotations

import pytest

from tests.dist import workers_init
from tests.dist.launcher import run_ranks


@pytest.mark.parametrize(
    "style,combos,sync",
    [
        (
            "fully_shard",
            [("tinygpt", "adamw_fused"), ("uneven", "sgd_momentum_foreach"), ("nested", "adam_fused")],
            False,
        ),
        ("replicate", [("tinygpt", "sgd_momentum_foreach"), ("uneven", "adamw_fused")], False),
        ("fully_shard", [("mlp", "adamw_fused")], True),
    ],
    ids=["fully_shard", "replicate", "fully_shard_sync"],
)
def test_meta_init_matches_normal_init_and_ddp(style: str, combos: list[tuple[str, str]], sync: bool) -> None:
    """Initial parameters and buffers equal the normally built model's (tied weights stay tied:
    TinyGPT's head); the optimizer built over the meta parameters is re-keyed; 5 steps equal
    DDP bit for bit. With sync_module_states each rank seeds differently and gets rank 0's values."""
    results = run_ranks(workers_init.meta_parity, 2, style, combos, 5, sync, timeout=400)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def test_meta_init_peak_memory_below_full_model() -> None:
    """16 Linear(256, 256) layers (4.2 MB of parameters, 0.26 MB per layer): the peak of live
    tensors while materialising is this rank's shard plus one layer, below the full model."""
    for out in run_ranks(workers_init.meta_memory, 2, "fully_shard"):
        print(out)
        assert out["peak"] < out["full_param_bytes"], out
        assert out["peak"] <= out["local_param_bytes"] + 2 * out["largest_module_bytes"], out
