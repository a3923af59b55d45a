"""passes.reuse: ops write their result into an input that dies there, bit for bit.

The loss of a language model, hand-built (every tensor 6x1000 float32 unless said)::

    logits = mm(x, w)                       # x: 6x32, w: 32x1000 (placeholders)
    ls     = _log_softmax(logits, 1)        # logits dies here  -> _log_softmax.out(out=logits)
    g      = neg(ls)                        # ls lives on
    gin    = _log_softmax_backward_data(g, ls, 1)   # both die here -> .out(out=g)
    return sum(gin)

Three logits-sized buffers live at once before the pass (ls, g, gin), two after.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from passes.invariants import InvariantViolation, check_invariants
from passes.memory import estimate_peak_memory
from passes.meta import Phase
from passes.reuse import REUSABLE, REUSED, reuse_dead_buffers
from tests.unit.passes.graphs import Builder, aten, inputs_for

ROWS, VOCAB = 6, 1000
LOGITS = ROWS * VOCAB * 4  # bytes of one logits-sized buffer


# ----------------------------------------------------------------------------- the kernels


_SOFTMAX = (
    aten._log_softmax.default,
    aten._softmax.default,
    aten._log_softmax_backward_data.default,
    aten._softmax_backward_data.default,
)


def _args(
    op: torch._ops.OpOverload, shape: tuple[int, ...], g: torch.Generator, strided: bool, dim: int
) -> list:
    """Random arguments of ``op`` with tensors of ``shape`` (the non-reused ones transposed copies
    when ``strided``: same values, non-contiguous); ``dim`` is the softmax dimension."""

    def t() -> torch.Tensor:
        x = torch.randn(shape, generator=g) * 4
        if strided and x.dim() >= 2:
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, column-major
        return x

    if op in (aten._log_softmax.default, aten._softmax.default):
        return [t(), dim, False]
    if op is aten._log_softmax_backward_data.default:
        return [t(), aten._log_softmax(t(), dim, False), dim, torch.float32]
    if op is aten._softmax_backward_data.default:
        return [t(), aten._softmax(t(), dim, False), dim, torch.float32]
    if op is aten.gelu_backward.default:
        return [t(), t()]
    return [t(), t()]  # add.Tensor, mul.Tensor


SHAPES = [(8, 128, 513), (3, 7, 13), (5, 1), (1, 257), (17,), (2, 3, 1000)]


@pytest.mark.parametrize("op", list(REUSABLE), ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_out_variant_into_an_input_is_bit_identical(op: torch._ops.OpOverload, threads: int) -> None:
    """For every table entry and every argument it may take: ``op.out(..., out=that argument)`` gives
    the functional op's bits, on odd sizes, along every softmax dimension, with the other tensor
    arguments non-contiguous."""
    out_op, positions = REUSABLE[op]
    out_name = next(a.name for a in out_op._schema.arguments if a.kwarg_only and a.alias_info)
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in SHAPES:
            for strided, dim in itertools.product((False, True), range(len(shape) if op in _SOFTMAX else 1)):
                args = _args(op, shape, g, strided, dim)
                for pos in positions:
                    call = [a.contiguous() if i == pos else a for i, a in enumerate(args)]
                    ref = op(*call)
                    buf = call[pos].clone()
                    call[pos] = buf
                    got = out_op(*call, **{out_name: buf})
                    assert got.data_ptr() == buf.data_ptr()
                    assert torch.equal(ref, got), (op, shape, strided, dim, pos)
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- the pass


def _loss_graph(keep_logits: bool = False, keep_g: bool = False) -> tuple[torch.fx.GraphModule, dict]:
    """The graph of the module docstring, and its nodes by the docstring's names."""
    b = Builder()
    x, w = b.input("x", ROWS, 32), b.input("w", 32, VOCAB)
    logits = b.op(aten.mm.default, x, w)
    ls = b.op(aten._log_softmax.default, logits, 1, False)
    b.phase = Phase.BACKWARD
    g = b.op(aten.neg.default, ls)
    gin = b.op(aten._log_softmax_backward_data.default, g, ls, 1, torch.float32)
    outs = [b.op(aten.sum.default, gin)]
    if keep_logits:
        outs.append(b.op(aten.sum.default, logits))
    if keep_g:
        outs.append(b.op(aten.sum.default, g))
    return b.finish(*outs), {"logits": logits, "ls": ls, "g": g, "gin": gin}


def _run(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(gm(*[t.clone() for t in inputs]))


def test_loss_writes_into_dead_logits_and_grad() -> None:
    """Both softmax ops take a dying input's buffer; the peak drops by one logits buffer; same bits."""
    gm, n = _loss_graph()
    inputs = inputs_for(gm)
    want = _run(gm, inputs)
    before = estimate_peak_memory(gm)
    out = reuse_dead_buffers(gm)
    after = estimate_peak_memory(out)
    reused = {n.target: n.meta[REUSED] for n in out.graph.nodes if REUSED in n.meta}
    assert reused == {
        aten._log_softmax.out: n["logits"].name,
        aten._log_softmax_backward_data.out: n["g"].name,
    }
    assert before.peak_bytes - after.peak_bytes == LOGITS
    check_invariants(out)
    got = _run(out, inputs)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_input_read_later_is_not_taken() -> None:
    """logits and g are read after the softmax ops: _log_softmax allocates; gin takes ls, its other
    dying input, instead of g."""
    gm, n = _loss_graph(keep_logits=True, keep_g=True)
    reuse_dead_buffers(gm)
    reused = {node.name: node.meta[REUSED] for node in gm.graph.nodes if REUSED in node.meta}
    assert reused == {n["gin"].name: n["ls"].name}
    check_invariants(gm)


def test_placeholders_views_of_other_shape_and_transposes_are_not_taken() -> None:
    """add(x, y) of two placeholders; add(t(a), b) where t(a) is a transposed fresh buffer; nothing taken."""
    b = Builder()
    x, y = b.input("x", 4, 6), b.input("y", 4, 6)
    s = b.op(aten.add.Tensor, x, y)  # placeholders: never taken
    a = b.op(aten.neg.default, b.op(aten.t.default, s))  # 6x4 fresh
    at = b.op(aten.t.default, a)  # 4x6 view, column-major: not contiguous
    out = b.op(aten.mul.Tensor, at, x)
    gm = b.finish(out)
    assert reuse_dead_buffers(gm) is gm


def test_a_later_reader_of_the_taken_buffer_breaks_the_invariant() -> None:
    """A pass that, after the rewrite, adds a read of the old logits after _log_softmax.out is caught."""
    gm, n = _loss_graph()
    gm = reuse_dead_buffers(gm)
    graph = gm.graph
    logits = n["logits"]
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        late = graph.call_function(aten.sum.default, (logits,))
    late.meta = dict(logits.meta)
    late.meta["val"] = torch.empty((), device="meta")
    out.args = ((*out.args[0], late),)
    gm.recompile()
    with pytest.raises(InvariantViolation) as err:
        check_invariants(gm)
    assert "reused-buffer" in err.value.rules


# ----------------------------------------------------------------------------- a whole step


def test_compiled_step_peak_drops_with_same_bits() -> None:
    """A logits-heavy TinyGPT step (vocab 2048) at world size 1: the pass is in the eager pipeline,
    lowers the predicted peak by at least one logits-sized buffer, and the parameters after two AdamW
    steps are bit for bit those of the same step with the pass disabled. (The peak moves to a
    neighbouring node where a few bytes more are live, so the drop is a little under one buffer.)"""
    import spmd
    from tests.models import TinyGPT

    vocab, batch, seq = 2048, 4, 16

    def train_step(model, optim, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(vocab, (batch, seq), generator=g), torch.randint(vocab, (batch, seq), generator=g)
    results = {}
    for disabled in ((), ("reuse_dead_buffers",)):
        torch.manual_seed(0)
        model = TinyGPT(vocab=vocab, seq=seq)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        step = spmd.compile(disabled_passes=disabled, check_invariants=True)(train_step)
        losses = [step(model, optim, x, y) for _ in range(2)]
        results[disabled] = (losses, [p.detach().clone() for p in model.parameters()], step)
    (l1, p1, s1), (l0, p0, s0) = results[()], results[("reuse_dead_buffers",)]
    assert "reuse_dead_buffers" in s1.graphs and "reuse_dead_buffers" not in s0.graphs
    assert all(torch.equal(a, b) for a, b in zip(l1, l0, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(p1, p0, strict=True))
    assert s0.report().peak_memory_bytes - s1.report().peak_memory_bytes >= 0.99 * batch * seq * vocab * 4
