"""CTC losses in a traced step (``F.ctc_loss``, ``nn.CTCLoss``, Hugging Face's ``*ForCTC``).

``F.ctc_loss`` with tensor lengths runs ``aten._ctc_loss.Tensor``, which returns the per-sample
loss and ``log_alpha``, the forward variables its backward reads, shaped
``(batch, T, 2 * max(target_lengths) + 1)``: a shape that depends on the lengths' *values*.
torch has no fake kernel for it (the op is tagged ``dynamic_output_shape``), so the trace
stopped there.

A graph needs fixed shapes, and the targets' shape bounds that width: ``targets.size(1)`` for
padded targets ``(batch, S)``, ``targets.numel()`` for concatenated ones. So spmd traces the
pair with fake rules of that bounded shape (:func:`fake_ctc_loss`, :func:`fake_ctc_loss_backward`,
used by :class:`spmd.frontend.kernel_layouts.KernelLayoutFakeMode`), and after the trace points
the two nodes at ``spmd::ctc_loss`` / ``spmd::ctc_loss_backward`` (:func:`fixed_shape_ctc`):
these run torch's own CPU/CUDA kernels and pad ``log_alpha`` to the bound with ``-inf`` (the
backward reads it back through a view of the real width). The loss and gradients are torch's
kernels' bit for bit; the graph's ``log_alpha`` takes ``2 * bound + 1`` instead of
``2 * max(target_lengths) + 1`` floats per step and sample.

Not covered: the cuDNN CTC kernel (``aten._cudnn_ctc_loss``, which eager picks on CUDA for
int32 targets on the CPU with ``blank=0`` and every input of full length) keeps its refusal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten


def _bound(targets: torch.Tensor) -> int:
    """The longest target the targets' shape allows."""
    return int(targets.shape[1]) if targets.dim() == 2 else int(targets.numel())


@torch.library.custom_op("spmd::ctc_loss", mutates_args=())
def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
    zero_infinity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._ctc_loss.Tensor`` with ``log_alpha`` padded with ``-inf`` to the targets' bound."""
    nll, alpha = aten._ctc_loss.Tensor(
        log_probs, targets, input_lengths, target_lengths, blank, zero_infinity
    )
    width = 2 * _bound(targets) + 1
    padded = alpha.new_full((alpha.shape[0], alpha.shape[1], width), float("-inf"))
    padded[:, :, : alpha.shape[2]].copy_(alpha)
    return nll, padded


@ctc_loss.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):  # type: ignore[no-untyped-def]
    return fake_ctc_loss(log_probs, targets)


@torch.library.custom_op("spmd::ctc_loss_backward", mutates_args=())
def ctc_loss_backward(
    grad: torch.Tensor,
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    neg_log_likelihood: torch.Tensor,
    log_alpha: torch.Tensor,
    blank: int,
    zero_infinity: bool = False,
) -> torch.Tensor:
    """``aten._ctc_loss_backward.Tensor`` on the real width of :func:`ctc_loss`'s ``log_alpha``."""
    width = 2 * int(target_lengths.max()) + 1 if target_lengths.numel() else 1
    alpha = log_alpha[:, :, :width].contiguous()
    return aten._ctc_loss_backward.Tensor(
        grad,
        log_probs,
        targets,
        input_lengths,
        target_lengths,
        neg_log_likelihood,
        alpha,
        blank,
        zero_infinity,
    )


@ctc_loss_backward.register_fake
def _(grad, log_probs, *rest):  # type: ignore[no-untyped-def]
    return fake_ctc_loss_backward(log_probs)


def fake_ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake outputs of the CTC forward (run under a fake mode): the loss per sample and the
    bounded ``log_alpha``."""
    t, batch = log_probs.shape[0], log_probs.shape[1]
    nll = log_probs.new_empty((batch,))
    alpha = log_probs.new_empty((batch, t, 2 * _bound(targets) + 1))
    return nll, alpha


def fake_ctc_loss_backward(log_probs: torch.Tensor) -> torch.Tensor:
    """Fake gradient of the CTC backward: ``log_probs``' shape, contiguous (the kernels' layout)."""
    return log_probs.new_empty(log_probs.shape)


_REPLACEMENTS = {
    aten._ctc_loss.Tensor: torch.ops.spmd.ctc_loss.default,
    aten._ctc_loss_backward.Tensor: torch.ops.spmd.ctc_loss_backward.default,
}


def fixed_shape_ctc(graph: fx.Graph) -> int:
    """Point the traced ``aten._ctc_loss.Tensor`` / ``_ctc_loss_backward.Tensor`` nodes at their
    fixed-shape stand-ins (same arguments, the shapes the trace's fake rules gave). Returns how
    many nodes changed; a no-op without CTC."""
    changed = 0
    for node in graph.nodes:
        new: Any = _REPLACEMENTS.get(node.target)  # type: ignore[call-overload]
        if node.op == "call_function" and new is not None:
            node.target = new
            changed += 1
    return changed


__all__ = ["fake_ctc_loss", "fake_ctc_loss_backward", "fixed_shape_ctc"]
