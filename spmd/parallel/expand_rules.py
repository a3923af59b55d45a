"""Sharding rules DTensor lacks, for the ops a traced train step contains.

torch's own op strategies cover the forward and backward of the usual layers and the
fused Adam/AdamW kernels. What is missing on torch 2.13 and registered here:

* ``aten._fused_sgd_`` (both overloads): elementwise over its tensor lists, like
  ``_fused_adam_`` (DTensor's list-pointwise strategy).
* ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward: the CPU
  kernel of ``F.scaled_dot_product_attention``; batch (dim 0) or heads (dim 1) sharded
  alike on every input and output, or all replicated (the CUDA flash kernel's rule
  without its RNG and sequence-length outputs). An ``attn_mask`` (Hugging Face's
  ``attn_implementation="sdpa"`` passes an explicit ``[B, 1, S, S]`` one) follows q on the
  dimension it broadcasts against: sharded where its size there is q's, replicated where
  it is 1 (or the mask has fewer dimensions). No strategy shards the sequence: DTensor
  gathers a sequence-sharded q first.

Registration goes through DTensor's private helpers (``_ops.utils.register_op_strategy``,
``expand_to_full_mesh_op_strategy``, the pointwise registrar); this module is the one
place that uses them. ``spmd::tag_grad`` needs no rule: the expansion handles it itself
(:mod:`spmd.parallel.expand`).
"""

from __future__ import annotations

from collections.abc import Sequence

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


def _attention_strategies(
    n_out: int, n_in: int, q_shape: Sequence[int], mask_shape: Sequence[int] | None
) -> list[list[Placement | None]]:
    """All replicated, or every tensor sharded on batch (dim 0), or on heads (dim 1).

    ``mask_shape``: the ``attn_mask`` kwarg's shape (its strategy comes after the positional
    inputs), or None without one. The mask broadcasts against the scores ``[B, H, S_q, S_kv]``
    from the right, so q's dim ``d`` is the mask's dim ``d - (q.ndim - mask.ndim)``; a size-1
    (or missing) dim there is the same for every shard: the mask stays replicated.
    """
    out = []
    for p in (Replicate(), Shard(0), Shard(1)):
        row: list[Placement | None] = [p] * (n_out + n_in)
        if mask_shape is not None:
            row.append(_mask_placement(p, q_shape, mask_shape))
        out.append(row)
    return out


def _mask_placement(p: Placement, q_shape: Sequence[int], mask_shape: Sequence[int]) -> Placement:
    if not isinstance(p, Shard):
        return p
    dim = p.dim - (len(q_shape) - len(mask_shape))
    if dim < 0 or mask_shape[dim] == 1:
        return Replicate()
    return Shard(dim)


def register() -> None:
    """Register the rules once (idempotent)."""
    global _done
    if _done:
        return
    _done = True
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo, StrategyType
    from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

    for op in RULES[:2]:
        _register_single_dim_pointwise(op)

    def _shapes(op_schema: OpSchema, q: int) -> tuple[Sequence[int], Sequence[int] | None]:
        mask = op_schema.kwargs_schema.get("attn_mask")
        q_strategy = op_schema.args_schema[q]
        assert isinstance(q_strategy, OpStrategy)
        return q_strategy.shape, mask.shape if isinstance(mask, OpStrategy) else None

    @register_op_strategy(RULES[2], schema_info=RuntimeSchemaInfo(3))
    def _flash_cpu(op_schema: OpSchema) -> StrategyType:
        mesh = op_schema.get_mesh_from_args()
        strategies = _attention_strategies(2, 3, *_shapes(op_schema, 0))
        return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=2)

    @register_op_strategy(RULES[3], schema_info=RuntimeSchemaInfo(6))
    def _flash_cpu_backward(op_schema: OpSchema) -> StrategyType:
        mesh = op_schema.get_mesh_from_args()
        strategies = _attention_strategies(3, 6, *_shapes(op_schema, 1))
        return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)
