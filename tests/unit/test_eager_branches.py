"""Model code that asks eager's questions gets eager's answers (issue #36): "am I compiling?"
is false outside ``optimizer.step()``; a refusal names the real cause; a tensor captured from
outside the step is named. World size 1, against eager bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd


def _fused_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def _assert_same(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{what}: {name}"


class AsksIfCompiling(nn.Module):
    """Takes another branch when compiling, as Hugging Face's Mamba does (its scan)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.answers: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        answers = (torch.compiler.is_compiling(), torch._dynamo.is_compiling())
        self.answers.append(answers)
        h = self.lin(x)
        return h * 2 if any(answers) else h


def _step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_forward_sees_eagers_is_compiling() -> None:
    """Forward (and so backward) is traced with ``is_compiling()`` false, as eager runs it; the
    optimizer still traces (fused AdamW). Before: the forward took the compiling branch."""
    torch.manual_seed(0)
    model = AsksIfCompiling()
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)
    compiled = spmd.compile()(_step)
    x = torch.randn(3, 4)
    for i in range(2):
        assert torch.equal(compiled(model, opt, x), _step(ref, ref_opt, x)), f"call {i}"
    assert model.answers == [(False, False)]  # one trace, eager's answers
    _assert_same(model, ref, "after 2 calls")


def test_hf_mamba_default_is_bit_for_bit() -> None:
    """HF's Mamba (defaults: ``use_associative_scan=True``) scans with ``associative_scan`` when
    compiling and with a loop in eager. Before: 2.6e-7 off eager after 3 steps of this tiny one."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    )
    model = transformers.MambaForCausalLM(config)
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)

    def step(model, opt, ids):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    compiled = spmd.compile()(step)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        assert torch.equal(compiled(model, opt, ids), step(ref, ref_opt, ids)), f"call {i}"
    _assert_same(model, ref, "after 3 calls")


def test_hf_non_moe_refusal_gives_no_experts_advice() -> None:
    """DeBERTa-v2's sequence classifier with ``problem_type=None`` selects labels with
    ``(labels >= 0).nonzero()``: rightly refused, but transformers sets
    ``config._experts_implementation == "eager"`` on every model, and the message used to advise
    ``experts_implementation='grouped_mm'``. The MoE case keeps it
    (``test_foreign_models.py::test_hf_moe_eager_experts_refused_with_the_fix``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3,
    )  # fmt: skip
    model = transformers.DebertaV2ForSequenceClassification(config)
    assert model.config.problem_type is None and model.config._experts_implementation == "eager"
    opt = _fused_adamw(model)

    def step(model, opt, ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ids, labels = torch.randint(0, 64, (2, 6)), torch.tensor([[0], [2]])
    with pytest.raises(spmd.UntraceableOpError) as info:
        spmd.compile()(step)(model, opt, ids, labels)
    msg = str(info.value)
    assert "nonzero" in msg and "modeling_deberta_v2.py:" in msg and "fixed shapes" in msg, msg
    assert "expert" not in msg, msg


_GLOBAL_MASK = torch.ones(4)


class PlainAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.full((4,), 2.0)  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_captured_tensors_are_refused_by_name() -> None:
    """A tensor read from a global, a closure or a module's plain attribute is refused naming it
    and the fixes. Before: a TraceError wrapping fake mode's "Please convert all Tensors to
    FakeTensors" assertion."""
    closure_mask = torch.ones(4)

    def global_step(model, opt, x):
        loss = (model(x) * _GLOBAL_MASK).sum()
        loss.backward()
        opt.step()
        return loss

    def closure_step(model, opt, x):
        loss = (model(x) * closure_mask).sum()
        loss.backward()
        opt.step()
        return loss

    cases = [
        (nn.Linear(4, 4), global_step, "`_GLOBAL_MASK` (a global of test_eager_branches.py)"),
        (nn.Linear(4, 4), closure_step, "`closure_mask` (a closure variable)"),
        (PlainAttribute(), _step, "`self.scale` (a plain tensor attribute of module 'PlainAttribute'"),
    ]
    for model, fn, named in cases:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(spmd.CapturedTensorError) as info:
            spmd.compile()(fn)(model, opt, torch.randn(2, 4))
        msg = str(info.value)
        assert named in msg and "as an argument" in msg and "register_buffer" in msg, msg
        assert "test_eager_branches.py:" in msg, msg


class CTCHead(nn.Module):
    def __init__(self, classes: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).log_softmax(-1)


def ctc_step(model, opt, x, targets, input_lengths, target_lengths):
    loss = torch.nn.functional.ctc_loss(model(x), targets, input_lengths, target_lengths, zero_infinity=True)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def ctc_batch(g: torch.Generator, t: int = 12, b: int = 3, s: int = 5, classes: int = 6) -> tuple:
    """Padded targets ``(b, s)``, lengths that differ per sample and per call."""
    x = torch.randn(t, b, 4, generator=g)
    targets = torch.randint(1, classes, (b, s), generator=g)
    input_lengths = torch.randint(2 * s, t + 1, (b,), generator=g)
    target_lengths = torch.randint(1, s + 1, (b,), generator=g)
    return x, targets, input_lengths, target_lengths


def test_ctc_loss_is_bit_for_bit() -> None:
    """``F.ctc_loss`` with tensor lengths traces (spmd.frontend.ctc: bounded fake shapes, torch's
    kernels at run time) and equals eager bit for bit over calls with other lengths, in one graph.
    Before: refused, ``aten._ctc_loss.Tensor`` has no fake kernel."""
    torch.manual_seed(0)
    model = CTCHead()
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)
    compiled = spmd.compile()(ctc_step)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        batch = ctc_batch(g)
        assert torch.equal(compiled(model, opt, *batch), ctc_step(ref, ref_opt, *batch)), f"call {i}"
    _assert_same(model, ref, "after 3 calls")
    assert compiled.num_graphs == 1
    assert "spmd.ctc_loss_backward" in compiled.graphs["final"].code


class ChecksItsData(nn.Module):
    """Two Python branches on the batch: a check that raises, and a branch both of whose sides go on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if y.max() >= 5:  # marker: check
            raise ValueError("label out of range")
        h = self.lin(x)
        if mask.any():  # marker: branch
            h = h * 2
        return torch.nn.functional.cross_entropy(h, y)


def data_step(model, opt, x, y, mask):
    loss = model(x, y, mask)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def data_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(3, 4, generator=g),
        torch.randint(0, 5, (3,), generator=g),
        torch.tensor([False, True, False]),
    )


def test_branches_on_data_take_eagers_side_and_are_checked() -> None:
    """Traced on the side the first call's values take (bit for bit with eager, one graph); a
    later batch that would take the other side raises DataCheckError naming the line, before the
    step changes anything. Before: refused as DataDependentControlFlowError."""
    import inspect

    torch.manual_seed(0)
    model = ChecksItsData()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    compiled = spmd.compile()(data_step)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        batch = data_batch(g)
        assert torch.equal(compiled(model, opt, *batch), data_step(ref, ref_opt, *batch)), f"call {i}"
    _assert_same(model, ref, "after 3 calls")
    assert compiled.num_graphs == 1
    source, first = inspect.getsourcelines(ChecksItsData.forward)
    lines = {m: first + i for i, s in enumerate(source) for m in ("check", "branch") if f"marker: {m}" in s}
    x, y, mask = data_batch(g)
    for bad, marker in [
        ((x, torch.tensor([0, 5, 1]), mask), "check"),
        ((x, y, torch.zeros(3, dtype=torch.bool)), "branch"),
    ]:
        with pytest.raises(spmd.DataCheckError) as info:
            compiled(model, opt, *bad)
        assert f"test_eager_branches.py:{lines[marker]}" in str(info.value), str(info.value)
        _assert_same(model, ref, f"after the refused {marker} batch")


def tiny_wav2vec2_ctc() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, apply_spec_augment=False, layerdrop=0.0, pad_token_id=0,
        ctc_zero_infinity=True,
    )  # fmt: skip
    return transformers.Wav2Vec2ForCTC(config)


def wav2vec2_step(model, opt, x, labels):
    loss = model(input_values=x, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def wav2vec2_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded labels (-100), another number of them per sample and per call."""
    x, labels = torch.randn(2, 400, generator=g), torch.randint(1, 12, (2, 6), generator=g)
    labels[0, int(torch.randint(2, 6, (), generator=g)) :] = -100
    return x, labels


def test_hf_wav2vec2_ctc_is_bit_for_bit_and_checks_labels() -> None:
    """HF Wav2Vec2ForCTC with labels: its ``if labels.max() >= vocab_size: raise`` becomes a check
    and its CTC loss traces (the ForCTC shim keeps the targets 2-D): bit for bit with eager over
    calls with other label lengths (dropout on); a label out of range raises DataCheckError.
    Before: refused (DataDependentControlFlowError at that line)."""
    model = tiny_wav2vec2_ctc()
    ref = copy.deepcopy(model)
    opt, ref_opt = _fused_adamw(model), _fused_adamw(ref)
    compiled = spmd.compile()(wav2vec2_step)
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        batch = wav2vec2_batch(g)
        torch.manual_seed(10 + i)
        got = compiled(model, opt, *batch)
        torch.manual_seed(10 + i)
        assert torch.equal(got, wav2vec2_step(ref, ref_opt, *batch)), f"call {i}"
    _assert_same(model, ref, "after 3 calls")
    assert compiled.num_graphs == 1
    x, labels = wav2vec2_batch(g)
    labels[1, 0] = 12
    with pytest.raises(
        spmd.DataCheckError, match=r"modeling_wav2vec2.py:\d+ \('if labels is not None and labels.max"
    ):
        compiled(model, opt, x, labels)
