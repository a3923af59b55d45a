"""DTensorExpandMode under the fake process group: placements in the graph and the dump, simulated
2-D bytes per rank, and the error catalogue for placements DTensor cannot propagate."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd
from passes import collectives as C
from passes.meta import NODE_PLACEMENTS, PLACEMENT, ROLE, Role
from spmd.parallel import expand_rules
from spmd.reporting.dump import annotated_code
from tests import models
from tests.dist import workers_expand as wx
from tests.unit.fake_pg import fake_process_group

TP = {k: (Replicate(), v) for k, v in wx.TP.items()}


def _tokens(b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (b, 16), generator=g), torch.randint(0, 64, (b, 16), generator=g)


def _gpt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = models.TinyGPT()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)


def _lower(mode: spmd.DTensorExpandMode, model: nn.Module, opt: torch.optim.Optimizer, *batch, **kw):
    step = spmd.compile(parallel_mode=mode, check_invariants=True, **kw)(wx.train_step)
    return step, step.lower(model, opt, *batch)


def test_defaults_reduce_every_gradient_once() -> None:
    """Default placements at W=2: one all_reduce(sum) per gradient, bucketed by the pass pipeline.

    The default batch semantics is DDP's ("local"): the loss is this rank's mean, so no token
    count is reduced (under "global" the mean's global count took one more all-reduce)."""
    with fake_process_group(2):
        model, opt = _gpt()
        seen = []
        mode = spmd.DTensorExpandMode(custom_passes=[lambda gm: seen.append(len(gm.graph.nodes)) or gm])
        _, graphs = _lower(mode, model, opt, *_tokens())
        gm = graphs["partitioned"]
        assert seen == [len(gm.graph.nodes)]  # custom passes run on the expanded graph
        reduces = [n for n in gm.graph.nodes if C.is_collective(n) and C.kind_of(n) is C.Kind.ALL_REDUCE]
        grads = [n for n in gm.graph.nodes if n.meta.get(ROLE) is Role.GRAD]
        n_params = len(list(model.parameters()))
        assert len(grads) == n_params
        assert len(reduces) == n_params
        assert all(n.args[1] == "sum" for n in reduces)
        # Each gradient's all-reduce reads it scaled by 1/W first, as DDP's reducer.
        assert all(r.args[0].target is torch.ops.aten.mul.Tensor for r in reduces)
        assert all(r.args[0].args[1] == 0.5 for r in reduces)
        # The pass pipeline applies: the gradients' all-reduces share one bucket in the final graph.
        final = [n for n in graphs["final"].graph.nodes if C.is_collective(n)]
        assert len(final) == 1, [str(n.target) for n in final]
        # Every rank holds a full (replicated) copy; the local batch traced as the global one.
        assert all(p.placements == (Replicate(),) for p in model.parameters())


def test_placements_visible_in_graph_and_dump() -> None:
    with fake_process_group(4):
        model, opt = _gpt()
        mode = spmd.DTensorExpandMode({"dp": 2, "tp": 2}, param_placements=TP)
        _, graphs = _lower(mode, model, opt, *_tokens())
        gm = graphs["partitioned"]
        by_name = {n.name: n for n in gm.graph.nodes}
        assert by_name["p_blocks_0_fc_weight"].meta[PLACEMENT] == "(Replicate(), Shard(0))"
        assert by_name["p_blocks_0_out_weight"].meta[PLACEMENT] == "(Replicate(), Shard(1))"
        # The input keeps its declared placements: batch-sharded on "dp".
        assert by_name["x_input_0"].meta[NODE_PLACEMENTS] == (Shard(0), Replicate())
        # The row-parallel matmul's output is a partial sum over "tp". Under the default (DDP's)
        # batch semantics "dp" is local: each rank computes on its own batch and DTensor expands
        # on the "tp" sub-mesh alone, so values derived from the batch read Replicate() on "dp"
        # (under "global" they read Shard(0) there).
        placements = [n.meta.get(NODE_PLACEMENTS) for n in gm.graph.nodes if n.op != "placeholder"]
        assert (Replicate(), Partial()) in placements
        assert not any(isinstance(pl, tuple) and not isinstance(pl[0], Replicate) for pl in placements)
        code = annotated_code(gm)
        assert "# blocks.0.fc.weight: (Replicate(), Shard(0))" in code
        assert "(Replicate(), Partial(sum))" in code
        # DTensor never communicates over "dp" (each rank's batch is its own there): the only
        # collectives on it are the gradients' averaging all-reduces, one per parameter.
        mesh = mode.device_mesh(model)
        on_dp = [
            n
            for n in gm.graph.nodes
            if C.is_collective(n) and C.group_of(n) == mesh.get_group("dp").group_name
        ]
        assert len(on_dp) == len(list(model.parameters()))
        assert all(
            C.kind_of(n) is C.Kind.ALL_REDUCE and n.args[0].target is torch.ops.aten.mul.Tensor for n in on_dp
        )
        dp_tp = mesh["dp_tp"].get_group().group_name
        assert not any(C.is_collective(n) and C.group_of(n) == dp_tp for n in gm.graph.nodes)
        # Local shapes: each rank holds its slice.
        assert tuple(by_name["p_blocks_0_fc_weight"].meta["val"].shape) == (64, 32)
        assert model.blocks[0].fc.weight.to_local().shape == (64, 32)
        assert model.blocks[0].fc.weight.shape == (128, 32)


def test_simulate_2d_mesh_bytes_per_rank() -> None:
    """spmd.simulate at 8 ranks with a {"dp": -1, "tp": 2} mesh: the sharded weights (and their
    Adam state) take half their bytes per rank; LayerNorms and row-parallel biases stay whole."""
    model, opt = _gpt()
    mode = spmd.DTensorExpandMode({"dp": -1, "tp": 2}, param_placements=TP)
    r = spmd.simulate(spmd.compile(parallel_mode=mode)(wx.train_step), model, opt, *_tokens(2), world_size=8)
    full = sum(p.numel() * 4 for p in model.parameters())
    whole = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if "ln" in n or n.endswith(("proj.bias", "out.bias"))
    )
    want = whole + (full - whole) // 2
    assert r.world_size == 8 and r.parallel_style == "dtensor_expand (dp=-1, tp=2)"
    assert r.param_bytes == want
    assert r.optim_state_bytes == 2 * want + 4 * len(list(model.parameters()))  # exp_avg(_sq), step
    assert r.input_bytes == 2 * 2 * 16 * 8  # this rank's local batch: 2 sequences of 16 int64, x and y
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


@pytest.mark.parametrize("mesh", [(2, 2), {"data": 2, "tp": 2}], ids=["unnamed", "named"])
def test_local_dp_dimension_carries_only_gradient_averaging(mesh) -> None:
    """DP x TP under the default (DDP's) batch semantics: on the data-parallel dimension each rank's
    batch is its own, so DTensor must never redistribute over it (chunking a "replicated" activation
    there and all-gathering it later would mix ranks' batches). Its only collectives are the
    gradients' averaging all-reduces, one per parameter, each of a gradient times 1/2; tp carries the
    rest. An unnamed mesh takes its sub-mesh from the process groups."""
    with fake_process_group(4):
        model, opt = _gpt()
        mode = spmd.DTensorExpandMode(mesh, param_placements=TP)
        gm = _lower(mode, model, opt, *_tokens())[1]["partitioned"]
        m = mode.device_mesh(model)
        dp, tp = m.get_group(0).group_name, m.get_group(1).group_name
        colls = [n for n in gm.graph.nodes if C.is_collective(n)]
    on_dp = [n for n in colls if C.group_of(n) == dp]
    assert len(on_dp) == len(list(model.parameters()))
    assert all(
        C.kind_of(n) is C.Kind.ALL_REDUCE and n.args[0].target is torch.ops.aten.mul.Tensor for n in on_dp
    )
    assert all(n.args[0].args[1] == 0.5 for n in on_dp)
    assert {C.group_of(n) for n in colls} == {dp, tp}


# ----------------------------------------------------------------------------- errors


class CustomActMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(wx.scaled_tanh(self.fc1(x), 2.0))


def _mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8), torch.randint(0, 4, (4,))


def test_error_op_without_strategy_names_op_module_line_and_placements() -> None:
    with fake_process_group(2):
        torch.manual_seed(0)
        model = CustomActMLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(spmd.ShardingPropagationError) as info:
            _lower(spmd.DTensorExpandMode(), model, opt, *_mlp_batch())
    msg = str(info.value)
    assert "spmd_test.scaled_tanh" in msg or "spmd_test::scaled_tanh" in msg
    assert "test_expand.py" in msg and "wx.scaled_tanh(self.fc1(x), 2.0)" in msg
    # The default (DDP's) batch semantics makes each rank's batch its whole on the 1-D mesh, so the
    # op's input reads Replicate() (under batch_semantics="global" it read Shard(0)).
    assert "(Replicate())" in msg
    assert "register_sharding" in msg


def test_error_override_without_placements_then_with() -> None:
    """The same stand-in fails without declared placements and expands with them."""
    with fake_process_group(2):
        torch.manual_seed(0)
        model = wx.ActMLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile([wx.LocalAct(False)], parallel_mode=spmd.DTensorExpandMode())(wx.train_step)
        with pytest.raises(spmd.ShardingPropagationError, match="in module 'act'"):
            step.lower(model, opt, *_mlp_batch())
    with fake_process_group(2):
        torch.manual_seed(0)
        model = wx.ActMLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = spmd.compile([wx.LocalAct(True)], parallel_mode=spmd.DTensorExpandMode())(wx.train_step)
        gm = step.lower(model, opt, *_mlp_batch())["partitioned"]
        local = [n for n in gm.graph.nodes if n.meta.get(NODE_PLACEMENTS) == "local (act)"]
        assert any("scaled_tanh" in str(n.target) for n in local)


def test_error_shard_of_missing_dimension() -> None:
    with fake_process_group(2):
        model, opt = _gpt()
        mode = spmd.DTensorExpandMode(param_placements={"blocks.0.ln1.weight": Shard(1)})
        with pytest.raises(spmd.ShardingPropagationError, match=r"'blocks.0.ln1.weight' of shape \(32,\)"):
            _lower(mode, model, opt, *_tokens())
        mode = spmd.DTensorExpandMode(input_placements=Shard(2))
        with pytest.raises(
            spmd.ShardingPropagationError, match=r"argument #0 .* of shape \(4, 16\) cannot take"
        ):
            _lower(mode, model, opt, *_tokens())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mesh": "dp"}, "mesh must be a DeviceMesh"),
        ({"mesh": {"dp": "2"}}, "maps names to sizes"),
        ({"param_placements": [Shard(0)]}, "must be a dict"),
        ({"param_placements": {"fc.*": "Shard(0)"}}, "must be a Placement or a tuple"),
        ({"input_placements": "Shard(0)"}, "input_placements must be a tuple"),
        ({"custom_passes": [1]}, "custom_passes items must be callables"),
    ],
)
def test_config_errors_at_construction(kwargs, match) -> None:
    with pytest.raises(spmd.ConfigError, match=match):
        spmd.DTensorExpandMode(**kwargs)


def test_config_errors_against_the_mesh() -> None:
    with fake_process_group(4):
        model, opt = _gpt()
        with pytest.raises(spmd.ConfigError, match="does not fit the default process group's 4 ranks"):
            _lower(spmd.DTensorExpandMode((3, 2)), model, opt, *_tokens())
        with pytest.raises(spmd.ConfigError, match="gives 1 placements .* mesh has 2 dimensions"):
            _lower(
                spmd.DTensorExpandMode((2, 2), param_placements={"tok.*": Shard(0)}), model, opt, *_tokens()
            )
        with pytest.raises(spmd.ConfigError, match="state cannot be Partial"):
            _lower(
                spmd.DTensorExpandMode((2, 2), param_placements={"tok.*": (Partial(), Replicate())}),
                model,
                opt,
                *_tokens(),
            )


def test_world_size_one_is_the_plain_step() -> None:
    """Without a process group (plain ``python``) the step is the single-device one; a mesh shape
    must then hold one rank."""
    model, opt = _gpt()
    for mesh in (None, {"dp": -1, "tp": 1}):
        step, graphs = _lower(spmd.DTensorExpandMode(mesh), model, opt, *_tokens())
        assert not any(C.is_collective(n) for n in graphs["final"].graph.nodes)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    with pytest.raises(spmd.ConfigError, match="does not fit the default process group's 1 ranks"):
        _lower(spmd.DTensorExpandMode({"dp": 1, "tp": 2}), model, opt, *_tokens())


def test_rules_are_listed() -> None:
    expand_rules.register()
    names = {str(op) for op in expand_rules.RULES}
    assert "aten._fused_sgd_.default" in names
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default" in names


def test_strided_splits_are_computed_locally() -> None:
    """A fused q, k, v split strided over 2 ranks (``_StridedShard(2, split_factor=3)``): the
    split into q, k, v gives each its own split (local 16 of 32), a slice on group boundaries
    too, and their gradients' cat (or slice_backward) is the strided whole again, all without a
    collective. Off the groups' boundaries, or on a dimension not split, DTensor decides (None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from passes.torch_compat import StridedShard
    from spmd.parallel.expand_graph import _wrap, _wrap_meta

    aten = torch.ops.aten
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        qkv = _wrap(torch.empty(2, 8, 48), mesh, (StridedShard(2, split_factor=3),), torch.empty(2, 8, 96))
        with CommDebugMode() as comm:
            q, k, v = expand_rules.strided_call(aten.split.Tensor, (qkv, 32, 2), {}, _wrap_meta)
            kv = expand_rules.strided_call(aten.slice.Tensor, (qkv, 2, 32, 2**63 - 1), {}, _wrap_meta)
            whole = expand_rules.strided_call(aten.cat.default, ([q, k, v], 2), {}, _wrap_meta)
            pad = expand_rules.strided_call(
                aten.slice_backward.default, (k, [2, 8, 96], 2, 32, 64, 1), {}, _wrap_meta
            )
        assert comm.get_total_counts() == 0
        assert q.placements == (Shard(2),) and q.shape == (2, 8, 32) and q.to_local().shape == (2, 8, 16)
        assert kv.placements == (StridedShard(2, split_factor=2),) and kv.to_local().shape == (2, 8, 32)
        assert whole.placements == qkv.placements and whole.to_local().shape == (2, 8, 48)
        assert (
            pad.placements == qkv.placements
            and pad.shape == (2, 8, 96)
            and pad.to_local().shape == (2, 8, 48)
        )
        assert expand_rules.strided_call(aten.split.Tensor, (qkv, 16, 2), {}, _wrap_meta) is None
        assert expand_rules.strided_call(aten.split.Tensor, (qkv, 4, 1), {}, _wrap_meta) is None


def test_error_model_distributed_by_another_mode() -> None:
    with fake_process_group(2):
        torch.manual_seed(0)
        model = models.MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        spmd.compile(parallel_mode=spmd.DataParallel("replicate"))(wx.train_step).lower(
            model, opt, *_mlp_batch()
        )
        with pytest.raises(spmd.ConfigError, match="distributed by another parallel mode"):
            _lower(spmd.DTensorExpandMode(), model, opt, *_mlp_batch())


# ----------------------------------------------------------------------------- attention masks

_ATTN = "aten._scaled_dot_product_flash_attention_for_cpu"


def _mask_shapes(gm) -> list[tuple[str, tuple[int, ...]]]:
    """(op, local attn_mask shape) of every CPU flash attention node, forward and backward."""
    return [
        (str(n.target).removeprefix(_ATTN), tuple(n.kwargs["attn_mask"].meta["val"].shape))
        for n in gm.graph.nodes
        if str(n.target).startswith(_ATTN)
    ]


@pytest.mark.parametrize(
    "mesh,mask_heads,local",
    [
        # Batch-sharded q (global batch 8 of local 4): the mask [B, 1, T, T] is batch-sharded too.
        ({"dp": 2}, 1, (4, 1, 16, 16)),
        # dp x tp: batch on "dp"; the heads dim of size 1 broadcasts, replicated on "tp".
        ({"dp": 2, "tp": 2}, 1, (4, 1, 16, 16)),
        # A [B, H, T, T] mask follows the head-sharded q on "tp".
        ({"dp": 2, "tp": 2}, 4, (4, 2, 16, 16)),
    ],
)
def test_attn_mask_follows_q(mesh, mask_heads, local) -> None:
    """F.scaled_dot_product_attention(q, k, v, attn_mask=mask) with a boolean mask built from the
    batch: the CPU flash kernel and its backward take the mask with q's placements where it does
    not broadcast, replicated where it does."""
    with fake_process_group(4 if "tp" in mesh else 2):
        torch.manual_seed(0)
        model = models.MaskedGPT(mask_heads=mask_heads)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        tp = {"blocks.*.[qkv].*": (Replicate(), Shard(0)), **TP} if "tp" in mesh else {}
        _, graphs = _lower(spmd.DTensorExpandMode(mesh, param_placements=tp), model, opt, *_tokens())
        gm = graphs["partitioned"]
        shapes = _mask_shapes(gm)
        q_heads = [
            n.args[0].meta["val"].shape[1] for n in gm.graph.nodes if str(n.target) == _ATTN + ".default"
        ]
    assert shapes == [(".default", local)] * 2 + [("_backward.default", local)] * 2
    assert q_heads == [4 // (2 if "tp" in mesh else 1)] * 2  # q's heads are sharded on "tp"


def test_attn_mask_with_sequence_sharded_q_is_refused() -> None:
    with fake_process_group(2):
        torch.manual_seed(0)
        model = models.MaskedGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        mode = spmd.DTensorExpandMode(input_placements=Shard(1))
        with pytest.raises(spmd.ShardingPropagationError, match=r"q sharded on dimension 2 \(sequence\)"):
            _lower(mode, model, opt, *_tokens())


def test_hf_llama_sdpa_mask_is_batch_sharded() -> None:
    """Hugging Face's masking_utils builds a float [B, 1, S, S] mask from the attention_mask
    (indexed with an arange: DTensor gathers it) and passes it to SDPA; the expansion slices it
    back to this rank's batch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step_fn(model, opt, ids, attention_mask):
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[0, :2] = 0  # left padding
    with fake_process_group(2):
        step = spmd.compile(parallel_mode=spmd.DTensorExpandMode(), check_invariants=True)(step_fn)
        shapes = _mask_shapes(step.lower(model, opt, ids, attention_mask)["partitioned"])
    assert shapes == [(".default", (2, 1, 8, 8))] * 2 + [("_backward.default", (2, 1, 8, 8))] * 2


def test_unused_pure_ops_left_by_the_expansion_are_dropped() -> None:
    """torch 2.11/2.12's DTensor leaves unused embedding / nll_loss calls on uninitialised tensors in
    the expanded graph (out-of-range indices at run time); they go, with their unused getitems,
    while an unused in-place or random op stays."""
    from spmd.parallel import expand_finish

    def f(w: torch.Tensor, idx: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        dead_w = torch.empty_strided((2, 3), (3, 1))
        dead_i = torch.empty_strided((2,), (1,), dtype=torch.long)
        torch.ops.aten.embedding.default(dead_w, dead_i)  # unused, on garbage indices
        torch.ops.aten.nll_loss_forward.default(dead_w, dead_i, None, 1, -100)  # unused tuple op
        buf.add_(1)  # unused result, but it writes an input
        torch.ops.aten.bernoulli.p(dead_w, 0.5)  # unused, but it advances the generator
        return torch.ops.aten.embedding.default(w, idx)

    make_fx = torch.fx.experimental.proxy_tensor.make_fx
    gm = make_fx(f, tracing_mode="fake")(torch.ones(4, 3), torch.tensor([0, 1]), torch.zeros(2))
    targets = lambda: [n.target for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert targets().count(torch.ops.aten.embedding.default) == 2
    expand_finish.drop_dead_compute(gm.graph)
    assert targets().count(torch.ops.aten.embedding.default) == 1
    assert torch.ops.aten.nll_loss_forward.default not in targets()
    assert torch.ops.aten.add_.Tensor in targets() and torch.ops.aten.bernoulli.p in targets()
