"""Sharding rules DTensor lacks, for the ops a traced train step contains.

torch's own op strategies cover the forward and backward of the usual layers and the
fused Adam/AdamW kernels. What is missing on torch 2.13 and registered here:

* ``aten._fused_sgd_`` (both overloads): elementwise over its tensor lists, like
  ``_fused_adam_`` (DTensor's list-pointwise strategy).
* ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: the CPU
  kernel of ``F.scaled_dot_product_attention``; batch (dim 0) or heads (dim 1) sharded
  alike on every input and output, or all replicated (the CUDA flash kernel's rule
  without its RNG and sequence-length outputs).

``spmd::tag_grad`` needs no rule: the expansion handles it itself
(:mod:`spmd.parallel.expand`).
"""

from __future__ import annotations

import torch

_done = False


def register() -> None:
    """Register the rules once (idempotent)."""
    global _done
    if _done:
        return
    _done = True
