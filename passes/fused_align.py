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


@functools.lru_cache(maxsize=1024)
def _ragged(
    pre: tuple[int, ...], post: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The positions of the shards to align, and their ``pre`` and ``post``: once per call site."""
    ks = tuple(k for k in range(len(pre)) if pre[k] or post[k])
    return ks, tuple(pre[k] for k in ks), tuple(post[k] for k in ks)


@functools.lru_cache(maxsize=4096)
def _layout(
    pre: tuple[int, ...], post: tuple[int, ...], numels: tuple[int, ...]
) -> tuple[list[int], list[int], int]:
    """Segment sizes of shards padded by ``pre``/``post`` and laid end to end; the same buffer cut
    into gaps and shards (the gap between two shards, one's ``post`` plus the next one's ``pre``,
    as one piece: 2n+1 pieces, not 3n); its length."""
    seg_sizes = [a + n + b for a, n, b in zip(pre, numels, post)]
    gaps = [pre[0], *(b + a for b, a in zip(post, pre[1:])), post[-1]]
    parts = [x for g, n in zip(gaps, numels) for x in (g, n)] + [gaps[-1]]
    return seg_sizes, parts, sum(seg_sizes)


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
    # list one allocation, two splits and a foreach copy in and back; per shard only views (a
    # pad, slice and copy per shard and list made this op ~1 ms per call on a stack of tiny
    # blocks, where almost every LayerNorm shard is ragged). What depends only on the call's
    # int arguments and the shards' sizes (the same in every list) is computed once per call
    # site, not per call and list.
    ragged, rpre, rpost = _ragged(tuple(pre), tuple(post))
    copy_backs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    if ragged:
        cl = [channels_last[k] for k in ragged]
        order = [_memory_order(params[k], c) for k, c in zip(ragged, cl)]
        numels = tuple(x.numel() for x in order)
        # shape of each shard in memory order where it is not 1-d (a view of its segment piece)
        views = [None if x.dim() == 1 else x.shape for x in order]
        any_cl, any_nd = any(cl), any(v is not None for v in views)
    for j, lst in enumerate(lists):
        if not lst or not ragged:
            continue
        srcs = [_memory_order(lst[k], c) for k, c in zip(ragged, cl)] if any_cl else [lst[k] for k in ragged]
        dtype = srcs[0].dtype
        if all(x.dtype == dtype for x in srcs):
            groups = [list(range(len(ragged)))]
        else:  # one buffer per dtype
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, x in enumerate(srcs):
                by_dtype.setdefault(x.dtype, []).append(i)
            groups = list(by_dtype.values())
        for g in groups:
            whole = len(g) == len(ragged)
            gsrcs = srcs if whole else [srcs[i] for i in g]
            key = (
                (rpre, rpost, numels)
                if whole
                else tuple(tuple(t[i] for i in g) for t in (rpre, rpost, numels))
            )
            seg_sizes, parts, total = _layout(*key)
            flat = gsrcs[0].new_zeros(total)
            segments = flat.split_with_sizes(seg_sizes)
            inner = list(flat.split_with_sizes(parts)[1::2])
            if any_nd:
                inner = [d if (v := views[i]) is None else d.view(v) for d, i in zip(inner, g)]
            torch_compat.foreach_copy_(inner, gsrcs)
            buf = bufs[j]
            for i, seg in zip(g, segments):
                buf[ragged[i]] = seg
            if j != 1:  # grads are the kernel's scratch: nothing to copy back
                copy_backs.append((gsrcs, inner))
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
