"""Ready-made tensor-parallel plans, in torchtitan's form (module patterns to parallel styles).

Each function returns a fresh dict for ``DataParallel(..., tp_plan=...)``; edit it freely.
The plans are Megatron's layout, as torchtitan writes it for Llama: the first projection of
attention (q, k, v) and of the MLP (gate, up) column-parallel, the second (o, down)
row-parallel, the token embedding and the head split on the vocabulary.
"""

from __future__ import annotations

from typing import Any


def _styles() -> tuple[Any, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def llama(
    *, prefix: str = "model.", head: str = "lm_head", mlp: bool = True, sequence_parallel: bool = False
) -> dict[str, Any]:
    """Hugging Face Llama-family naming (Llama, Mistral, Qwen2/Qwen3, Mixtral's attention):
    ``{prefix}layers.*.self_attn.{q,k,v,o}_proj``, ``{prefix}layers.*.mlp.{gate,up,down}_proj``,
    ``{prefix}embed_tokens`` and ``lm_head``. Grouped-query attention shards the key/value heads
    like the query heads (``num_key_value_heads`` should be a multiple of the tp size; otherwise
    DTensor redistributes around attention, correct but with more communication). ``mlp=False``
    leaves the MLP out (a mixture of experts such as Mixtral's: its experts and router replicate
    over tp). ``sequence_parallel=True`` is torchtitan's sequence parallelism: the norms and the
    residual stream between the tensor-parallel regions split on the sequence (``Shard(1)``), the
    row-parallel outputs reduce-scattered into it and the column-parallel inputs all-gathered
    from it, so activations outside attention and the MLP take 1/tp of the memory.
    """
    col, row = _styles()
    if sequence_parallel:
        return _llama_sp(prefix, head, mlp)
    plan = {
        f"{prefix}embed_tokens": row(),  # vocabulary-parallel embedding
        f"{prefix}layers.*.self_attn.q_proj": col(),
        f"{prefix}layers.*.self_attn.k_proj": col(),
        f"{prefix}layers.*.self_attn.v_proj": col(),
        f"{prefix}layers.*.self_attn.o_proj": row(),
        head: col(),  # vocabulary-parallel head
    }
    if mlp:
        plan[f"{prefix}layers.*.mlp.gate_proj"] = col()
        plan[f"{prefix}layers.*.mlp.up_proj"] = col()
        plan[f"{prefix}layers.*.mlp.down_proj"] = row()
    return plan


def gpt() -> dict[str, Any]:
    """spmd's built-in GPT (:mod:`spmd.models`): ``blocks.*.qkv`` and ``blocks.*.fc``
    column-parallel, ``blocks.*.proj`` and ``blocks.*.out`` row-parallel, the token embedding
    (tied to the head) on the vocabulary. ``qkv`` is one fused projection whose rows are q, k, v
    in turn: an even split of it does not give each rank whole heads, so DTensor redistributes
    its output around attention (correct; more communication than separate q, k, v)."""
    col, row = _styles()
    return {
        "tok": row(),
        "blocks.*.qkv": col(),
        "blocks.*.fc": col(),
        "blocks.*.proj": row(),
        "blocks.*.out": row(),
    }


def _llama_sp(prefix: str, head: str, mlp: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    col, row = _styles()
    layer = f"{prefix}layers.*"
    plan = {
        f"{prefix}embed_tokens": row(input_layouts=Replicate(), output_layouts=Shard(1)),
        f"{prefix}norm": SequenceParallel(),
        head: col(input_layouts=Shard(1), output_layouts=Shard(-1)),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.self_attn.q_proj": col(),
        f"{layer}.self_attn.k_proj": col(),
        f"{layer}.self_attn.v_proj": col(),
        f"{layer}.self_attn.o_proj": row(output_layouts=Shard(1)),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
    }
    if mlp:
        plan[f"{layer}.mlp.gate_proj"] = col()
        plan[f"{layer}.mlp.up_proj"] = col()
        plan[f"{layer}.mlp.down_proj"] = row(output_layouts=Shard(1))
    return plan


def without_sequence_parallel(plan: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``plan`` without sequence parallelism: its ``SequenceParallel`` entries dropped,
    ``RowwiseParallel``/``ColwiseParallel`` back to their default layouts (row-parallel outputs
    all-reduced, the values between the regions replicated). Turns it off in an automatic choice
    (``tp_plan=tp_plans.without_sequence_parallel(spmd.tp_plan_of(model))``) or in
    ``llama(sequence_parallel=True)``; other entries are kept as they are."""
    from torch.distributed.tensor.parallel import SequenceParallel

    col, row = _styles()
    out: dict[str, Any] = {}
    for key, value in plan.items():
        if isinstance(value, SequenceParallel):
            continue
        out[key] = row() if isinstance(value, row) else col() if isinstance(value, col) else value
    return out
