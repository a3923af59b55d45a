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
  it is 1 (or the mask has fewer dimensions). DTensor never redistributes a keyword
  argument, so the expansion places the mask first (:func:`attn_mask_placements`, from
  q's placements) and the rule takes it as it is. A sequence-sharded q with a mask is
  refused (no strategy shards the sequence).
* ``aten.new_empty`` and ``aten.new_empty_strided``: DTensor's rule lets the new tensor follow
  its input's placements only where the shapes are equal, else it replicates. Here it also
  follows a sharded input where every dimension the input is sharded on keeps its size (the
  memory is uninitialised: what is written into it decides its values). DeepSeek-V2's MLA
  builds its keys so: ``kv.new_empty(B, H, S, nope + rope)`` from a ``[B, H, S, nope + v]``
  tensor sharded on heads, then copies the heads' parts into slices; replicated, the copy
  gathered the heads.

Computed by the expansion itself (:func:`strided_call`, where a parameter splits strided), not by
a DTensor strategy (whose local op would run with the global sizes): ``split``,
``split_with_sizes``, ``slice``, ``cat`` and ``slice_backward`` along a dimension split
*strided* over one mesh dimension
(``_StridedShard(d, split_factor=k)``: the dimension is k equal groups and each rank holds its
1/n of every group, e.g. a fused qkv projection's output, each rank its share of q, of k and of
v). A split or slice on group boundaries gives each part its groups' shares (``Shard(d)`` for
one group); a ``cat`` of parts sharded alike on the dimension, with equal groups, is the
strided whole again (the backward of the split), and ``slice_backward`` pads the same way. DTensor
2.13 propagates the strided split through matmuls, views and pointwise ops, but gathers at
these ops.

Registration goes through DTensor's private helpers (``_ops.utils.register_op_strategy``,
``expand_to_full_mesh_op_strategy``, the pointwise registrar); this module is the one
place that uses them. ``spmd::tag_grad`` needs no rule: the expansion handles it itself
(:mod:`spmd.parallel.expand`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from passes import torch_compat
from passes.torch_compat import StridedShard, pytree

aten = torch.ops.aten
_done = False

# The ops registered here, for the docs (docs/tensor-parallel.md) and the tests.
RULES = (
    aten._fused_sgd_.default,
    aten._fused_sgd_.tensor_lr,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
)


# The attention ops that take an ``attn_mask`` keyword -> the position of q in their arguments.
ATTENTION_Q = {RULES[2]: 0, RULES[3]: 1}


def _attention_strategies(
    n_out: int, n_in: int, q_shape: Sequence[int], mask_shape: Sequence[int] | None
) -> list[list[Placement | None]]:
    """All replicated, or every tensor sharded on batch (dim 0), or on heads (dim 1).

    ``mask_shape``: the ``attn_mask`` keyword's shape (its strategy comes after the positional
    inputs), or None without one.
    """
    out = []
    for p in (Replicate(), Shard(0), Shard(1)):
        row: list[Placement | None] = [p] * (n_out + n_in)
        if mask_shape is not None:
            row.append(_mask_placement(p, q_shape, mask_shape))
        out.append(row)
    return out


def _mask_placement(p: Placement, q_shape: Sequence[int], mask_shape: Sequence[int]) -> Placement:
    """The mask's placement on a mesh dimension where q has ``p`` (batch, heads or replicated).

    The mask broadcasts against the scores ``[B, H, S_q, S_kv]`` from the right, so q's dim
    ``d`` is the mask's dim ``d - (q.ndim - mask.ndim)``; a size-1 (or missing) dim there is
    the same for every shard: the mask stays replicated.
    """
    if not isinstance(p, Shard):
        return Replicate()
    dim = p.dim - (len(q_shape) - len(mask_shape))
    if dim < 0 or mask_shape[dim] == 1:
        return Replicate()
    return Shard(dim)


def attn_mask_placements(
    q_placements: Sequence[Placement], q_shape: Sequence[int], mask_shape: Sequence[int]
) -> tuple[Placement, ...]:
    """The placements an ``attn_mask`` must have next to a q with ``q_placements``.

    Raises NotImplementedError for a q sharded on its sequence (or head-size) dimension.
    """
    for p in q_placements:
        if isinstance(p, Shard) and p.dim >= 2:
            raise NotImplementedError(
                f"attention with an attn_mask over a q sharded on dimension {p.dim} (sequence) has no "
                "sharding rule; shard the batch (dim 0) or the heads (dim 1), or pass is_causal instead "
                "of a mask"
            )
    return tuple(_mask_placement(p, q_shape, mask_shape) for p in q_placements)


def follows_input(in_shape: Sequence[int], out_shape: Sequence[int], placements: Sequence[Placement]) -> bool:
    """Whether a new uninitialised tensor of ``out_shape`` can take the ``placements`` of its
    input of ``in_shape``: equal shapes (DTensor's own rule), or every dimension the input is
    sharded on exists in the output with the same size (and nothing is partial)."""
    if tuple(in_shape) == tuple(out_shape):
        return True
    if len(in_shape) != len(out_shape) or not any(isinstance(p, Shard) for p in placements):
        return False
    return all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and in_shape[p.dim] == out_shape[p.dim])
        for p in placements
    )


def register() -> None:
    """Register the rules once (idempotent)."""
    global _done
    if _done:
        return
    _done = True
    from passes.torch_compat import (
        DTensorSpec,
        OpSchema,
        OpSpec,
        OpStrategy,
        RuntimeSchemaInfo,
        StrategyType,
        expand_to_full_mesh_op_strategy,
        register_list_pointwise,
        register_op_strategy,
    )

    for op in RULES[:2]:
        register_list_pointwise(op)

    def _attention(op_schema: OpSchema, n_out: int, n_in: int) -> StrategyType:
        mesh = op_schema.get_mesh_from_args()
        q = op_schema.args_schema[ATTENTION_Q[op_schema.op]]
        mask = op_schema.kwargs_schema.get("attn_mask")
        assert isinstance(q, OpStrategy)
        if not isinstance(mask, OpStrategy):
            return expand_to_full_mesh_op_strategy(
                mesh, op_schema, _attention_strategies(n_out, n_in, q.shape, None), input_index=n_out
            )
        strategy = expand_to_full_mesh_op_strategy(
            mesh, op_schema, _attention_strategies(n_out, n_in, q.shape, mask.shape), input_index=n_out
        )
        # DTensor does not redistribute keyword arguments: only strategies that take the mask
        # as it comes are valid (the expansion placed it from q's placements beforehand).
        have = mask.strategies[0].output_spec.placements
        strategy.strategies = [
            s
            for s in strategy.strategies
            if s.input_specs is not None and s.input_specs[-1].placements == have
        ]
        if not strategy.strategies:
            raise NotImplementedError(
                f"attention with an attn_mask placed {have} has no sharding rule for q placed "
                f"{q.strategies[0].output_spec.placements}"
            )
        return strategy

    @register_op_strategy(RULES[2], schema_info=RuntimeSchemaInfo(3))
    def _flash_cpu(op_schema: OpSchema) -> StrategyType:
        return _attention(op_schema, 2, 3)

    @register_op_strategy(RULES[3], schema_info=RuntimeSchemaInfo(6))
    def _flash_cpu_backward(op_schema: OpSchema) -> StrategyType:
        return _attention(op_schema, 3, 6)

    @register_op_strategy(list(RULES[4:6]), schema_info=RuntimeSchemaInfo(1, ["dtype"]))
    def _new_empty(op_schema: OpSchema) -> StrategyType:
        x = op_schema.args_schema[0]
        size = op_schema.args_schema[1]
        assert isinstance(x, OpStrategy) and isinstance(size, list | tuple)
        out = OpStrategy([])
        for s in x.strategies:
            spec = s.output_spec
            rep = DTensorSpec(x.mesh, (Replicate(),) * x.mesh.ndim)
            n = len(x.strategies)
            out.strategies.append(OpSpec(rep, input_specs=(spec,), redistribute_cost=[[0.0] * n]))
            if follows_input(x.shape, size, spec.placements):
                # Preferred: the new tensor where its input is (no redistribution of what fills it).
                out.strategies.append(OpSpec(spec, input_specs=(spec,), redistribute_cost=[[-0.1] * n]))
        return out


# ----------------------------------------------------------------------------- strided splits

_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
STRIDED_OPS = (*_SPLITS, aten.slice.Tensor, aten.cat.default, aten.slice_backward.default)


def splits_strided(placements: Sequence[Placement]) -> bool:
    """Whether ``placements`` split a dimension strided into groups (a fused projection's
    ``_StridedShard`` with nothing splitting that dimension after it; FSDP x TP's data-dimension
    ``_StridedShard(0, split_factor=tp)`` has tp's ``Shard(0)`` after it and is contiguous)."""
    for i, p in enumerate(placements):
        if isinstance(p, StridedShard) and not any(
            isinstance(q, Shard | StridedShard) and q.dim == p.dim for q in placements[i + 1 :]
        ):
            return True
    return False


def _split_on(x: Any, dim: int) -> tuple[int, int, int] | None:
    """(mesh dimension, its size, groups) if ``x`` is a DTensor split on tensor dimension ``dim``
    over exactly one mesh dimension (replicated on the others): ``Shard(dim)`` is one group,
    ``_StridedShard(dim, split_factor=k)`` k groups."""
    if not isinstance(x, DTensor):
        return None
    found = None
    for i, p in enumerate(x.placements):
        if isinstance(p, Replicate):
            continue
        if found is not None or not isinstance(p, Shard | StridedShard) or p.dim % x.ndim != dim:
            return None
        k = p.split_factor if isinstance(p, StridedShard) else 1
        found = (i, x.device_mesh.size(i), k)
    return found


def _part(dim: int, groups: int) -> Placement:
    return Shard(dim) if groups == 1 else StridedShard(dim, split_factor=groups)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def strided_call(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], wrap: Callable[..., DTensor]
) -> Any:
    """``target`` on a strided split (see the module docstring), computed on the local tensors;
    None where it does not apply (then DTensor runs the op). ``wrap(local, mesh, placements,
    shape, stride, dtype)`` makes the DTensor of a local result."""
    if target not in STRIDED_OPS or kwargs:
        return None
    if target is aten.cat.default:
        return _cat(args, wrap)
    x = args[0]
    if not isinstance(x, DTensor):
        return None
    if target is aten.slice_backward.default:
        return _slice_backward(args, wrap)
    dim = (args[2] if len(args) > 2 else 0) if target in _SPLITS else (args[1] if len(args) > 1 else 0)
    dim %= x.ndim
    info = _split_on(x, dim)
    if info is None or info[2] == 1:
        return None
    mesh_dim, n, k = info
    length = x.shape[dim]
    group = length // k
    if group * k != length or group % n:
        return None
    if target is aten.slice.Tensor:
        given = list(args[2:5])
        start, end, step = given + [None, None, 1][len(given) :]
        start, end = _bound(start, 0, length), _bound(end, length, length)
        if step != 1 or end <= start or start % group or end % group:
            return None
        sizes = [end - start]
    else:
        size = args[1]
        sizes = list(size) if target is aten.split_with_sizes.default else [size] * -(-length // size)
        if target is aten.split.Tensor:
            sizes[-1] = length - size * (len(sizes) - 1)
        start = 0
        if any(s <= 0 or s % group for s in sizes):
            return None
    local = torch_compat.local_tensor(x)
    placements = list(x.placements)

    def out(piece: torch.Tensor, size: int) -> DTensor:
        shape = list(x.shape)
        shape[dim] = size
        placements[mesh_dim] = _part(dim, size // group)
        return wrap(piece, x.device_mesh, tuple(placements), shape, x.stride(), x.dtype)

    if target is aten.slice.Tensor:
        piece = aten.slice.Tensor(local, dim, start // n, (start + sizes[0]) // n)
        return out(piece, sizes[0])
    pieces = aten.split_with_sizes.default(local, [s // n for s in sizes], dim)
    return [out(p, s) for p, s in zip(pieces, sizes)]


# Ops whose strategy (DTensor's) is right for a strided split read as an even one: matmuls over
# experts, where a split of the weight's output features into k groups gives the output's
# features the same groups, and a contraction over two inputs split alike is a partial sum.
STRIDED_AS_SHARD = (aten._grouped_mm.default,)


def strided_as_shard(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    wrap: Callable[..., DTensor],
    run: Callable[[tuple[Any, ...], dict[str, Any]], Any],
) -> Any:
    """One of :data:`STRIDED_AS_SHARD` on inputs split strided (Mixtral's fused ``gate_up_proj``,
    split strided into gate and up): ``run`` (DTensor's own dispatch) on the same local tensors
    with each ``_StridedShard(d, k)`` read as ``Shard(d)``, and an output ``Shard`` on that mesh
    dimension given back the ``k`` groups. None where it does not apply: no strided input, two
    group counts on one mesh dimension, or an even split beside a strided one there (its local
    pieces are other rows). A partial sum there is all-reduced first."""
    groups: dict[int, int] = {}
    other: set[int] = set()
    for x in pytree.tree_leaves((args, kwargs)):
        if not isinstance(x, DTensor):
            continue
        for i, p in enumerate(x.placements):
            if isinstance(p, StridedShard):
                if groups.setdefault(i, p.split_factor) != p.split_factor:
                    return None
            elif not isinstance(p, Replicate | Partial):
                other.add(i)
    if not groups or other & groups.keys():
        return None

    # a partial sum (a row-parallel output not yet reduced) is all-reduced first, as DTensor does
    # before a matmul with a split weight
    args, kwargs = pytree.tree_map(summed, (args, kwargs))

    def retag(x: Any, to: Callable[[int, Placement], Placement]) -> Any:
        if not isinstance(x, DTensor):
            return x
        pls = tuple(to(i, p) for i, p in enumerate(x.placements))
        return wrap(torch_compat.local_tensor(x), x.device_mesh, pls, x.shape, x.stride(), x.dtype)

    def as_even(i: int, p: Placement) -> Placement:
        return Shard(p.dim) if isinstance(p, StridedShard) else p

    def as_strided(i: int, p: Placement) -> Placement:
        if i in groups and isinstance(p, Shard) and not isinstance(p, StridedShard):
            return StridedShard(p.dim, split_factor=groups[i])
        return p

    even_args, even_kwargs = pytree.tree_map(lambda x: retag(x, as_even), (args, kwargs))
    out = run(even_args, even_kwargs)
    return pytree.tree_map(lambda y: retag(y, as_strided), out)


def summed(x: Any) -> Any:
    """``x`` with its partial sums all-reduced (``Partial`` -> ``Replicate``), else ``x``."""
    if isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements):
        pls = [Replicate() if isinstance(p, Partial) else p for p in x.placements]
        return x.redistribute(x.device_mesh, pls)
    return x


def _bound(v: Any, default: int, length: int) -> int:
    if v is None:
        return default
    v = int(v)
    if v < 0:
        v += length
    return max(0, min(v, length))


def _cat(args: tuple[Any, ...], wrap: Callable[..., DTensor]) -> DTensor | None:
    """Parts split alike on the cat dimension, with groups of one size: the strided whole."""
    xs = args[0]
    if not isinstance(xs, list | tuple) or len(xs) < 2 or not all(isinstance(x, DTensor) for x in xs):
        return None
    first = xs[0]
    dim = (args[1] if len(args) > 1 else 0) % first.ndim
    infos = [_split_on(x, dim) for x in xs]
    if any(i is None for i in infos):
        return None
    groups = {x.shape[dim] // i[2] for x, i in zip(xs, infos) if i is not None}
    where = {(i[0], i[1]) for i in infos if i is not None}
    same = {
        (x.device_mesh, tuple(p for j, p in enumerate(x.placements) if j != i[0]))
        for x, i in zip(xs, infos)
        if i is not None
    }
    if len(groups) != 1 or len(where) != 1 or len(same) != 1:
        return None
    (mesh_dim, n), group = next(iter(where)), next(iter(groups))
    if group % n or any(x.shape[dim] % group for x in xs):
        return None
    local = aten.cat.default([torch_compat.local_tensor(x) for x in xs], dim)
    shape = list(first.shape)
    shape[dim] = sum(x.shape[dim] for x in xs)
    placements = list(first.placements)
    placements[mesh_dim] = _part(dim, shape[dim] // group)
    return wrap(local, first.device_mesh, tuple(placements), shape, _contiguous_stride(shape), first.dtype)


def _slice_backward(args: tuple[Any, ...], wrap: Callable[..., DTensor]) -> DTensor | None:
    """The gradient of a slice on group boundaries: the strided whole, zero outside the slice."""
    g, sizes, dim, start, end, step = args
    dim %= g.ndim
    info = _split_on(g, dim)
    if info is None or step != 1:
        return None
    mesh_dim, n, k = info
    length = int(sizes[dim])
    start, end = _bound(start, 0, length), _bound(end, length, length)
    group = (end - start) // k
    if group <= 0 or group * k != end - start or group % n or start % group or length % group:
        return None
    local_sizes = list(sizes)
    local_sizes[dim] = length // n
    local = aten.slice_backward.default(
        torch_compat.local_tensor(g), local_sizes, dim, start // n, end // n, 1
    )
    placements = list(g.placements)
    placements[mesh_dim] = _part(dim, length // group)
    return wrap(local, g.device_mesh, tuple(placements), list(sizes), _contiguous_stride(sizes), g.dtype)
