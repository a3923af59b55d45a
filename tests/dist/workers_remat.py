"""Per-rank body of the remat test at 2 ranks (``test_remat``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

import spmd
from passes import collectives as C
from passes.remat import REMAT
from tests import sweep_models as sm
from tests.dist.workers import _full

MICRO = 2  # micro-batches per step in the configurations that accumulate


def _mode(setting: str, world: int) -> spmd.DataParallel:
    """The parallel mode of a setting of ``test_remat.CONFIGS``."""
    if setting == "fully_shard":
        return spmd.DataParallel("fully_shard")
    if setting == "hybrid_prefetch2":  # one replica of a 2-rank shard group; gathers 2 units ahead
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
        return spmd.DataParallel("hybrid_shard", mesh=mesh, forward_prefetch=2, backward_prefetch=2)
    if setting == "bf16_accumulate":  # bf16 compute over fp32 shards, gradients reduced in fp32
        mp = spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return spmd.DataParallel("fully_shard", mixed_precision=mp)
    raise ValueError(setting)


def llama_policies(rank: int, world: int, configs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A tiny Hugging Face Llama, fused AdamW, 2 steps on this rank's own batches, once per
    ``(setting, policy)``: losses, full parameters, gathers in the final graph, how many nodes
    the pass recomputed and the activation bytes the step saves for backward."""
    out: dict[str, Any] = {}
    for setting, policy in configs:
        torch.manual_seed(0)
        case = sm._causal("LlamaConfig", "LlamaForCausalLM", **sm._LLAMA_LIKE)()
        model = case.model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        micro = MICRO if setting == "bf16_accumulate" else 1

        def step(model, opt, *batch, _case=case, _micro=micro):  # noqa: ANN001, ANN202
            for piece in zip(*(t.chunk(_micro) for t in batch)):
                loss = _case.loss(model, *piece) / _micro
                loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        compiled = spmd.compile(parallel_mode=_mode(setting, world), remat=policy, check_invariants=True)(
            step
        )
        g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
        losses = [compiled(model, opt, *case.batch(g)) for _ in range(2)]
        stage = compiled.graphs.get("rematerialize")
        out[f"{setting}/{policy}"] = {
            "losses": [x.detach().clone() for x in losses],
            "params": [_full(p).detach().clone() for p in model.parameters()],
            "recomputed": 0 if stage is None else sum(REMAT in n.meta for n in stage.graph.nodes),
            "saved_bytes": compiled.report().activation_saved_bytes,
            "gathers": sum(
                C.kind_of(c) is C.Kind.ALL_GATHER for c in C.collectives(compiled.graphs["final"].graph)
            ),
        }
    return out
