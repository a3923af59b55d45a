"""Chunk the loss head: output projection + cross-entropy (forward and backward) into one
``spmd::linear_cross_entropy`` node that runs over chunks of tokens.

What is rewritten. In a traced whole step, a language model's loss head is

    x [N, D] --mm(x, t(W))--> logits [N, V] --views, optional _to_copy (HF upcasts)-->
    _log_softmax --> nll_loss_forward(lp, target, None, mean|sum, ignore_index) --> loss
    ... backward: grad_loss --> nll_loss_backward --> _log_softmax_backward_data -->
    optional _to_copy, views --> G [N, V] --> mm(G, W) = grad_x;  mm(t(G), x) = grad_W

(``W`` [V, D] is the head's weight, or its mixed-precision compute copy; tied to the
embedding or not). Every node from ``mm(x, t(W))`` to the two gradient ``mm``s is replaced by
one node, ``linear_cross_entropy(x, W, target, grad_loss, chunk, ...)`` (see
:mod:`passes.linear_cross_entropy`), whose getitems stand for the loss, nll's total_weight,
grad_x and grad_W: at no point does a [N, V] tensor exist, forward or backward.

Where the node goes: where the loss's backward starts (just before ``nll_loss_backward``),
because it needs ``grad_loss``, and computing loss and gradients in one pass over the chunks
means no logits are recomputed. So the loss is computed in the backward phase: the node
(role activation, phase backward, the head's module path) and the forward nodes that read the
loss value (``loss / accum_steps``, the step's output) move just after it and take the
backward phase. ``grad_loss`` must not depend on the loss's value: ``ones_like(loss)`` (what
``loss.backward()`` seeds) depends only on its shape and dtype, and is rewritten into
``full(shape, 1.0)``; a ``grad_loss`` that reads the value (``(loss ** 2).backward()``) leaves
the head as it is.

Why legal. The node computes the same functions of the same inputs (one chunk: the same ops,
the same bits; several: a different summation order only, see the op's docstring). Its inputs
are forward values and ``grad_loss``, all defined before ``nll_loss_backward``; everything
that read the replaced nodes reads the getitems, after the node. Nothing that writes in place
is moved unless all it writes is the loss or a value computed from it (``loss += coef * aux``,
Hugging Face's MoE heads), whose readers all move with it (checked; otherwise the head is
left alone). The head is left alone, too, when a
logits-sized tensor has another reader (a step that returns the logits), when the loss is not
a plain ``nll_loss`` (class weights, ``reduction="none"``), or when the pattern differs in any
other way: recognising less is safe, recognising wrongly is not.

Where it runs: on the traced graph, before the partitioner. So a fully_shard partitioner sees
the weight read by a backward node and gathers it for backward (once, if nothing in forward
reads it: an untied head), the gradient tags (``spmd::tag_grad``) stay on what reads grad_W,
and mixed precision's compute casts are what the node reads. A graph without a head is returned
unchanged (the same ``gm``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from passes.graph_utils import mutated_nodes
from passes.linear_cross_entropy import (
    LINEAR_CROSS_ENTROPY,
    REDUCTION_MEAN,
    REDUCTION_SUM,
    default_chunk,
    workspace_bytes,
)
from passes.meta import CHUNKED_LOSS, MODULE, PHASE, WORKSPACE, Role, copy_meta
from passes.torch_compat import detect_fake_mode

log = logging.getLogger("spmd.passes")

aten = torch.ops.aten

# Below this size of one logits-sized buffer (tokens x vocab in the log-softmax's dtype) the
# head is left alone by default. Chunking sums the loss and the head's weight gradient in another
# order, so the step is no longer bit for bit with DDP/FSDP2 (spmd's default correctness bar);
# that is worth it by default only where the head decides whether the step fits. The unchunked
# head holds ~4 such buffers at its peak: at 1 GiB that is 4 GiB, 5% of an 80 GB H100 (NVIDIA
# H100 datasheet: 80 GB HBM3). Llama 3.1 8B at batch 2 x seq 8192 (8 GiB a buffer) is above it;
# spmd's bench GPT (32 MiB) is below. chunked_loss=True/int applies it whatever the size.
MIN_LOGITS_BYTES = 1024 * 1024 * 1024

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_ALIASES = {aten.detach.default, aten.alias.default}
_TRANSPOSES = {aten.t.default}
_LIKES = {
    aten.ones_like.default: 1.0,
    aten.zeros_like.default: 0.0,
    aten.empty_like.default: 0.0,
    aten.full_like.default: None,  # its fill value is its argument
}


@dataclasses.dataclass
class _Head:
    """One recognised loss head: the nodes to replace and the op's arguments."""

    x: fx.Node
    weight: fx.Node
    target: fx.Node
    grad_loss: fx.Node
    nll: fx.Node
    nll_bwd: fx.Node
    loss: fx.Node | None  # getitem 0 of nll_loss_forward
    total_weight: fx.Node | None  # getitem 1
    grad_x: fx.Node | None
    grad_w: fx.Node | None
    module_from: fx.Node  # the forward mm: its module path names the head
    reduction: int
    ignore_index: int
    logits_dtype: torch.dtype | None
    tokens: int
    vocab: int
    d_model: int
    remove: list[fx.Node]  # every node of the pattern (erased once unused)
    likes: list[fx.Node]  # ones_like(loss) & co on grad_loss's path: made value-free
    move: list[fx.Node]  # readers of the loss before nll_loss_backward: moved after the op

    @property
    def lp_dtype(self) -> torch.dtype:
        return self.logits_dtype or self.x.meta["val"].dtype


def _single_user(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _is(n: object, targets: Iterable[object]) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in set(targets)


def _is_cast(n: fx.Node) -> bool:
    """``_to_copy`` that changes the dtype only (HF's ``logits.float()``, its backward, which
    also names the layout and the device it keeps)."""
    if not _is(n, [aten._to_copy.default]) or n.args[1:] or "dtype" not in n.kwargs:
        return False
    src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    return (
        set(n.kwargs) <= {"dtype", "layout", "device"}
        and n.kwargs.get("layout", torch.strided) == torch.strided
        and (src is None or n.kwargs.get("device", src.device) == src.device)
    )


def _val(n: fx.Node) -> torch.Tensor | None:
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _untranspose(n: fx.Node) -> tuple[fx.Node, int]:
    """``n`` with its ``t`` chain stripped, and how many were stripped."""
    k = 0
    while _is(n, _TRANSPOSES):
        n, k = n.args[0], k + 1  # type: ignore[assignment]
    return n, k


def _descendants(start: Iterable[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(start)
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        seen.add(n)
        todo.extend(n.users)
    return seen


def _match(nll: fx.Node, order: dict[fx.Node, int]) -> _Head | str:
    """The head ending at ``nll`` (an ``nll_loss_forward``), or why it is not one."""
    args: list[Any] = list(nll.args) + [None] * (5 - len(nll.args))
    lp_in, target, cls_weight, reduction = args[0], args[1], args[2], args[3]
    ignore_index = args[4] if args[4] is not None else nll.kwargs.get("ignore_index", -100)
    if cls_weight is not None or reduction not in (REDUCTION_MEAN, REDUCTION_SUM):
        return "class weights or reduction='none'"
    # log_softmax and its aliases (autograd saves detach()es of it for backward)
    lp: Any = lp_in
    while _is(lp, _ALIASES):
        lp = lp.args[0]
    if not _is(lp, [aten._log_softmax.default]) or lp.args[2]:
        return "the loss does not read a log_softmax"
    lpv = _val(lp)
    if lpv is None or lpv.dim() != 2 or lp.args[1] not in (1, -1):
        return "the log_softmax is not over the last dim of a 2-D tensor"
    tokens, vocab = lpv.shape
    aliases: list[fx.Node] = [lp]
    i = 0
    while i < len(aliases):
        aliases.extend(u for u in aliases[i].users if _is(u, _ALIASES))
        i += 1
    readers = [u for a in aliases for u in a.users if u not in aliases]
    bwd = [u for u in readers if _is(u, [aten.nll_loss_backward.default])]
    lsb = [u for u in readers if _is(u, [aten._log_softmax_backward_data.default])]
    if len(bwd) != 1 or len(lsb) != 1 or len(readers) != 3 or set(readers) != {nll, *bwd, *lsb}:
        return "the log-probabilities have readers other than the loss and its backward"
    nll_bwd, lsb_node = bwd[0], lsb[0]
    getitems = {u.args[1]: u for u in nll.users if u.target is operator.getitem}
    if len(getitems) != len(nll.users):
        return "nll_loss_forward is read other than by getitem"
    b_args: list[Any] = list(nll_bwd.args)
    if (
        b_args[2] is not target
        or b_args[3] is not None
        or b_args[4] != reduction
        or b_args[5] != ignore_index
        or b_args[6] is not getitems.get(1)
        or list(nll_bwd.users) != [lsb_node]
        or lsb_node.args[0] is not nll_bwd
        or lsb_node.args[1] not in aliases
    ):
        return "nll_loss_backward does not match the forward"
    # Up from the log_softmax: views, at most one cast, to mm(x, t(W)).
    fwd_chain: list[fx.Node] = []
    z: Any = lp.args[0]
    logits_dtype = None
    while isinstance(z, fx.Node) and (_is(z, _VIEWS) or (_is_cast(z) and logits_dtype is None)):
        if len(z.users) != 1:
            return "the logits are read elsewhere (returned from the step?)"
        if _is_cast(z):
            logits_dtype = z.kwargs["dtype"]
        zv = _val(z)
        if zv is None or zv.shape[-1] != vocab or zv.numel() != tokens * vocab:
            return "a view between the head's matmul and the log_softmax changes the rows"
        fwd_chain.append(z)
        z = z.args[0]
    if not _is(z, [aten.mm.default]) or len(z.users) != 1:
        return "the logits do not come from one matmul read only by the loss"
    mm: fx.Node = z
    x: Any = mm.args[0]
    wt: Any = mm.args[1]
    weight, k = _untranspose(wt)  # type: ignore[arg-type]
    xv, wv = _val(x), _val(weight)  # type: ignore[arg-type]
    if k != 1 or xv is None or wv is None or wv.dim() != 2 or tuple(wv.shape) != (vocab, xv.shape[1]):
        return "the head's matmul is not x @ W.T with W [vocab, d]"
    if xv.shape[0] != tokens or xv.dtype != wv.dtype:
        return "the head's matmul rows or dtypes do not match the loss"
    # Down from _log_softmax_backward_data: views, at most one cast, to G; G's readers are the
    # two gradient matmuls.
    bwd_chain: list[fx.Node] = []
    g = lsb_node
    back_cast = False
    while True:
        u = _single_user(g)
        if u is not None and (_is(u, _VIEWS) or (_is_cast(u) and not back_cast)):
            back_cast = back_cast or _is_cast(u)
            uv = _val(u)
            if uv is None or uv.shape[-1] != vocab or uv.numel() != tokens * vocab:
                return "a view of the logits' gradient changes the rows"
            bwd_chain.append(u)
            g = u
            continue
        break
    gv = _val(g)
    if gv is None or tuple(gv.shape) != (tokens, vocab) or gv.dtype != xv.dtype:
        return "the logits' gradient does not reach the head's matmuls as [tokens, vocab]"
    grad_x = grad_w = None
    extra: list[fx.Node] = []
    for u in g.users:
        if _is(u, [aten.mm.default]) and u.args[0] is g and _untranspose(u.args[1]) == (weight, 2):  # type: ignore[arg-type]
            grad_x = u
            extra.append(u.args[1])  # type: ignore[arg-type]
        elif _is(u, _TRANSPOSES) and len(u.users) == 1:
            m = next(iter(u.users))
            if _is(m, [aten.mm.default]) and m.args[0] is u and m.args[1] is x:
                grad_w = m
                extra.append(u)
            else:
                return "the logits' gradient has a reader other than the head's gradient matmuls"
        else:
            return "the logits' gradient has a reader other than the head's gradient matmuls"
    grad_loss: Any = nll_bwd.args[0]
    if not isinstance(grad_loss, fx.Node):
        return "the loss gradient is not a graph value"
    # The loss's value must not flow into grad_loss: ones_like(loss) is fine (shape only).
    loss_value = _descendants(nll.users, stop={n for n in nll.graph.nodes if n.target in _LIKES})
    likes: list[fx.Node] = []
    todo, seen = [grad_loss], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in loss_value:
            return "the loss gradient depends on the loss value"
        if n.target in _LIKES and any(a in loss_value for a in n.all_input_nodes):
            likes.append(n)
            continue
        todo.extend(n.all_input_nodes)
    # Readers of the loss that run before its backward move after the new node.
    pattern = {mm, *fwd_chain, lp, *aliases, nll, *getitems.values(), nll_bwd, lsb_node, *bwd_chain}
    pattern.update(n for n in (grad_x, grad_w) if n is not None)
    move = sorted(
        (n for n in loss_value if n not in pattern and order[n] < order[nll_bwd]), key=order.__getitem__
    )
    # An in-place reader moves too when all it writes is the loss or a value computed from it
    # (Hugging Face's MoE heads add the router's aux loss with `loss += coef * aux`): every reader
    # of what it writes is a reader of the loss, so it moves as well, in order. A write into
    # anything else (a running total made before the head) would land later than traced.
    derived = loss_value | set(getitems.values())
    for n in move:
        if n.op != "call_function" or any(w not in derived for w in mutated_nodes(n)):
            return f"{n.name} reads the loss before backward and writes in place to another value (not moved)"
    remove = sorted(pattern | {wt, *extra}, key=order.__getitem__)
    return _Head(
        x=x,  # type: ignore[arg-type]
        weight=weight,
        target=target,  # type: ignore[arg-type]
        grad_loss=grad_loss,
        nll=nll,
        nll_bwd=nll_bwd,
        loss=getitems.get(0),
        total_weight=getitems.get(1),
        grad_x=grad_x,
        grad_w=grad_w,
        module_from=mm,
        reduction=reduction,  # type: ignore[arg-type]
        ignore_index=int(ignore_index),  # type: ignore[arg-type]
        logits_dtype=logits_dtype,  # type: ignore[arg-type]
        tokens=tokens,
        vocab=vocab,
        d_model=xv.shape[1],
        remove=remove,
        likes=likes,
        move=move,
    )


def find_loss_heads(gm: fx.GraphModule) -> tuple[list[_Head], list[str]]:
    """The loss heads of ``gm`` the rewrite recognises, and for each other ``nll_loss_forward``
    why it is not one (a pure analysis)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    heads, why = [], []
    for n in gm.graph.nodes:
        if _is(n, [aten.nll_loss_forward.default]):
            m = _match(n, order)
            if isinstance(m, str):
                why.append(f"{n.name}: {m}")
            else:
                heads.append(m)
    return heads, why


def chunk_loss_heads(
    gm: fx.GraphModule,
    *,
    chunk_tokens: int | None = None,
    min_logits_bytes: int = MIN_LOGITS_BYTES,
    accelerator: bool | None = None,
) -> fx.GraphModule:
    """Replace each recognised loss head whose logits buffer (tokens x vocab in the
    log-softmax's dtype) is at least ``min_logits_bytes`` by a chunked ``linear_cross_entropy``
    of ``chunk_tokens`` tokens per chunk (None: :func:`default_chunk`). Returns ``gm``
    unchanged when there is nothing to rewrite.

    ``accelerator``: whether the step will run on an accelerator, which takes larger chunks
    (:func:`default_chunk`). None: where the head's weight is (its ``meta["val"]`` device), right
    for a step traced where it runs; a step traced on the CPU for another device (``spmd.plan``,
    ``spmd.simulate`` on a GPU profile) says so."""
    heads, why = find_loss_heads(gm)
    for w in why:
        log.info("spmd: loss head not chunked: %s", w)
    changed = False
    for head in heads:
        item = torch.empty((), dtype=head.lp_dtype).element_size()
        logits_bytes = head.tokens * head.vocab * item
        if logits_bytes < min_logits_bytes:
            log.debug("spmd: loss head %s: logits %d bytes, under the threshold", head.nll.name, logits_bytes)
            continue
        on_accelerator = accelerator
        if on_accelerator is None:
            device = getattr(head.weight.meta.get("val"), "device", None)
            on_accelerator = device is not None and device.type not in ("cpu", "meta")
        chunk = chunk_tokens or default_chunk(
            head.tokens, head.vocab, head.d_model, accelerator=on_accelerator
        )
        _rewrite(gm.graph, head, chunk)
        changed = True
    if not changed:
        return gm
    gm.graph.lint()
    gm.recompile()
    return gm


def _rewrite(graph: fx.Graph, head: _Head, chunk: int) -> None:
    nll_bwd = head.nll_bwd
    grad_loss = head.grad_loss
    for like in head.likes:  # value-free: the loss is computed later now
        v = like.meta["val"]
        fill = like.args[1] if like.target is aten.full_like.default else _LIKES[like.target]  # type: ignore[index]
        with graph.inserting_before(like):
            full = graph.call_function(
                aten.full.default,
                (list(v.shape), fill),
                {"dtype": v.dtype, "layout": torch.strided, "device": v.device, "pin_memory": False},
            )
        full.meta.update(like.meta)
        like.replace_all_uses_with(full)
        graph.erase_node(like)
        grad_loss = full if like is grad_loss else grad_loss
    vals = [head.x.meta["val"], head.weight.meta["val"], head.target.meta["val"], grad_loss.meta["val"]]
    consts = (chunk, head.reduction, head.ignore_index, head.logits_dtype)
    fake_mode = detect_fake_mode(vals)
    assert fake_mode is not None, "traced graphs carry fake values"
    with fake_mode:
        out_vals = LINEAR_CROSS_ENTROPY(*vals, *consts)
    with graph.inserting_before(nll_bwd):
        op = graph.call_function(LINEAR_CROSS_ENTROPY, (head.x, head.weight, head.target, grad_loss, *consts))
        outs = [graph.call_function(operator.getitem, (op, i)) for i in range(4)]
    n_chunks = -(-head.tokens // chunk)
    for n, v in zip([op, *outs], [out_vals, *out_vals]):
        copy_meta(n, nll_bwd, role=Role.ACTIVATION)
        n.meta[MODULE] = head.module_from.meta.get(MODULE, "")
        n.meta["val"] = v
    op.meta[WORKSPACE] = workspace_bytes(head.tokens, head.vocab, chunk, head.lp_dtype)
    rows = min(chunk, head.tokens)
    what = f"{head.tokens} tokens x vocab {head.vocab}, {n_chunks} chunk(s) of {rows}"
    op.meta[CHUNKED_LOSS] = f"loss head: {what}"
    for old, new in zip((head.loss, head.total_weight, head.grad_x, head.grad_w), outs):
        if old is not None:
            old.replace_all_uses_with(new)
    at = outs[-1]
    for n in head.move:  # readers of the loss: after it, in their order
        at.append(n)
        n.meta[PHASE] = op.meta[PHASE]
        at = n
    for out in outs:  # a frozen head's grad_W, an unused total_weight
        if not out.users:
            graph.erase_node(out)
    dead = set(head.remove)
    while True:
        erasable = [n for n in dead if not n.users]
        if not erasable:
            break
        for n in erasable:
            graph.erase_node(n)
            dead.discard(n)
    log.info(
        "spmd: %s (module %r): %s; the [tokens, vocab] logits never exist",
        op.name,
        op.meta[MODULE],
        op.meta[CHUNKED_LOSS],
    )
