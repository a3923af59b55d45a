"""passes.chunked_loss (and the op it plants, passes.linear_cross_entropy): the loss head as
one node that runs over chunks of tokens.

    x --mm(x, t(W))--> logits [N, V] --(cast)--> _log_softmax --> nll_loss_forward --> loss
    grad_loss --> nll_loss_backward --> _log_softmax_backward_data --(cast)--> mm, t/mm --> grad_x, grad_W

becomes, at the loss's backward,

    x, W, target, full([], 1.0) --> spmd::linear_cross_entropy --> loss, total_weight, grad_x, grad_W

so no [N, V] tensor is left in the graph. One chunk runs the replaced ops: the same bits.
Several chunks change the summation order of the loss and of grad_W only: compared with the
unchunked step within TOL (below). Steps run at world size 1 without an optimizer, so the
gradients themselves are compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd
from passes.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from spmd import models as M
from tests.unit.fake_pg import fake_process_group

# Several chunks vs the unchunked head, float32: the loss is a sum of per-chunk sums and grad_W
# a sum of per-chunk products instead of one sum each. Each reordering moves a result by a few
# ulps of the largest partial sum; torch.testing's float32 defaults (rtol 1.3e-6, atol 1e-5)
# hold these sums of <= 32 terms. docs/loss-head.md states the same tolerance.
TOL = {"rtol": 1.3e-6, "atol": 1e-5}
# The HF models' vocabulary: a size no other dim of theirs has, so a [..., vocab] tensor is a logit's.
HF_VOCAB = 80


def _gpt(vocab: int = 64, seq: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return M.GPT(M.GPTConfig(vocab=vocab, seq=seq, d_model=32, n_layers=1, n_heads=4))


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=HF_VOCAB,
            max_position_embeddings=32,
            attn_implementation="eager",
        )
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=HF_VOCAB, n_positions=32, attn_implementation="eager"
    )
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return transformers.GPT2LMHeadModel(cfg)


def gpt_step(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    loss.backward()
    return loss


def hf_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """HF's own loss: labels shifted by padding with -100 (ignored), logits upcast."""
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss


def _batch(name: str, vocab: int = 64, seq: int = 16, rows: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        return torch.randint(0, vocab, (rows, seq), generator=g), torch.randint(
            0, vocab, (rows, seq), generator=g
        )
    return (torch.randint(0, HF_VOCAB, (2, 8), generator=g),)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., torch.Tensor]]] = {
    "gpt": (_gpt, gpt_step),
    "hf_llama": (lambda: _hf("llama"), hf_step),
    "hf_gpt2": (lambda: _hf("gpt2"), hf_step),
}


def _run(name: str, **options: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor], spmd.CompiledStep]:
    build, fn = MODELS[name]
    model = build()
    step = spmd.compile(check_invariants=True, **options)(fn)
    loss = step(model, *_batch(name))
    return loss, {n: p.grad for n, p in model.named_parameters()}, step


def _heads(step: spmd.CompiledStep) -> list[torch.fx.Node]:
    return [n for n in step.graphs["final"].graph.nodes if n.target is LINEAR_CROSS_ENTROPY]


def _logits_sized(step: spmd.CompiledStep, tokens: int, vocab: int) -> list[str]:
    """Nodes of the final graph holding a [..., vocab] tensor of tokens x vocab elements
    (the logits, their log-softmax, their gradient; tokens != d_model, so not the head weight)."""
    out = []
    for n in step.graphs["final"].graph.nodes:
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, list | tuple) else [vals]
        if any(
            isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] == vocab and v.numel() == tokens * vocab
            for v in vals
        ):
            out.append(n.name)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_chunks_match_the_unchunked_head(name: str) -> None:
    """Off: the traced head stays (logits-sized tensors in the graph), as with "auto" under the
    threshold. One chunk: the same bits.
    Chunks of 5 tokens (uneven): within TOL, and no logits-sized tensor left."""
    tokens, vocab = (48, 64) if name == "gpt" else (16, HF_VOCAB)  # GPT: more tokens than d_model
    loss0, grads0, off = _run(name, chunked_loss=False)
    assert not _heads(off) and "chunk_loss_heads" not in off.graphs
    assert _logits_sized(off, tokens, vocab)
    if name == "gpt":  # "auto" (the default), under the size threshold: the same graph as off
        assert _run(name)[2].graphs["final"].code == off.graphs["final"].code
    if name != "hf_gpt2":  # one chunk: bit for bit (GPT: tied head; Llama: untied, -100 labels)
        loss1, grads1, one = _run(name, chunked_loss=tokens)
        assert len(_heads(one)) == 1
        assert torch.equal(loss1, loss0)
        for k, g in grads0.items():
            assert torch.equal(grads1[k], g), k
    loss5, grads5, five = _run(name, chunked_loss=5)
    (head,) = _heads(five)
    assert head.args[4] == 5 and not _logits_sized(five, tokens, vocab)
    assert five.report().loss_heads == [
        f"loss head: {tokens} tokens x vocab {vocab}, {-(-tokens // 5)} chunk(s) of 5"
    ]
    torch.testing.assert_close(loss5, loss0, **TOL)
    for k, g in grads0.items():
        torch.testing.assert_close(grads5[k], g, **TOL, msg=lambda m, k=k: f"{k}: {m}")


def test_peak_drops_by_logits_buffers() -> None:
    """A head whose logits dominate (GPT, 192 tokens x vocab 4096, fp32: 3 MiB a buffer; its
    weight and gradient 512 KiB each): the unchunked step's peak, at the head, holds two logits
    buffers (eager already reuses the logits' buffer for the log-softmax and the gradient's for
    its own backward); the chunked one holds chunk buffers (its declared workspace, counted)
    and grad_W. The predicted peak drops by at least 1.5 logits buffers."""
    vocab, rows, seq = 4096, 12, 16
    tokens, logits_bytes = rows * seq, rows * seq * vocab * 4
    peaks = {}
    for option in (False, 8):
        step = spmd.compile(chunked_loss=option)(gpt_step)
        step(_gpt(vocab=vocab), *_batch("gpt", vocab=vocab, rows=rows))
        peaks[option] = step.report().peak_memory_bytes
        if option:
            (head,) = _heads(step)
            assert head.meta["spmd_workspace_bytes"] == 2 * 8 * vocab * 4
            assert not _logits_sized(step, tokens, vocab)
        else:
            assert len(_logits_sized(step, tokens, vocab)) >= 2
    assert peaks[8] <= peaks[False] - 1.5 * logits_bytes, peaks


def test_fully_shard_gathers_and_mixed_precision() -> None:
    """Under fully_shard (fake group, 2 ranks): the head rewritten before the partitioner keeps
    the all-gather count with reshard_after_forward (the head's weight is gathered for the
    backward node, its gradient tagged and reduce-scattered). With bf16 parameters HF's upcast
    (logits.float()) and its backward cast are recognised: the node computes log-softmax in
    float32."""
    from passes import collectives as C

    mp = spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    counts = {}
    for option in (False, 4):
        model = _hf("llama")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

        def step(model, opt, ids):
            loss = hf_step(model, ids)
            opt.step()
            opt.zero_grad()
            return loss

        mode = spmd.DataParallel("fully_shard", mixed_precision=mp)
        # Every parameter resharded (the whole model is one unit here, which would otherwise stay
        # gathered into backward, passes.last_unit): the count compares the head's gathers.
        compiled = spmd.compile(
            parallel_mode=mode,
            chunked_loss=option,
            check_invariants=True,
            disabled_passes=["keep_last_unit_gathered"],
        )(step)
        with fake_process_group(2):
            compiled.lower(model, opt, *_batch("hf_llama"))
        final = compiled.graphs["final"].graph
        kinds = [C.kind_of(c).value for c in C.collectives(final)]
        counts[option] = (kinds.count("all_gather"), kinds.count("reduce_scatter"))
        if option:
            (head,) = _heads(compiled)
            assert head.args[-1] == torch.float32 and head.args[1].meta["val"].dtype == torch.bfloat16
            assert not _logits_sized(compiled, 16, HF_VOCAB)
    assert counts[4] == counts[False], counts


def test_accumulation_moves_the_loss_readers() -> None:
    """Two micro-batches, each ``(loss / 2).backward()``: both heads are rewritten; the division
    (a forward reader of the loss) moves after the node and ``ones_like`` becomes ``full``;
    gradients within TOL of the unchunked step."""

    def accum(model, idx, tgt):
        total = 0
        for i in range(2):
            loss = gpt_step_no_backward(model, idx[i::2], tgt[i::2]) / 2
            loss.backward()
            total = total + loss.detach()
        return total

    grads = {}
    for option in (False, 5):
        model = _gpt()
        step = spmd.compile(chunked_loss=option, check_invariants=True)(accum)
        idx, tgt = _batch("gpt")
        idx, tgt = torch.cat([idx, idx.flip(0)]), torch.cat([tgt, tgt.flip(0)])  # 6 rows, 3 per micro-batch
        loss = step(model, idx, tgt)
        grads[option] = (loss, {n: p.grad for n, p in model.named_parameters()})
        if option:
            assert len(_heads(step)) == 2
            code = step.graphs["chunk_loss_heads"].code
            assert "ones_like" not in code and "aten.full.default" in code
    torch.testing.assert_close(grads[5][0], grads[False][0], **TOL)
    for k, g in grads[False][1].items():
        torch.testing.assert_close(grads[5][1][k], g, **TOL)


def test_in_place_aux_loss_moves_with_the_loss(caplog: pytest.LogCaptureFixture) -> None:
    """``loss += coef * aux`` (Hugging Face's MoE causal LMs add the router's aux loss so) writes
    the loss in place before backward: it moves after the node with the loss's other readers,
    and the head is rewritten (gradients within TOL of the unchunked step). An in-place write of
    the loss into a value made before the head (a running total) still leaves the head alone."""

    def aux_in_place(model, idx, tgt):
        loss = gpt_step_no_backward(model, idx, tgt)
        loss += 0.01 * sum(p.square().sum() for p in model.parameters())
        loss.backward()
        return loss

    def into_a_total(model, idx, tgt):
        total = torch.zeros(())
        loss = gpt_step_no_backward(model, idx, tgt)
        total.add_(loss)
        loss.backward()
        return total

    grads = {}
    for option in (False, 5):
        model = _gpt()
        step = spmd.compile(chunked_loss=option, check_invariants=True)(aux_in_place)
        loss = step(model, *_batch("gpt"))
        grads[option] = (loss, {n: p.grad for n, p in model.named_parameters()})
        assert len(_heads(step)) == (1 if option else 0)
    torch.testing.assert_close(grads[5][0], grads[False][0], **TOL)
    for k, g in grads[False][1].items():
        torch.testing.assert_close(grads[5][1][k], g, **TOL, msg=lambda m, k=k: f"{k}: {m}")
    caplog.set_level("INFO", logger="spmd")
    step = spmd.compile(chunked_loss=True)(into_a_total)
    step(_gpt(), *_batch("gpt"))
    assert not _heads(step) and "writes in place to another value" in caplog.text


def gpt_step_no_backward(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def test_left_alone_when_the_logits_are_returned_or_the_gradient_reads_the_loss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A step that returns the logits needs them whole; a loss whose gradient depends on its
    value (``loss ** 2``) cannot move to backward. Forced on, both are left as traced, and
    the log says why."""

    def returns_logits(model, idx, tgt):
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        loss.backward()
        return loss, logits

    def squared(model, idx, tgt):
        loss = gpt_step_no_backward(model, idx, tgt)
        (loss * loss).backward()
        return loss

    caplog.set_level("INFO", logger="spmd")
    for fn, why in (
        (returns_logits, "the logits are read elsewhere"),
        (squared, "depends on the loss value"),
    ):
        step = spmd.compile(chunked_loss=True)(fn)
        step(_gpt(), *_batch("gpt"))
        assert not _heads(step) and "chunk_loss_heads" not in step.graphs
        assert why in caplog.text


@pytest.mark.parametrize("bad", [0, -3, "yes", 2.5, None])
def test_bad_option_names_the_fix(bad: object) -> None:
    with pytest.raises(spmd.ConfigError, match="chunked_loss=.*positive int"):
        spmd.compile(chunked_loss=bad)(gpt_step)


def test_forced_on_needs_data_parallel() -> None:
    with pytest.raises(spmd.ConfigError, match="needs a DataParallel mode"):
        spmd.compile(parallel_mode=spmd.DTensorExpandMode(), chunked_loss=True)(gpt_step)


def test_chunks_on_an_accelerator_are_large_enough_to_hide_rereading_the_head() -> None:
    """Liger's rule gives the 8B head (8,192 tokens, vocab 128,256, d 4,096) 256-row chunks: on an
    H100 those made the step 21% slower than the whole logits (each chunk re-reads the 1 GB head
    and reads and writes its gradient); an accelerator's chunks have at least
    ACCELERATOR_MIN_ROWS rows, a CPU's keep the rule (and never more rows than tokens: one chunk)."""
    from passes.linear_cross_entropy import ACCELERATOR_MIN_ROWS, default_chunk

    assert default_chunk(8192, 128256, 4096) == 256
    assert default_chunk(8192, 128256, 4096, accelerator=True) == ACCELERATOR_MIN_ROWS
    assert default_chunk(262144, 128256, 4096, accelerator=True) == 8192


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_head_weight_s_device_picks_the_rule(device: str) -> None:
    """The pass takes the accelerator's floor when the head's weight is on one (here a fake CUDA
    tensor standing in for it: the traced graph is the same on any device)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from passes.chunked_loss import chunk_loss_heads, find_loss_heads
    from passes.linear_cross_entropy import ACCELERATOR_MIN_ROWS

    _, _, off = _run(next(iter(MODELS)), chunked_loss=False)
    gm = off.graphs["traced"]  # what the pass rewrites
    (head,), _ = find_loss_heads(gm)
    w = head.weight.meta["val"]
    head.weight.meta["val"] = FakeTensor(
        w.fake_mode, torch.empty(w.shape, device="meta"), torch.device(device)
    )
    gm = chunk_loss_heads(gm, min_logits_bytes=0)
    (node,) = [n for n in gm.graph.nodes if n.target is LINEAR_CROSS_ENTROPY]
    assert node.args[4] == (ACCELERATOR_MIN_ROWS if device == "cuda" else 128)


def test_bf16_head_weight_grad_accumulates_in_fp32() -> None:
    """Under bf16 parameters the chunked op's weight gradient (a sum over 64 chunks) is summed in
    float32 and rounded once, as the unchunked ``mm`` rounds it: within one bf16 ulp of the
    unchunked head's (the float32 sums differ only in order). Summed in bf16, every chunk's
    partial sum was rounded: most elements differed, by up to hundreds of ulps."""
    from passes.linear_cross_entropy import _one_chunk, linear_cross_entropy

    torch.manual_seed(0)
    n, d, v = 1024, 64, 96
    x, w = torch.randn(n, d).bfloat16(), (torch.randn(v, d) * 0.1).bfloat16()
    target, grad_loss = torch.randint(0, v, (n,)), torch.tensor(1.0)
    ref = _one_chunk(x, w, target, grad_loss, 1, -100, torch.float32)[3]
    got = linear_cross_entropy(x, w, target, grad_loss, 16, 1, -100, torch.float32)[3]
    assert got.dtype == torch.bfloat16
    assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()
