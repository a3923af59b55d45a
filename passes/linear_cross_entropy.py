"""``spmd::linear_cross_entropy``: a loss head's output projection, cross-entropy and both
gradients, over chunks of tokens, so the [tokens, vocab] logits never exist at once.

``linear_cross_entropy(x, weight, target, grad_loss, chunk, reduction, ignore_index,
logits_dtype) -> (loss, total_weight, grad_x, grad_weight)`` computes, for ``x`` [N, D] and
``weight`` [V, D] (the head, as ``nn.Linear`` stores it):

* ``loss, total_weight``: ``nll_loss_forward(log_softmax(x @ weight.T), target, None,
  reduction, ignore_index)`` (the logits cast to ``logits_dtype`` first when it is given:
  Hugging Face models upcast them);
* ``grad_x, grad_weight``: the gradients of ``grad_loss * loss`` with respect to ``x`` and
  ``weight``, as autograd's ``nll_loss_backward`` -> ``_log_softmax_backward_data`` -> two
  ``mm`` compute them.

It runs ``chunk`` rows of ``x`` at a time: each chunk's logits, log-softmax, loss sum and
gradient rows are made and dropped before the next chunk's, ``grad_x`` rows are written in
place, and ``grad_weight`` is accumulated (``addmm_``). Loss and gradients come out of one
pass, so nothing is recomputed: the rewrite (:mod:`passes.chunked_loss`) puts the node in
backward, where ``grad_loss`` is known (as Liger-Kernel's ``FusedLinearCrossEntropy`` computes
the gradients together with the loss). With one chunk (``chunk >= N``) it runs exactly the ops
of the unchunked graph, so the result is the same bits.

Numerics with several chunks: each row's logits, log-probabilities and gradient row are
computed by the same kernels on fewer rows; the loss is a sum of per-chunk sums (in float32)
instead of one sum, and ``grad_weight`` a sum of per-chunk products instead of one product
(in float32 under 16-bit weights, rounded once at the end as ``mm`` rounds it: a float32
[V, D] buffer for the op's duration), so results differ in summation order only (see
docs/loss-head.md for the tolerance).

Why one custom op and not the chunk loop as ATen nodes: the graph keeps one node whatever
the chunk count (a Llama 8B step would otherwise grow by ~15 nodes per chunk, forward and
backward), the kernel can free each chunk's buffers as soon as it is done, and inductor runs
it as a fallback kernel. The price: a memory estimate cannot see its temporaries, so the
rewrite records them on the node (``passes.meta.WORKSPACE``, :func:`workspace_bytes`).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

aten = torch.ops.aten

# nll_loss's reduction codes (at::Reduction): none is not handled (the loss is per token).
REDUCTION_MEAN = 1
REDUCTION_SUM = 2


@torch.library.custom_op("spmd::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor,
    chunk: int,
    reduction: int,
    ignore_index: int,
    logits_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    if chunk >= n:
        return _one_chunk(x, weight, target, grad_loss, reduction, ignore_index, logits_dtype)
    ld = logits_dtype or x.dtype
    # nll_loss's total_weight without class weights: the count of kept targets, in the
    # log-probabilities' dtype. Counting first gives every chunk the global divisor (mean).
    total_weight = (target != ignore_index).sum().to(ld)
    loss_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    # Under 16-bit parameters grad_weight is a sum over chunks: accumulated in float32 and rounded
    # once at the end, as the unchunked ``mm`` (whose kernel accumulates in float32) rounds it.
    # Summed in the weight's dtype instead, every chunk's partial sum was rounded (a bias growing
    # with the number of chunks). Costs a float32 [V, D] buffer for the op's duration.
    acc_dtype = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
    grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        xc, tc = x[start:end], target[start:end]
        logits = torch.mm(xc, weight.t())
        if logits_dtype is not None:
            logits = aten._to_copy.default(logits, dtype=logits_dtype)
        lp = aten._log_softmax.default(logits, 1, False)
        del logits
        part, _ = aten.nll_loss_forward.default(lp, tc, None, REDUCTION_SUM, ignore_index)
        loss_sum += part.float()
        g = aten.nll_loss_backward.default(grad_loss, lp, tc, None, reduction, ignore_index, total_weight)
        # In place: the out= kernel is the functional one (passes/reuse.py tests it aliased).
        g = aten._log_softmax_backward_data.out(g, lp, 1, ld, out=g)
        del lp
        if g.dtype != x.dtype:
            g = aten._to_copy.default(g, dtype=x.dtype)
        torch.mm(g, weight, out=grad_x[start:end])
        if acc_dtype == g.dtype:
            grad_weight.addmm_(g.t(), xc)
        else:  # products of 16-bit values are exact in float32
            grad_weight.addmm_(g.t().to(acc_dtype), xc.to(acc_dtype))
        del g
    if reduction == REDUCTION_MEAN:
        loss_sum = loss_sum / total_weight.float()
    return loss_sum.to(ld), total_weight, grad_x, grad_weight.to(weight.dtype)


def _one_chunk(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    grad_loss: torch.Tensor,
    reduction: int,
    ignore_index: int,
    logits_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unchunked graph's ops, in its order: the same bits."""
    logits = torch.mm(x, weight.t())
    if logits_dtype is not None:
        logits = aten._to_copy.default(logits, dtype=logits_dtype)
    lp = aten._log_softmax.default(logits, 1, False)
    del logits
    loss, total_weight = aten.nll_loss_forward.default(lp, target, None, reduction, ignore_index)
    g = aten.nll_loss_backward.default(grad_loss, lp, target, None, reduction, ignore_index, total_weight)
    g = aten._log_softmax_backward_data.default(g, lp, 1, lp.dtype)
    del lp
    if g.dtype != x.dtype:
        g = aten._to_copy.default(g, dtype=x.dtype)
    grad_weight = torch.mm(g.t(), x)
    grad_x = torch.mm(g, weight)
    return loss, total_weight, grad_x, grad_weight


@linear_cross_entropy.register_fake
def _(x, weight, target, grad_loss, chunk, reduction, ignore_index, logits_dtype):  # noqa: ANN001
    ld = logits_dtype or x.dtype
    loss = x.new_empty((), dtype=ld)
    return loss, x.new_empty((), dtype=ld), torch.empty_like(x), torch.empty_like(weight)


LINEAR_CROSS_ENTROPY = torch.ops.spmd.linear_cross_entropy.default


@register_flop_formula(torch.ops.spmd.linear_cross_entropy)
def _flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001, ANN003
    """The op's three matmuls, whatever the chunking: the logits ``x @ weight.T``,
    ``grad_x = g @ weight`` and ``grad_weight = g.T @ x``, ``2 N D V`` each (torch's ``mm``
    formula), so ``FlopCounterMode`` and ``passes.cost_model`` count the loss head's FLOPs
    (without it the head's forward and backward matmuls, 6 N D V, counted as none and the cost
    model priced the op by its bytes). The log-softmax and the loss are not counted, as torch
    counts no elementwise op."""
    n, d = x_shape
    return 6 * n * d * w_shape[0]


def workspace_bytes(n: int, vocab: int, chunk: int, logits_dtype: torch.dtype) -> int:
    """Most bytes the kernel holds at once besides its inputs and outputs: two chunk-sized
    [chunk, vocab] buffers in the log-probabilities' dtype (the logits and their log-softmax,
    then the log-softmax and its gradient; a cast copy replaces one of them), plus the unchunked
    path's mm output when it casts. A memory estimate adds it while the node runs."""
    rows = min(chunk, n)
    item = torch.empty((), dtype=logits_dtype).element_size()
    return 2 * rows * vocab * item


# Fewest rows per chunk on an accelerator. Each chunk's matmuls read the whole head W [V, D] and
# the gradient accumulation reads and writes grad_W: a chunk of r rows does 2 r V D FLOPs per
# matmul against V D (or 2 V D) elements moved, so it is bound by memory until r passes the
# device's FLOPs-per-element ridge (an H100 in bf16: ~295 FLOP/byte, so ~600 rows for the
# accumulation). Measured on an H100 (benchmarks/results/gpu.md; 2 blocks of the Llama 3.1 8B's shapes, 8,192
# tokens): 256-row chunks +21% step time over the whole logits, 1,024 +2%, 2,048 +0.6%.
ACCELERATOR_MIN_ROWS = 2048


def default_chunk(n: int, vocab: int, d_model: int, *, accelerator: bool = False) -> int:
    """Tokens per chunk: Liger-Kernel's rule (``FusedLinearCrossEntropy``:
    ``chunk_size = next_power_of_2(ceil(BT / ceil(V / H)))``), so a chunk's logits are about
    the size of the head's input ``x``, with a floor of 128 rows on a CPU (smaller matmuls waste
    the matrix units; the bench GPT, vocab 8192 x d 256, would otherwise run 32-row chunks) and
    of ``ACCELERATOR_MIN_ROWS`` on an accelerator (where smaller chunks are bound by re-reading
    the head)."""
    n_chunks = -(-vocab // max(d_model, 1))
    rows = -(-n // n_chunks)
    pow2 = 1 << max(rows - 1, 0).bit_length()
    return max(ACCELERATOR_MIN_ROWS if accelerator else 128, pow2)
