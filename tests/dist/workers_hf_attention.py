"""Per-rank body of tests/dist/test_hf_attention.py."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import spmd
from tests import models as shared
from tests import sweep_models as S


def lm_step(model: nn.Module, optim: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _fsdp2(model: nn.Module, policy: MixedPrecisionPolicy) -> nn.Module:
    """FSDP2 as users apply it to an HF model: ``fully_shard`` each decoder layer, then the root."""
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def sdpa_parity(rank: int, world: int, steps: int) -> list[str]:
    """Each HF SDPA model (``sweep_models.HF_SDPA``): spmd replicate against DDP in fp32, and
    spmd fully_shard with bf16 params / fp32 reduce against FSDP2 with the same policy; every
    step's loss and the final parameters bit for bit, different data per rank. Returns the
    mismatches, and one ``"sdpa <model>/<style> <is_causal values> <masks>"`` line per graph."""
    out: list[str] = []
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name in S.HF_SDPA:
        for style in ("replicate", "fully_shard"):
            tag = f"{name}/{style}"
            model = S.hf_sdpa_causal_lm(name)
            if style == "replicate":
                ref: nn.Module = DDP(copy.deepcopy(model))
                mode = spmd.DataParallel("replicate")
            else:
                ref = _fsdp2(copy.deepcopy(model), MixedPrecisionPolicy(**bf16))  # type: ignore[arg-type]
                mode = spmd.DataParallel("fully_shard", mixed_precision=spmd.MixedPrecision(**bf16))
            opt = shared.make_optimizer("sgd_momentum_foreach", model)
            ref_opt = shared.make_optimizer("sgd_momentum_foreach", ref)
            step = spmd.compile(parallel_mode=mode)(lm_step)
            g = torch.Generator().manual_seed(100 + rank)
            for i in range(steps):
                ids = torch.randint(1, S.V, (S.B, S.T), generator=g)
                loss, want = step(model, opt, ids), lm_step(ref, ref_opt, ids)
                # Keep stepping after a mismatch: a rank that stopped early would hang the other.
                if not torch.equal(loss, want):
                    out.append(f"{tag}: step {i} loss {loss.item()!r} != {want.item()!r}")
            ref_module = ref.module if isinstance(ref, DDP) else ref
            for (n, p), q in zip(model.named_parameters(), ref_module.parameters()):
                mine, theirs = _full(p), _full(q)
                if not torch.equal(mine, theirs):
                    diff = (mine.double() - theirs.double()).abs().max().item()
                    out.append(f"{tag}: param {n} differs by {diff:.3g}")
            calls = S.sdpa_calls(step.graphs["final"])
            causal = sorted({str(c.get("is_causal")) for c in calls})
            masks = sum(c.get("attn_mask") is not None for c in calls)
            out.append(f"sdpa {tag} {len(calls)} {','.join(causal)} {masks}")
    return out
