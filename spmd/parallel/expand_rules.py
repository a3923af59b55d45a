"""Sharding rules DTensor lacks, for the ops a traced train step contains.

torch's own op strategies cover the forward and backward of the usual layers and the
fused Adam/AdamW kernels. What is missing on torch 2.13 and registered here:

* ``aten._fused_sgd_`` (both overloads): elementwise over its tensor lists, like
  ``_fused_adam_`` (DTensor's list-pointwise strategy).
* ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: the CPU
  kernel of ``F.scaled_dot_product_attention``; batch (dim 0) or heads (dim 1) sharded
  alike on every input and output, or all replicated (the CUDA flash kernel's rule
  without its RNG and sequence-length outputs).

Registration goes through DTensor's private helpers (``_ops.utils.register_op_strategy``,
``expand_to_full_mesh_op_strategy``, the pointwise registrar); this module is the one
place that uses them. ``spmd::tag_grad`` needs no rule: the expansion handles it itself
(:mod:`spmd.parallel.expand`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

aten = torch.ops.aten
_done = False

# The ops registered here, for the README and the tests.
RULES = (
    aten._fused_sgd_.default,
    aten._fused_sgd_.tensor_lr,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)


def _attention_strategies(n_out: int, n_in: int) -> list[list[Placement | None]]:
    """All replicated, or every tensor sharded on batch (dim 0), or on heads (dim 1)."""
    return [[p] * (n_out + n_in) for p in (Replicate(), Shard(0), Shard(1))]


def register() -> None:
    """Register the rules once (idempotent)."""
    global _done
    if _done:
        return
    _done = True
    from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo, StrategyType
    from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

    for op in RULES[:2]:
        _register_single_dim_pointwise(op)

    def _mask_free(op_schema: OpSchema, what: str) -> None:
        if op_schema.kwargs_schema.get("attn_mask") is not None:
            raise NotImplementedError(
                f"{what} with an attn_mask has no sharding rule; pass is_causal instead"
            )

    @register_op_strategy(RULES[2], schema_info=RuntimeSchemaInfo(3))
    def _flash_cpu(op_schema: OpSchema) -> StrategyType:
        _mask_free(op_schema, "CPU flash attention")
        mesh = op_schema.get_mesh_from_args()
        return expand_to_full_mesh_op_strategy(mesh, op_schema, _attention_strategies(2, 3), input_index=2)

    @register_op_strategy(RULES[3], schema_info=RuntimeSchemaInfo(6))
    def _flash_cpu_backward(op_schema: OpSchema) -> StrategyType:
        _mask_free(op_schema, "CPU flash attention backward")
        mesh = op_schema.get_mesh_from_args()
        return expand_to_full_mesh_op_strategy(mesh, op_schema, _attention_strategies(3, 6), input_index=3)
