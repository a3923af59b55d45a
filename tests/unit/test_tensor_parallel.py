"""The tensor-parallel plan (spmd.parallel.tensor_parallel.resolve_plan), the 2-D placements
(spmd.parallel.plan) and DataParallel's tp configuration errors; a 2-D step under the fake
process group. The multi-process parity tests are tests/dist/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import _StridedShard

import spmd
from spmd.models import CONFIGS, GPT, train_step
from spmd.parallel import plan, tp_plans
from spmd.parallel.tensor_parallel import resolve_plan
from tests.unit.fake_pg import fake_process_group


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 1)


def test_styles_place_parameters_and_layouts() -> None:
    m = Block()
    tp = resolve_plan(
        m,
        {
            "emb": RowwiseParallel(),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "conv.weight": Shard(0),
        },
    )
    assert tp.params == {
        "emb.weight": Shard(0),  # vocabulary-parallel embedding
        "up.weight": Shard(0),
        "up.bias": Shard(0),
        "down.weight": Shard(1),
        "down.bias": Replicate(),
        "norm.weight": Replicate(),
        "norm.bias": Replicate(),
        "conv.weight": Shard(0),
    }
    # (input, output, output gradient) at each planned module's boundary
    assert tp.layouts["emb"] == (Replicate(), Replicate(), Replicate())
    assert tp.layouts["up"] == (Replicate(), Shard(-1), Shard(-1))
    assert tp.layouts["down"] == (
        Shard(-1),
        Shard(1),
        Replicate(),
    )  # reduce-scatter into sequence parallelism
    assert tp.layouts["norm"] == (Shard(1), Shard(1), Shard(1))


def test_plan_errors_name_the_fix() -> None:
    m = Block()
    with pytest.raises(spmd.ConfigError, match="'upp' matches no module.*Did you mean 'up'"):
        resolve_plan(m, {"upp": ColwiseParallel()})
    with pytest.raises(spmd.ConfigError, match="Conv1d.*conv.weight': Shard"):
        resolve_plan(m, {"conv": ColwiseParallel()})
    with pytest.raises(spmd.ConfigError, match="has no dimension 2"):
        resolve_plan(m, {"up.weight": Shard(2)})
    with pytest.raises(spmd.ConfigError, match="give a torch.distributed.tensor.parallel style"):
        resolve_plan(m, {"up": "colwise"})
    # PrepareModuleInput adds no layouts and replicates its module's own parameters.
    assert resolve_plan(m, {"norm": PrepareModuleInput()}).params == {
        "norm.weight": Replicate(),
        "norm.bias": Replicate(),
    }


def test_tied_parameters_have_one_placement() -> None:
    gpt = GPT(CONFIGS["tiny"])  # head tied to the token embedding
    tp = resolve_plan(gpt, tp_plans.gpt())
    assert tp.params["tok.weight"] == tp.params["head.weight"] == Shard(0)
    with pytest.raises(spmd.ConfigError, match="tied.*place both names alike"):
        resolve_plan(gpt, {"tok": RowwiseParallel(), "head": RowwiseParallel()})


def test_mode_configuration_errors() -> None:
    with pytest.raises(spmd.ConfigError, match="tp_plan needs tensor-parallel ranks"):
        spmd.DataParallel("fully_shard", tp_plan=tp_plans.gpt())
    with pytest.raises(spmd.ConfigError, match="tp_size must be an int"):
        spmd.DataParallel("fully_shard", tp_size=0, tp_plan={})


def test_two_d_placements_follow_fsdp2() -> None:
    """Column-parallel pieces are split again on rows over dp (_StridedShard, as FSDP2 on a
    parallelize_module parameter); row-parallel ones are (Shard(0), Shard(1))."""
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        w = torch.empty(8, 4)
        assert plan.placements_for("fully_shard", mesh, w, Shard(0)) == (
            _StridedShard(0, split_factor=2),
            Shard(0),
        )
        assert plan.placements_for("fully_shard", mesh, w, Shard(1)) == (Shard(0), Shard(1))
        assert plan.placements_for("replicate", mesh, w, Shard(0)) == (Replicate(), Shard(0))
        assert plan.placements_for("fully_shard", mesh, w, None) == (Shard(0), Replicate())
        # A fused projection split strided over tp: on dim 1 the data dimension shards rows as
        # ever; on dim 0 no contiguous row shard describes its rows: replicated over data.
        qkv = _StridedShard(0, split_factor=3)
        assert plan.placements_for("fully_shard", mesh, w, _StridedShard(1, split_factor=2)) == (
            Shard(0),
            _StridedShard(1, split_factor=2),
        )
        assert plan.placements_for("fully_shard", mesh, torch.empty(6, 4), qkv) == (Replicate(), qkv)
        plan.check_mesh(mesh, "fully_shard")
        with pytest.raises(spmd.ConfigError, match="needs 2 data dimensions"):
            plan.check_mesh(mesh, "hybrid_shard")


def test_two_d_step_under_the_fake_process_group() -> None:
    """A GPT step on a (dp_shard 2, tp 2) mesh: parameters hold half of their tensor-parallel piece,
    the graph has collectives over the tp groups (activations) and the dp groups (parameters)."""
    torch.manual_seed(0)
    model = GPT(CONFIGS["tiny"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.randint(0, 64, (2, 16))
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", tp_size=2, tp_plan=tp_plans.gpt()))(
        train_step
    )
    with fake_process_group(4):
        step(model, optim, idx, idx.roll(-1, 1))
        assert tuple(model.blocks[0].fc.weight.to_local().shape) == (32, 32)  # (128 / 2 / 2, 32)
        assert tuple(model.blocks[0].out.weight.to_local().shape) == (16, 64)  # (32 / 2, 128 / 2)
        gm = step.graphs["final"]
        groups = {
            n.args[-1]
            for n in gm.graph.nodes
            if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)
        }
        mesh = model.blocks[0].fc.weight.device_mesh
        assert {mesh.get_group("tp").group_name, mesh.get_group("dp_shard").group_name} <= groups


def test_vocab_parallel_head_ops_match_the_chunked_head() -> None:
    """passes.vocab_parallel_loss on two halves of the vocabulary, combined as the graph combines
    them (max, rescaled sum, sum), against spmd::linear_cross_entropy on the whole head: several
    chunks, an ignored target, mean reduction. Equal up to float rounding (the log-sum-exp is
    combined from per-half maxima)."""
    from passes.linear_cross_entropy import LINEAR_CROSS_ENTROPY
    from passes.vocab_parallel_loss import VP_LCE_GRADS, VP_LSE_STATS

    torch.manual_seed(0)
    n, d, v = 10, 8, 12
    x, w = torch.randn(n, d), torch.randn(v, d)
    target = torch.randint(0, v, (n,))
    target[3] = -100
    grad_loss = torch.tensor(0.5)
    loss, total, gx, gw = LINEAR_CROSS_ENTROPY(x, w, target, grad_loss, 4, 1, -100, None)
    halves = [(w[:6], 0), (w[6:], 6)]
    stats = [VP_LSE_STATS(x, wl, target, 3, start, -100, None) for wl, start in halves]
    top = torch.maximum(stats[0][0], stats[1][0])
    lse = top + torch.log(sum(s[1] * torch.exp(s[0] - top) for s in stats))
    t_logit = stats[0][2] + stats[1][2]
    keep = target != -100
    assert torch.allclose((lse - t_logit)[keep].sum() / keep.sum(), loss, atol=1e-6)
    scale = grad_loss * keep.float() / keep.sum()
    grads = [VP_LCE_GRADS(x, wl, target, lse, scale, 3, start, None) for wl, start in halves]
    assert torch.allclose(grads[0][0] + grads[1][0], gx, atol=1e-6)
    assert torch.allclose(torch.cat([grads[0][1], grads[1][1]]), gw, atol=1e-6)


def test_chunked_head_is_vocabulary_parallel_under_tp() -> None:
    """With chunked_loss and a vocabulary-split head (HF Llama, lm_head column-parallel), the step
    runs the two vocabulary-parallel passes and never gathers the head weight or its gradient.
    Without the vocabulary-parallel rule the op has no sharding rule and runs on the gathered head."""
    from tests.dist.workers_tp import build

    torch.manual_seed(0)
    model, plan_, _ = build("hf_llama")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, 64, (2, 8))

    def step_fn(model, optim, ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    mode = spmd.DataParallel("replicate", tp_size=2, tp_plan=plan_)
    step = spmd.compile(parallel_mode=mode, chunked_loss=True)(step_fn)
    with fake_process_group(2):
        step(model, optim, ids, ids.clone())
        gm = step.graphs["final"]
        targets = {str(n.target) for n in gm.graph.nodes}
        assert "spmd.vp_lse_stats.default" in targets and "spmd.vp_lce_grads.default" in targets
        assert "spmd.linear_cross_entropy.default" not in targets
        gathered = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if "all_gather" in str(n.target)]
        assert (64, 32) not in gathered, "the head weight (or its gradient) was gathered"


def test_meta_device_model_is_materialised_in_tp_pieces() -> None:
    """A model built on the meta device is materialised module by module straight into its 2-D
    pieces (no rank holds the full model); tied weights stay tied."""
    with torch.device("meta"):
        model = GPT(CONFIGS["tiny"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mode = spmd.DataParallel("fully_shard", tp_size=2, tp_plan=tp_plans.gpt())
    with fake_process_group(4):
        mode.distribute(model, optim)
        w = model.blocks[0].fc.weight
        assert tuple(w.placements) == (_StridedShard(0, split_factor=2), Shard(0))
        assert tuple(w.to_local().shape) == (32, 32) and not w.to_local().is_meta
        assert model.tok.weight is model.head.weight


def test_strided_pieces_hold_a_share_of_every_group() -> None:
    """A parameter split strided over tp (``_StridedShard(0, split_factor=3)``: a fused q, k, v)
    holds this rank's share of each group, [q_r; k_r; v_r], also under a data-dimension shard of
    another dimension; a plan entry whose dimension does not split into the groups is refused."""
    from spmd.parallel.sharding import _to_dtensor

    full = torch.arange(24.0).view(12, 2)  # rows: q 0-3, k 4-7, v 8-11
    with fake_process_group(2):  # this process is rank 0
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        got = _to_dtensor(full, mesh, (_StridedShard(0, split_factor=3),))
        assert got.to_local().tolist() == full[[0, 1, 4, 5, 8, 9]].tolist()
    with fake_process_group(4):
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        t = torch.arange(24.0).view(2, 12)
        got = _to_dtensor(t, mesh2, (Shard(0), _StridedShard(1, split_factor=3)))
        assert got.to_local().tolist() == t[:1, [0, 1, 4, 5, 8, 9]].tolist()
    model = nn.Sequential(nn.Linear(4, 9))
    with pytest.raises(spmd.ConfigError, match="does not split into 2 equal groups"):
        resolve_plan(model, {"0.weight": _StridedShard(0, split_factor=2)})
