"""``spmd.MixedPrecision``: the knob's validation, the casts in the traced graph, world-size-1
numerics against an eager mixed-precision step, and the partitioned graphs under the fake
process group (world size 2).

What the fully_shard graph looks like with ``param_dtype=bf16, reduce_dtype=fp32``::

    p_w (f32 shard) -> _to_copy(bf16) [cast of w] -> (pad) -> all_gather (bf16) -> wait -> forward
    p_w (f32 shard) -> _to_copy(bf16) [cast of w] -> (pad) -> all_gather (bf16) -> wait -> backward
    grad (bf16) -> _to_copy(f32) -> (pad) -> reduce_scatter (f32) -> wait -> optimizer (f32, on p_w)

and with ``reduce_dtype`` left None the bf16 gradient is reduce-scattered directly and the
reduced shard is cast to f32 for the optimizer.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import spmd
from passes import collectives as C
from passes.fused_align import ALIGNED_FUSED
from passes.meta import CAST_OF, GRAD_OF, INPUT_CAST, PHASE, ROLE, STATE_NAME, Phase, Role
from spmd.reporting.dump import annotated_code
from tests import models
from tests.unit.fake_pg import fake_process_group

BF16 = torch.bfloat16
_to_copy = torch.ops.aten._to_copy.default

# ----------------------------------------------------------------------------- the knob


def test_defaults_follow_fsdp2() -> None:
    mp = spmd.MixedPrecision(param_dtype=BF16)
    assert mp.reduce_dtype is None and mp.gradient_reduce_dtype is BF16  # reduce in param_dtype
    assert mp.cast_forward_inputs is True and mp.buffer_dtype is None
    assert (
        spmd.MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32).gradient_reduce_dtype
        is torch.float32
    )
    assert spmd.MixedPrecision(reduce_dtype=BF16).compute_casts() is None  # nothing to cast at trace time


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"param_dtype": "bf16"}, "param_dtype must be a torch.dtype"),
        ({"reduce_dtype": torch.int32}, "reduce_dtype must be a floating-point dtype"),
        ({"buffer_dtype": 16}, "buffer_dtype must be a torch.dtype"),
        ({"cast_forward_inputs": 1}, "cast_forward_inputs must be True or False"),
    ],
)
def test_bad_values_raise_config_error(kwargs: dict, match: str) -> None:
    with pytest.raises(spmd.ConfigError, match=match):
        spmd.MixedPrecision(**kwargs)


def test_keyword_only() -> None:
    """FSDP2's third positional field is output_dtype, ours buffer_dtype: positional is refused."""
    with pytest.raises(TypeError):
        spmd.MixedPrecision(BF16)  # type: ignore[misc]


def test_data_parallel_checks_the_type() -> None:
    with pytest.raises(spmd.ConfigError, match=r"spmd.MixedPrecision\(param_dtype=torch.bfloat16\)"):
        spmd.DataParallel("fully_shard", mixed_precision=BF16)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with pytest.raises(spmd.ConfigError, match="MixedPrecisionPolicy translates"):
        spmd.DataParallel("fully_shard", mixed_precision=MixedPrecisionPolicy(param_dtype=BF16))


# ----------------------------------------------------------------------------- world size 1


def _mode(style: str = "replicate", **mp) -> spmd.DataParallel:
    return spmd.DataParallel(style, mixed_precision=spmd.MixedPrecision(**mp), min_unit_mb=0)


def _casts(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.meta[CAST_OF]: n for n in gm.graph.nodes if CAST_OF in n.meta}


def test_traced_graph_casts_params_and_inputs() -> None:
    """Every floating parameter gets one compute cast (the tied head/tok weight one), marked
    with its name and module; the optimizer reads the f32 placeholders; the dump shows it."""
    assert not dist.is_initialized()
    model = models.build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spmd.compile(parallel_mode=_mode(param_dtype=BF16))(models.train_step)
    x, y = models.batches("mlp", 1)[0]
    gm = step.lower(model, opt, x, y)["traced"]
    casts = _casts(gm)
    assert sorted(casts) == sorted([n for n, _ in model.named_parameters()] + [INPUT_CAST])
    for name, c in casts.items():
        assert c.meta["val"].dtype is BF16 and c.meta[PHASE] is Phase.FORWARD
        if name != INPUT_CAST:
            assert c.args[0].meta[STATE_NAME] == name
            assert c.meta["spmd_module"] == name.rpartition(".")[0]
    assert "| cast of net.0.weight" in annotated_code(gm)
    assert step.report().parallel_style == "replicate, mixed precision param=bfloat16 reduce=bfloat16"
    for n in gm.graph.nodes:
        if n.meta.get(PHASE) is Phase.OPTIMIZER and n.op == "call_function":
            for i in n.all_input_nodes:
                if i.op == "placeholder" and i.meta[ROLE] is Role.PARAM:
                    assert i.meta["val"].dtype is torch.float32

    no_input_cast = spmd.compile(parallel_mode=_mode(param_dtype=BF16, cast_forward_inputs=False))(
        lambda model, x: model(x.to(BF16))
    )
    assert INPUT_CAST not in _casts(no_input_cast.lower(model, x)["traced"])


def _eager_mp_step(model, optim, x, y, dtype, buffer_dtype=None):
    """The eager counterpart: compute with cast copies through functional_call (autograd casts
    each gradient back to f32), then the f32 optimizer; mutated buffer copies written back."""
    params = {n: p.to(dtype) for n, p in model.named_parameters()}
    buffers = {
        n: b.to(buffer_dtype) if buffer_dtype and b.is_floating_point() else b
        for n, b in model.named_buffers()
    }
    out = torch.func.functional_call(
        model, {**params, **buffers}, (x.to(dtype) if x.is_floating_point() else x,)
    )
    loss = models.loss_fn(out, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        for n, b in model.named_buffers():
            if buffers[n] is not b:
                b.copy_(buffers[n])
    return loss


@pytest.mark.parametrize(
    "name,opt_name",
    [("mlp", "sgd_momentum_foreach"), ("tinygpt", "adamw_fused"), ("convbn", "sgd_momentum_foreach")],
)
def test_world_size_1_matches_eager_mixed_precision(name: str, opt_name: str) -> None:
    """bf16 compute over f32 master weights equals the eager step bit for bit (losses, parameters,
    and BatchNorm statistics updated in bf16 and written back to the f32 buffers)."""
    assert not dist.is_initialized()
    model = models.build(name)
    ref = copy.deepcopy(model)
    opt, ref_opt = models.make_optimizer(opt_name, model), models.make_optimizer(opt_name, ref)
    buffer_dtype = BF16 if name == "convbn" else None
    step = spmd.compile(parallel_mode=_mode(param_dtype=BF16, buffer_dtype=buffer_dtype))(models.train_step)
    for x, y in models.batches(name, 3):
        loss = step(model, opt, x, y)
        want = _eager_mp_step(ref, ref_opt, x, y, BF16, buffer_dtype)
        assert loss.dtype is BF16 and torch.equal(loss, want)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.dtype is torch.float32 and torch.equal(p, q), n
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        assert b.dtype is c.dtype and torch.equal(b, c), n
    if name == "convbn":
        assert not torch.equal(model.bn.running_mean, models.build(name).bn.running_mean)  # written back
        writes = [
            n
            for n in step.graphs["traced"].graph.nodes
            if n.target is torch.ops.aten.copy_.default and n.args[1].meta.get(CAST_OF, "").startswith("bn.")
        ]
        assert sorted(w.args[0].meta[STATE_NAME] for w in writes) == ["bn.running_mean", "bn.running_var"]


# ----------------------------------------------------------------------------- world size 2 (fake)


@pytest.fixture
def fake_world():
    with fake_process_group(2):
        yield


_LOWERED: dict[tuple, dict[str, fx.GraphModule]] = {}


def _lower(style: str, **mp) -> dict[str, fx.GraphModule]:
    """The graph stages of a 2-block TinyGPT step (compiled once per module run)."""
    key = (style, tuple(sorted(mp.items(), key=str)))
    if key not in _LOWERED:
        torch.manual_seed(0)
        model = models.TinyGPT(n_layers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        mode = spmd.DataParallel(
            style, min_unit_mb=0, mixed_precision=spmd.MixedPrecision(**mp) if mp else None
        )
        step = spmd.compile(parallel_mode=mode, check_invariants=True)(models.train_step)
        x, y = models.batches("tinygpt", 1)[0]
        _LOWERED[key] = dict(step.lower(model, opt, x, y))
    return _LOWERED[key]


def _by(gm: fx.GraphModule, kind: C.Kind) -> list[fx.Node]:
    return [c for c in C.collectives(gm.graph) if C.kind_of(c) is kind]


def _in_dtypes(colls: list[fx.Node]) -> set[torch.dtype]:
    return {i.meta["val"].dtype for c in colls for i in C.inputs_of(c)}


def _source(coll: fx.Node) -> list[fx.Node]:
    """The chain from a gather back to its placeholder: [placeholder, ..., collective input]."""
    chain = [C.inputs_of(coll)[0]]
    while chain[0].op != "placeholder":
        chain.insert(0, chain[0].args[0])
    return chain


def test_fully_shard_gathers_in_param_dtype(fake_world) -> None:
    stages = _lower("fully_shard", param_dtype=BF16, reduce_dtype=torch.float32)
    part = stages["partitioned"]
    gathers = _by(part, C.Kind.ALL_GATHER)
    assert {g.meta[PHASE] for g in gathers} == {Phase.FORWARD, Phase.BACKWARD}
    assert _in_dtypes(gathers) == {BF16}
    for g in gathers:
        p, cast, *_ = _source(g)  # the f32 shard is cast before anything else (then the pad)
        assert p.meta[ROLE] is Role.PARAM and p.meta["val"].dtype is torch.float32
        assert cast.target is _to_copy and cast.meta[CAST_OF] == p.meta[STATE_NAME]
        assert C.wait_of(g).meta["val"].dtype is BF16
    # No cast of a full parameter is left: the tracer's casts became the shards' casts.
    assert all(len(c.all_input_nodes) == 1 and c.args[0].op == "placeholder" for c in _casts(part).values())
    assert _in_dtypes(_by(part, C.Kind.REDUCE_SCATTER)) == {torch.float32}
    final = stages["final"]
    assert _in_dtypes(_by(final, C.Kind.ALL_GATHER)) == {BF16}
    assert _in_dtypes(_by(final, C.Kind.REDUCE_SCATTER)) == {torch.float32}
    _assert_optimizer_in_fp32(final)


def _assert_optimizer_in_fp32(gm: fx.GraphModule) -> None:
    # One call per unit after overlap_optimizer; together they update every parameter once. A
    # call with ragged shards to align runs the kernel inside spmd::aligned_fused_optimizer_.
    fused = [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops.aten._fused_adamw_.tensor_lr
        or (n.target is ALIGNED_FUSED and n.args[9] == "_fused_adamw_.tensor_lr")
    ]
    assert fused
    params = [p for f in fused for p in f.args[0]]
    grads = [g for f in fused for g in f.args[1]]
    assert len(set(params)) == len(params)
    assert {p.meta["val"].dtype for p in params} == {torch.float32}
    assert {g.meta["val"].dtype for g in grads} == {torch.float32}
    for p in params:  # the f32 master weights themselves (fully_shard may pad them for alignment)
        while p.op != "placeholder":
            p = p.args[0]
        assert p.meta[ROLE] is Role.PARAM


def test_fully_shard_reduce_in_param_dtype(fake_world) -> None:
    """reduce_dtype None: the bf16 gradient is reduce-scattered as it is (autograd's upcast and
    a downcast would cancel), then the reduced shard is cast to f32 for the optimizer."""
    stages = _lower("fully_shard", param_dtype=BF16)
    part = stages["partitioned"]
    scatters = _by(part, C.Kind.REDUCE_SCATTER)
    assert _in_dtypes(scatters) == {BF16}
    for rs in scatters:
        back = next(iter(C.wait_of(rs).users))
        while back.target is not _to_copy:  # past the un-padding slice
            back = next(iter(back.users))
        assert back.meta[ROLE] is Role.GRAD and back.meta[GRAD_OF] and back.meta["val"].dtype is torch.float32
    # No f32 copy of a full gradient is made.
    full_grad_casts = [
        n
        for n in part.graph.nodes
        if n.target is _to_copy
        and n.meta[PHASE] is Phase.BACKWARD
        and n.meta["val"].dtype is torch.float32
        and n.meta[ROLE] is not Role.GRAD
    ]
    assert full_grad_casts == []
    _assert_optimizer_in_fp32(stages["final"])


def test_report_counts_the_smaller_collectives(fake_world) -> None:
    """Gathers in bf16 move half the bytes of f32 gathers; f32 reduction the same as without
    mixed precision, bf16 reduction half."""

    def nbytes(stages: dict[str, fx.GraphModule], kind: C.Kind) -> int:
        return sum(C.bytes_of(c) for c in _by(stages["final"], kind))

    plain = _lower("fully_shard")
    fp32_reduce = _lower("fully_shard", param_dtype=BF16, reduce_dtype=torch.float32)
    bf16_reduce = _lower("fully_shard", param_dtype=BF16)
    assert 2 * nbytes(fp32_reduce, C.Kind.ALL_GATHER) == nbytes(plain, C.Kind.ALL_GATHER)
    assert nbytes(fp32_reduce, C.Kind.REDUCE_SCATTER) == nbytes(plain, C.Kind.REDUCE_SCATTER)
    assert 2 * nbytes(bf16_reduce, C.Kind.REDUCE_SCATTER) == nbytes(plain, C.Kind.REDUCE_SCATTER)


def test_replicate_casts_in_graph_and_all_reduces_in_reduce_dtype(fake_world) -> None:
    stages = _lower("replicate", param_dtype=BF16)
    part = stages["partitioned"]
    assert _in_dtypes(_by(part, C.Kind.ALL_REDUCE)) == {BF16}
    order = {n: i for i, n in enumerate(part.graph.nodes)}
    for name, cast in _casts(part).items():
        if name != INPUT_CAST:  # each parameter's copy is made just before its first reader
            first = min(cast.users, key=order.__getitem__)
            between = list(part.graph.nodes)[order[cast] + 1 : order[first]]
            assert all(CAST_OF in n.meta for n in between), name  # (other casts for that reader)
    _assert_optimizer_in_fp32(stages["final"])


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _matmuls_before_reductions(part: fx.GraphModule, kind: C.Kind) -> dict[str, int]:
    """Each parameter's gradient reduction -> how many matmuls the graph runs before its issue."""
    out: dict[str, int] = {}
    matmuls = 0
    for n in part.graph.nodes:
        matmuls += n.target in _MATMULS
        if C.is_collective(n) and C.kind_of(n) is kind:
            grad = C.wait_of(n)
            while grad.meta.get(GRAD_OF) is None:  # past the un-padding slice, the cast back
                grad = next(iter(grad.users))
            out[grad.meta[GRAD_OF]] = matmuls
    return out


@pytest.mark.parametrize(
    "style,mp",
    [
        ("fully_shard", {"param_dtype": BF16, "reduce_dtype": torch.float32}),
        ("fully_shard", {"param_dtype": BF16}),
        ("replicate", {"param_dtype": BF16, "reduce_dtype": torch.float32}),
    ],
)
def test_reductions_are_issued_where_they_are_without_mixed_precision(
    fake_world, style: str, mp: dict
) -> None:
    """Each gradient's reduction is issued as soon as the gradient is made, between the same
    backward matmuls as without mixed precision. autograd runs the upcast of every bf16
    gradient at the end of backward (the parameters' casts are the first ops of forward); a
    reduction issued after that upcast kept every full-size bf16 gradient live, and every
    reduction exposed, until the end of backward."""
    kind = C.Kind.REDUCE_SCATTER if style == "fully_shard" else C.Kind.ALL_REDUCE
    plain = _matmuls_before_reductions(_lower(style)["partitioned"], kind)
    assert len(set(plain.values())) > 2  # spread over backward: the comparison can tell
    assert _matmuls_before_reductions(_lower(style, **mp)["partitioned"], kind) == plain


def test_input_casts_at_every_unit_by_default() -> None:
    """Forward inputs are cast at the root and at each numbered block (FSDP2 casts at each
    fully_shard-ed module); ``cast_forward_inputs_at`` picks modules by pattern; [] is the root."""
    from spmd.frontend.trace_hooks import cast_modules

    model = models.build("llama")
    assert cast_modules(model, None) == ["", "layers.0", "layers.1"]
    assert cast_modules(model, ()) == [""]
    assert cast_modules(model, ("layers.*.w[0-9]", "norm")) == [
        "",
        "layers.0.w1",
        "layers.0.w3",
        "layers.0.w2",
        "layers.1.w1",
        "layers.1.w3",
        "layers.1.w2",
        "norm",
    ]
    with pytest.raises(spmd.ConfigError, match="list of fnmatch patterns"):
        spmd.MixedPrecision(param_dtype=BF16, cast_forward_inputs_at="layers.*")
    assert spmd.MixedPrecision(cast_forward_inputs_at=["a"]).cast_forward_inputs_at == ("a",)

    def step(model, x):
        return model(x)

    # cos/sin into each Llama layer cast to bf16 by default ...
    x = models.batches("llama", 1)[0][0]
    gm = spmd.compile(parallel_mode=_mode(param_dtype=BF16))(step).lower(model, x)["traced"]
    casts = [n for n in gm.graph.nodes if n.meta.get(CAST_OF) == INPUT_CAST]
    assert sorted((n.meta["spmd_module"], n.args[0].name) for n in casts) == [
        ("layers.0", "cos"),
        ("layers.0", "sin"),
        ("layers.1", "cos"),
        ("layers.1", "sin"),
    ]
    # ... and output_dtype casts what the cast modules (here the root only) return.
    mlp = models.build("mlp")
    mode = _mode(param_dtype=BF16, output_dtype=torch.float32, cast_forward_inputs_at=[])
    gm = spmd.compile(parallel_mode=mode)(step).lower(mlp, models.batches("mlp", 1)[0][0])["traced"]
    casts = [n for n in gm.graph.nodes if n.meta.get(CAST_OF) == INPUT_CAST]
    assert [(n.meta["spmd_module"], n.meta["val"].dtype) for n in casts] == [
        ("", BF16),  # x into the root
        ("", torch.float32),  # the root's output
    ]
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert out is casts[-1]
