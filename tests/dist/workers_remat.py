"""Per-rank body of the remat test at 2 ranks (``test_remat``)."""

from __future__ import annotations

from typing import Any

import torch

import spmd
from passes import collectives as C
from passes.remat import REMAT
from tests import sweep_models as sm
from tests.dist.workers import _full


def llama_policies(rank: int, world: int, policies: list[Any]) -> dict[str, Any]:
    """A tiny Hugging Face Llama, fully_shard (reshard after forward), fused AdamW, 2 steps on
    this rank's own batches, once per policy: losses, full parameters, gathers per phase, and
    how many nodes the pass recomputed."""
    out: dict[str, Any] = {}
    for policy in policies:
        torch.manual_seed(0)
        case = sm._causal("LlamaConfig", "LlamaForCausalLM", **sm._LLAMA_LIKE)()
        model = case.model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

        def step(model, opt, *batch, _case=case):  # noqa: ANN001, ANN202
            loss = _case.loss(model, *batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        compiled = spmd.compile(
            parallel_mode=spmd.DataParallel("fully_shard"), remat=policy, check_invariants=True
        )(step)
        g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
        losses = [compiled(model, opt, *case.batch(g)) for _ in range(2)]
        stage = compiled.graphs.get("rematerialize")
        out[str(policy)] = {
            "losses": [x.detach().clone() for x in losses],
            "params": [_full(p).detach().clone() for p in model.parameters()],
            "recomputed": 0 if stage is None else sum(REMAT in n.meta for n in stage.graph.nodes),
            "gathers": sum(
                C.kind_of(c) is C.Kind.ALL_GATHER for c in C.collectives(compiled.graphs["final"].graph)
            ),
        }
    return out
