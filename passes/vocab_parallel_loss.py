"""The chunked loss head (:mod:`passes.linear_cross_entropy`) on a head split on the vocabulary.

Under tensor parallelism each rank holds rows ``[start, start + V_local)`` of the head ``W``
[V, D] and the whole head input ``x`` [N, D]. The loss needs every row's log-sum-exp over the
whole vocabulary, so the head runs in two chunked passes with three small all-reduces of [N]
vectors between them (emitted by the caller, in the graph):

1. :func:`vp_lse_stats` -- per row, over this rank's vocabulary slice: the largest logit, the sum
   of ``exp(logit - largest)`` and the target's logit (0 where another rank owns the target);
2. the caller all-reduces: ``M = max(largest)``, ``S = sum(sumexp * exp(largest - M))``,
   ``T = sum(target logit)``; then ``lse = M + log(S)`` and the loss is the mean (or sum) of
   ``lse - T`` over the kept rows;
3. :func:`vp_lce_grads` -- per chunk again, ``g = softmax - onehot`` on this rank's slice, times
   ``grad_loss`` (over the kept count for a mean): ``grad_x`` is this rank's partial sum
   ``g @ W_local`` (the caller all-reduces it, or leaves it partial), ``grad_W_local = g.T @ x``.

No rank holds more than a chunk's [rows, V_local] logits; the logits are computed twice (once per
pass), a sixth more head FLOPs than the single-pass op's three matmuls. Numerics: the log-sum-exp
is combined from per-rank maxima, so values equal one device's up to float rounding.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

REDUCTION_MEAN = 1


@torch.library.custom_op("spmd::vp_lse_stats", mutates_args=())
def vp_lse_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    chunk: int,
    vocab_start: int,
    ignore_index: int,
    logits_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v_local = x.shape[0], weight.shape[0]
    row_max = torch.empty(n, dtype=torch.float32, device=x.device)
    row_sumexp = torch.empty(n, dtype=torch.float32, device=x.device)
    target_logit = torch.zeros(n, dtype=torch.float32, device=x.device)
    for start in range(0, n, max(chunk, 1)):
        end = min(start + chunk, n)
        logits = torch.mm(x[start:end], weight.t())
        if logits_dtype is not None:
            logits = logits.to(logits_dtype)
        m = logits.max(dim=1).values
        row_max[start:end] = m.float()
        row_sumexp[start:end] = torch.exp(logits - m[:, None]).sum(dim=1).float()
        local = target[start:end] - vocab_start
        mine = (local >= 0) & (local < v_local) & (target[start:end] != ignore_index)
        picked = logits.gather(1, local.clamp(0, v_local - 1)[:, None]).squeeze(1).float()
        target_logit[start:end] = torch.where(mine, picked, torch.zeros_like(picked))
    return row_max, row_sumexp, target_logit


@vp_lse_stats.register_fake
def _(x, weight, target, chunk, vocab_start, ignore_index, logits_dtype):  # noqa: ANN001
    n = x.shape[0]
    return tuple(x.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("spmd::vp_lce_grads", mutates_args=())
def vp_lce_grads(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    row_scale: torch.Tensor,
    chunk: int,
    vocab_start: int,
    logits_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_scale`` [N]: each row's ``d loss / d (its lse - target logit)`` (0 for ignored rows)."""
    n, v_local = x.shape[0], weight.shape[0]
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, n, max(chunk, 1)):
        end = min(start + chunk, n)
        xc = x[start:end]
        logits = torch.mm(xc, weight.t())
        if logits_dtype is not None:
            logits = logits.to(logits_dtype)
        g = torch.exp(logits.float() - lse[start:end, None])
        local = target[start:end] - vocab_start
        mine = (local >= 0) & (local < v_local)
        rows = torch.arange(end - start, device=x.device)
        g[rows[mine], local[mine]] -= 1.0
        g *= row_scale[start:end, None]
        torch.mm(g.to(x.dtype), weight, out=grad_x[start:end])
        grad_w.addmm_(g.t(), xc.float())
    return grad_x, grad_w.to(weight.dtype)


@vp_lce_grads.register_fake
def _(x, weight, target, lse, row_scale, chunk, vocab_start, logits_dtype):  # noqa: ANN001
    return torch.empty_like(x), torch.empty_like(weight)


VP_LSE_STATS = torch.ops.spmd.vp_lse_stats.default
VP_LCE_GRADS = torch.ops.spmd.vp_lce_grads.default


@register_flop_formula(torch.ops.spmd.vp_lse_stats)
def _stats_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001, ANN003
    n, d = x_shape
    return 2 * n * d * w_shape[0]  # the logits


@register_flop_formula(torch.ops.spmd.vp_lce_grads)
def _grads_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001, ANN003
    n, d = x_shape
    return 6 * n * d * w_shape[0]  # the logits again, grad_x and grad_W
