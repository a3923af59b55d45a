"""Models we did not write, at world size 1, against eager bit for bit: ``torch.nn.Transformer``
always; tiny Hugging Face ``transformers`` models (built from configs, no download) when the
package is installed (skipped otherwise). Our own test models share our blind spots: these
caught config attributes read in forward (``self.config.num_hidden_layers``) running a stale
graph, and a returned ``DynamicCache`` carrying the trace's fake tensors."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import spmd


def _fused_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _assert_same(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{what}: {name}"
        assert (p.grad is None) == (q.grad is None), f"{what}: {name}.grad"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{what}: {name}.grad"


def test_nn_transformer_with_dropout_and_accumulation() -> None:
    """Seq-first nn.Transformer with dropout: steps with zero_grad, then calls without it
    (gradients accumulate across calls, as eager), then eval()."""

    def step(model, opt, src, tgt):
        loss = model(src, tgt).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def no_zero(model, opt, src, tgt):
        loss = model(src, tgt).square().mean()
        loss.backward()
        opt.step()
        return loss

    torch.manual_seed(0)
    model = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.1)
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)
    compiled = {f: spmd.compile()(f) for f in (step, no_zero)}
    g = torch.Generator().manual_seed(1)
    for i, fn in enumerate([step, step, no_zero, no_zero, step]):
        if i == 4:
            model.eval()
            ref.eval()
        src, tgt = torch.randn(5, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
        torch.manual_seed(10 + i)
        got = compiled[fn](model, opt, src, tgt)
        torch.manual_seed(10 + i)
        assert torch.equal(got, fn(ref, ref_opt, src, tgt)), f"call {i}"
        _assert_same(model, ref, f"call {i}")


def _tiny_llama(attn: str = "eager") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(config)


def test_hf_config_change_retraces() -> None:
    """HF reads ``self.config.X`` in forward; a change after compile must not run the old graph."""
    model = _tiny_llama()

    def fwd(model, ids):
        return model(input_ids=ids, use_cache=False).logits

    step = spmd.compile()(fwd)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(step(model, ids), fwd(model, ids))
        model.config.num_hidden_layers = 1  # LlamaModel: self.layers[: config.num_hidden_layers]
        assert torch.equal(step(model, ids), fwd(model, ids))
        model.config._attn_implementation = "sdpa"
        assert torch.equal(step(model, ids), fwd(model, ids))
    assert step.num_graphs == 3


def test_hf_llama_accumulation_and_cache_output() -> None:
    """Calls without zero_grad accumulate as eager; returning the whole output (with its
    DynamicCache) is refused with what to do."""
    model = _tiny_llama()
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)

    def no_zero(model, opt, ids):
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        return out.loss

    step = spmd.compile()(no_zero)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        assert torch.equal(step(model, opt, ids), no_zero(ref, ref_opt, ids)), f"call {i}"
        _assert_same(model, ref, f"call {i}")

    def whole(model, ids):
        return model(input_ids=ids, use_cache=True)

    with pytest.raises(spmd.TraceError, match="DynamicCache at output.*use_cache=False"), torch.no_grad():
        spmd.compile()(whole)(model, ids)


def _tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # same numbers on both backends
    return transformers.GPT2LMHeadModel(config)


# GPT-2 builds the same cache (51 s here): with the full sweep only (SPMD_SWEEP_FULL=1).
_CACHE_MODELS = {"llama": _tiny_llama, **({"gpt2": _tiny_gpt2} if os.environ.get("SPMD_SWEEP_FULL") else {})}


@pytest.mark.parametrize("build", list(_CACHE_MODELS.values()), ids=list(_CACHE_MODELS))
def test_hf_default_use_cache_under_inductor(build, tmp_path, monkeypatch) -> None:
    """HF models called with the default ``use_cache=True`` lower with inductor (their
    ``DynamicCache`` concatenates onto a legacy empty tensor, which spmd.backend.lowering drops) and
    match the eager backend within the inductor tolerance (test_lowering.TOL) after each step."""
    from tests.unit.test_lowering import TOL

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    model = build()
    ref = copy.deepcopy(model)

    def sgd(m: nn.Module) -> torch.optim.Optimizer:  # not Adam: it amplifies rounding on ~0 gradients
        return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, fused=True)

    opt, ref_opt = sgd(model), sgd(ref)

    def step(model, opt, ids):
        loss = model(input_ids=ids, labels=ids).loss  # use_cache left at its default, True
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ind, eag = spmd.compile(backend="inductor")(step), spmd.compile()(step)
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        torch.testing.assert_close(ind(model, opt, ids), eag(ref, ref_opt, ids), **TOL)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=n, i=i: f"step {i}, {n}: {m}")
    assert "aten.cat.default([lift_fresh_copy" in ind.graphs["final"].code  # the final graph keeps it


def _hf_classifier(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "vit":
        config = transformers.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
            num_attention_heads=2, intermediate_size=64, num_labels=4,
        )  # fmt: skip
        return transformers.ViTForImageClassification(config), (4, 3, 8, 8)
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=4,
    )  # fmt: skip
    return transformers.ResNetForImageClassification(config), (4, 3, 16, 16)


@pytest.mark.parametrize("name", ["vit", "resnet"])
def test_hf_classifier_compiles_once(name: str) -> None:
    """HF classifiers set ``config.problem_type`` in their first forward: the guard takes the
    value the first call left, so the second call reuses the graph (one compile)."""

    def step(model, opt, x, y):
        loss = model(pixel_values=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    model, shape = _hf_classifier(name)
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)
    compiled = spmd.compile()(step)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        x, y = torch.randn(*shape, generator=g), torch.randint(0, 4, (shape[0],), generator=g)
        assert torch.equal(compiled(model, opt, x, y), step(ref, ref_opt, x, y)), f"call {i}"
    _assert_same(model, ref, "after 3 calls")
    assert model.config.problem_type == "single_label_classification"
    assert compiled.num_graphs == 1


def _lm_step(model, opt, ids, labels, *mask):
    kw = {"attention_mask": mask[0]} if mask else {}
    loss = model(input_ids=ids, labels=labels, use_cache=False, **kw).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize(
    ("name", "padded"), [("llama", False), ("qwen2", False), ("mistral", False), ("llama", True)]
)
def test_hf_sdpa_takes_eagers_attention_path(name: str, padded: bool) -> None:
    """HF's default attention (sdpa), a training step without cache: eager calls SDPA with
    ``is_causal=True`` and no mask, so must the compiled step (bit for bit with eager); a padded
    ``attention_mask`` still takes the mask path."""
    from tests import sweep_models as S

    pytest.importorskip("transformers")
    model = S.hf_sdpa_causal_lm(name)
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)
    compiled = spmd.compile()(_lm_step)
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        ids = torch.randint(1, 64, (4, 8), generator=g)
        batch: tuple[torch.Tensor, ...] = (ids, ids.clone())
        if padded:
            mask = torch.ones(4, 8, dtype=torch.long)
            mask[0, 5:] = 0
            batch += (mask,)
        assert torch.equal(compiled(model, opt, *batch), _lm_step(ref, ref_opt, *batch)), f"call {i}"
    _assert_same(model, ref, "after 2 calls")
    calls = S.sdpa_calls(compiled.graphs["traced"])
    assert len(calls) == 2, calls
    for call in calls:
        if padded:
            assert call.get("attn_mask") is not None and not call.get("is_causal"), call
        else:
            assert call.get("attn_mask") is None and call.get("is_causal") is True, call


def test_hf_moe_eager_experts_refused_with_the_fix() -> None:
    """A Hugging Face MoE in the ``"eager"`` experts implementation routes with ``nonzero`` (shapes
    that depend on the routing): refused naming the op, the experts module, the modeling file's line
    and the fix; after that fix (``set_experts_implementation("grouped_mm")``, HF's default) the same
    model trains bit for bit with eager."""
    from tests import sweep_models as S

    pytest.importorskip("transformers")
    case = S.build("hf_mixtral")
    model = case.model
    model.set_experts_implementation("eager")
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)
    compiled = spmd.compile()(_lm_step)
    g = torch.Generator().manual_seed(1)
    ids, labels = case.batch(g)
    with pytest.raises(spmd.UntraceableOpError) as info:
        compiled(model, opt, ids, labels)
    msg = str(info.value)
    assert "nonzero" in msg and "'model.layers.0.mlp.experts'" in msg, msg
    assert "modeling_mixtral.py:" in msg and "experts_implementation='grouped_mm'" in msg, msg
    for m in (model, ref):
        m.set_experts_implementation("grouped_mm")
    for i in range(2):
        ids, labels = case.batch(g)
        torch.manual_seed(10 + i)  # the router's jitter and attention dropout
        got = compiled(model, opt, ids, labels)
        torch.manual_seed(10 + i)
        assert torch.equal(got, _lm_step(ref, ref_opt, ids, labels)), f"call {i}"
    _assert_same(model, ref, "after 2 calls")


def test_hf_whisper_spec_augment_refused() -> None:
    """Whisper draws its SpecAugment masks with numpy in training: compiled, one draw would be
    replayed at every step (measured before the check: the loss left eager's from the second
    step). Refused, naming the numpy call, the module and Hugging Face's line."""
    from tests import sweep_models as S

    pytest.importorskip("transformers")
    case = S.build("hf_whisper")
    model = case.model
    model.config.apply_spec_augment, model.config.mask_time_prob = True, 0.5
    opt = _fused_adamw(model)

    def step(model, opt, x, labels):
        loss = model(input_features=x, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(spmd.HostRandomError) as info:
        spmd.compile()(step)(model, opt, *case.batch(torch.Generator().manual_seed(0)))
    msg = str(info.value)
    assert "numpy.random.rand()" in msg and "modeling_whisper.py:" in msg and "in module 'model'" in msg, msg
    assert "apply_spec_augment=False" in msg, msg
