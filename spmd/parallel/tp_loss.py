"""The chunked loss head on a vocabulary-split head, inside the tensor-parallel expansion.

When :mod:`spmd.parallel.expand_graph` meets ``spmd::linear_cross_entropy`` (the chunked head,
:mod:`passes.chunked_loss`) whose head weight is split on the vocabulary over the tensor-parallel
mesh, it calls :func:`vocab_parallel_head` instead of gathering the weight: the two chunked
passes of :mod:`passes.vocab_parallel_loss` with three all-reduces of per-row statistics between
them, as functional collectives in the graph. The head's gradient stays split; the input's
gradient is a partial sum over the tp ranks, reduced where a consumer needs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from passes import collectives as C
from passes import torch_compat
from passes.linear_cross_entropy import REDUCTION_MEAN
from passes.vocab_parallel_loss import VP_LCE_GRADS, VP_LSE_STATS


def applies(mesh: DeviceMesh, args: tuple[Any, ...]) -> bool:
    """Whether the head weight (``args[1]``) is split on its rows (the vocabulary) over a 1-D mesh."""
    w = args[1]
    return mesh.ndim == 1 and isinstance(w, DTensor) and tuple(w.placements) == (Shard(0),)


def vocab_parallel_head(mesh: DeviceMesh, args: tuple[Any, ...], wrap: Any) -> tuple[Any, ...]:
    """``linear_cross_entropy``'s four outputs (loss, total weight, grad_x, grad_weight) as
    DTensors on ``mesh``, computed on this rank's slice of the vocabulary. ``wrap(local,
    placements, like)`` makes a DTensor without recording an op."""
    x, weight, target, grad_loss, chunk, reduction, ignore_index, logits_dtype = args
    rep = (Replicate(),)

    def local(t: Any) -> Any:
        if not isinstance(t, DTensor):
            return t
        return torch_compat.local_tensor(t.redistribute(mesh, rep) if tuple(t.placements) != rep else t)

    xl, tl, gl, wl = local(x), local(target), local(grad_loss), torch_compat.local_tensor(weight)
    group = mesh.get_group(0).group_name
    start = Shard.local_shard_size_and_offset(weight.shape[0], mesh.size(0), mesh.get_local_rank(0))[1]
    row_max, sumexp, t_logit = VP_LSE_STATS(xl, wl, tl, chunk, start, ignore_index, logits_dtype)

    def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        return C.WAIT(C._c10d.all_reduce.default(t, op, group))

    top = all_reduce(row_max, "max")
    total = all_reduce(sumexp * torch.exp(row_max - top), "sum")
    t_logit = all_reduce(t_logit, "sum")
    lse = top + torch.log(total)
    keep = tl != ignore_index
    ld = logits_dtype or xl.dtype
    total_weight = keep.sum().to(ld)
    loss = torch.where(keep, lse - t_logit, torch.zeros_like(lse)).sum()
    scale = gl.float() * keep.float()
    if reduction == REDUCTION_MEAN:
        loss = loss / total_weight.float()
        scale = scale / total_weight.float()
    grad_x, grad_w = VP_LCE_GRADS(xl, wl, tl, lse, scale, chunk, start, logits_dtype)
    return (
        wrap(loss.to(ld), rep, loss),
        wrap(total_weight, rep, total_weight),
        wrap(grad_x, (Partial(),), x),
        wrap(grad_w, (Shard(0),), weight),
    )
