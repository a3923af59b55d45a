"""One node for a fused optimizer call on shards that must be aligned: ``spmd::aligned_fused_optimizer_``.

CPU fused optimizer kernels (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``) run a SIMD
loop with a scalar tail that rounds differently; a shard that does not start at a multiple of
the vector width, or ends early, would round some elements differently from the full tensor
(DDP). The fix (see ``spmd.parallel.sharded_optim.align_fused_optimizer``) runs the kernel on
zero-padded copies covering the shard's global index range rounded out to the alignment, and
copies the results back. Emitted as graph ops that is a pad and reshape per tensor and a slice,
view and copy per written tensor: thousands of nodes at large world sizes, where almost every
shard is ragged. This op does the same inside one node.

Schema: the kernel's six per-parameter list slots (``self, grads`` and up to three state lists,
then ``state_steps``; a kernel with fewer lists passes empty ones), then per parameter ``pre``,
``post`` (elements of padding before and after the shard; both 0: the tensors are used as they
are) and ``channels_last`` (0, or the ndim of a channels-last shard, flattened in memory
order), then the kernel's name, its non-tensor keyword arguments as a ``repr``'d dict, and its
tensor keyword arguments. Every list argument is per parameter (or empty) and everything else
is shared, so :mod:`passes.optimizer_overlap` splits it like the kernel itself.

Cost per call: the op is defined with :class:`torch.library.Library` and one
``CompositeExplicitAutograd`` Python kernel, so a call is one C++ dispatch into that kernel
(``torch.library.custom_op`` adds Python autograd and ADInplaceOrView wrappers that bump the
version counter of every mutated tensor one by one: ~0.3 ms per call on a bucket of 4 shards).
The kernel's name and options are parsed once per distinct string (:func:`_parsed`), not per
call. The op has no autograd formula: the optimizer region runs without grad, like the kernels it
wraps.
"""

from __future__ import annotations

import ast
import functools

import torch

from passes import torch_compat
from passes.torch_compat import OpOverload

_LIST_SLOTS = 5  # self, grads, up to three state lists; then state_steps


def _kernel(name: str) -> OpOverload:
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _memory_order(t: torch.Tensor, cl: int) -> torch.Tensor:
    """``t`` with its elements in memory order (a channels-last shard permuted; else ``t``)."""
    return t.permute(0, *range(2, cl), 1) if cl else t


_SCHEMA = (
    "aligned_fused_optimizer_(Tensor(a0!)[] params, Tensor(a1!)[] grads, Tensor(a2!)[] state0, "
    "Tensor(a3!)[] state1, Tensor(a4!)[] state2, Tensor[] state_steps, SymInt[] pre, SymInt[] post, "
    "SymInt[] channels_last, str kernel, str options, Tensor? lr=None, Tensor? grad_scale=None, "
    "Tensor? found_inf=None) -> ()"
)


_Parsed = tuple[OpOverload, int, bool, tuple[tuple[str, object], ...]]


@functools.cache
def _parsed(kernel: str, options: str) -> _Parsed:
    """``kernel`` resolved, its number of positional lists (``state_steps`` aside), whether it
    takes ``state_steps``, and ``options`` parsed: once per distinct pair of strings."""
    op = _kernel(kernel)
    positional = [a.name for a in torch_compat.op_schema(op).arguments if not a.kwarg_only]
    n_lists = len([n for n in positional if n != "state_steps"])
    return op, n_lists, "state_steps" in positional, tuple(ast.literal_eval(options).items())


def _aligned_fused_optimizer(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    state0: list[torch.Tensor],
    state1: list[torch.Tensor],
    state2: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    pre: list[int],
    post: list[int],
    channels_last: list[int],
    kernel: str,
    options: str,
    lr: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    op, n_lists, takes_steps, parsed_options = _parsed(kernel, options)
    lists = [params, grads, state0, state1, state2]
    bufs: list[list[torch.Tensor]] = [list(lst) for lst in lists]
    # The shards to align of one list (and dtype) live in one flat zero buffer, each in its own
    # padded segment, and the kernel gets the segments as separate (view) tensors: it loops over
    # each tensor by index, so a segment rounds exactly as a padded copy of its own would. Per
    # list one allocation, two splits and a foreach copy in and back; per shard at most a view (a
    # pad, slice and copy per shard and list made this op ~1 ms per call on a stack of tiny
    # blocks, where almost every LayerNorm shard is ragged).
    ragged = [k for k in range(len(params)) if pre[k] or post[k]]
    copy_backs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for j, lst in enumerate(lists):
        if not lst:
            continue
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k in ragged:
            by_dtype.setdefault(lst[k].dtype, []).append(k)
        for ks in by_dtype.values():
            srcs = [_memory_order(lst[k], channels_last[k]) for k in ks]
            numels = [src.numel() for src in srcs]
            seg_sizes = [pre[k] + n + post[k] for k, n in zip(ks, numels)]
            flat = srcs[0].new_zeros(sum(seg_sizes))
            segments = torch.split(flat, seg_sizes)
            # The gaps between the shards (one shard's post plus the next one's pre) as one piece
            # each: 2n+1 views, not 3n.
            gaps = [pre[ks[0]], *(post[a] + pre[b] for a, b in zip(ks, ks[1:])), post[ks[-1]]]
            parts = [x for g, n in zip(gaps, numels) for x in (g, n)] + [gaps[-1]]
            inner = [
                d if src.dim() == 1 else d.view(src.shape)
                for d, src in zip(torch.split(flat, parts)[1::2], srcs)
            ]
            torch_compat.foreach_copy_(inner, srcs)
            for k, seg in zip(ks, segments):
                bufs[j][k] = seg
            if j != 1:  # grads are the kernel's scratch: nothing to copy back
                copy_backs.append((srcs, inner))
    kwargs = dict(parsed_options)
    for name, value in (("lr", lr), ("grad_scale", grad_scale), ("found_inf", found_inf)):
        if value is not None:
            kwargs[name] = value
    args = bufs[:n_lists]
    if takes_steps:
        args.append(state_steps)
    op(*args, **kwargs)
    for srcs, inner in copy_backs:
        torch_compat.foreach_copy_(srcs, inner)


_LIB = torch.library.Library("spmd", "FRAGMENT")
_LIB.define(_SCHEMA)
_LIB.impl("aligned_fused_optimizer_", _aligned_fused_optimizer, "CompositeExplicitAutograd")


@torch.library.register_fake("spmd::aligned_fused_optimizer_", lib=_LIB)
def _(params, grads, state0, state1, state2, state_steps, pre, post, channels_last, kernel, options, lr=None,
      grad_scale=None, found_inf=None) -> None:  # fmt: skip
    return None


ALIGNED_FUSED = torch.ops.spmd.aligned_fused_optimizer_.default


def wrap_args(
    kernel: OpOverload,
    values: dict[str, object],
    pre: list[int],
    post: list[int],
    channels_last: list[int],
) -> tuple[tuple, dict]:
    """The (args, kwargs) of :data:`ALIGNED_FUSED` standing for ``kernel`` called with ``values``
    (its arguments by schema name)."""
    lists: list[list] = []
    options: dict[str, object] = {}
    tensors: dict[str, object] = {}
    for a in torch_compat.op_schema(kernel).arguments:
        v = values.get(a.name, a.default_value if a.has_default_value() else None)
        if not a.kwarg_only:
            if a.name != "state_steps":
                lists.append(list(v))  # type: ignore[call-overload]
        elif a.name in ("lr", "grad_scale", "found_inf") and (v is None or not isinstance(v, float | int)):
            tensors[a.name] = v
        else:
            options[a.name] = v
    lists += [[] for _ in range(_LIST_SLOTS - len(lists))]
    steps = list(values.get("state_steps", []))  # type: ignore[call-overload]
    name = f"{torch_compat.op_schema(kernel).name.split('::')[1]}.{torch_compat.overload_name(kernel)}"
    args = (*lists, steps, pre, post, channels_last, name, repr(options))
    return args, {k: v for k, v in tensors.items() if v is not None}
