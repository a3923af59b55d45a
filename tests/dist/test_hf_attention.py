"""Hugging Face causal LMs with HF's default attention (``attn_implementation="sdpa"``) on 2 gloo
ranks, a training step without cache or padding: eager calls SDPA with ``is_causal=True`` and
no mask, and so must the compiled step (spmd.frontend.hf_compat). Llama, Qwen2 and Mistral against DDP
(fp32) and FSDP2 ``fully_shard`` per decoder layer + root with ``MixedPrecisionPolicy`` (bf16
params, fp32 reduce), bit for bit, in one spawned job. World size 1 against eager, and the
padded control: tests/unit/test_foreign_models.py."""

from __future__ import annotations

import pytest

from tests import sweep_models as S
from tests.dist import workers_hf_attention as w
from tests.dist.launcher import run_ranks


@pytest.mark.timeout(600)
def test_hf_sdpa_models_match_ddp_and_fsdp2() -> None:
    pytest.importorskip("transformers")
    # six compiles per rank (three models, two styles): ~210 s on a machine loaded ~10x its cores
    results = run_ranks(w.sdpa_parity, 2, 2, timeout=550)
    for rank, lines in enumerate(results):
        problems = [ln for ln in lines if not ln.startswith("sdpa ")]
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
        graphs = [ln.split()[1:] for ln in lines if ln.startswith("sdpa ")]
        assert len(graphs) == 2 * len(S.HF_SDPA), lines
        for tag, n_calls, causal, masks in graphs:
            # two decoder layers: two forward SDPA calls, causal, without a mask
            assert (n_calls, causal, masks) == ("2", "True", "0"), f"rank {rank}: {tag}: {lines}"
