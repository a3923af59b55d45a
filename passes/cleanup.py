"""Small structural clean-ups."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.graph_utils import is_mutated
from passes.meta import GRAD_OF, ROLE, Role
from passes.ops import TAG_GRAD
from passes.torch_compat import DETACH_OPS

_T = torch.ops.aten.t.default
# The key of passes.optimizer_overlap's record on a split optimizer call (which names its inputs;
# that module imports this one).
_SPLIT_OF = "spmd_optimizer_split"

# node.meta flag on a tag that strip_grad_tag turned into a clone (it keeps its own node).
CLONED_TAG = "spmd_cloned_tag"


def strip_grad_tags(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every ``spmd::tag_grad(g, name)`` by ``g`` (or by a copy of ``g``).

    Legal because the tag is an identity. It is also a copy, and that copy matters
    when the step writes to the gradient in place (``clip_grad_norm_`` scales
    gradients with ``mul_``) while ``g`` is shared (autograd hands the same tensor to
    both inputs of an add): such tags become ``aten.clone`` rather than vanish.
    After this pass gradients are found by ``node.meta[ROLE] == Role.GRAD``. Run it
    after the partitioner, which consumes the tags. No-op when there are no tags.
    """
    tags = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TAG_GRAD]
    if not tags:
        return gm
    for n in tags:
        strip_grad_tag(gm.graph, n, keep_meta=True)
    gm.graph.lint()
    gm.recompile()
    return gm


def strip_grad_tag(graph: fx.Graph, n: fx.Node, *, keep_meta: bool = False) -> None:
    """Replace one tag by its input, or by a clone of it where the tag is written in place.

    ``keep_meta`` moves the tag's ``spmd_*`` metadata (its gradient role) to the node
    that takes its place.
    """
    if is_mutated(n):
        n.target = torch.ops.aten.clone.default
        n.args = (n.args[0],)
        n.meta[CLONED_TAG] = True
        if not keep_meta:
            n.meta.pop(GRAD_OF, None)
            n.meta[ROLE] = Role.ACTIVATION
        return
    src = n.args[0]
    assert isinstance(src, fx.Node)
    if keep_meta:
        for k in (k for k in n.meta if k.startswith("spmd_")):
            src.meta[k] = n.meta[k]
    n.replace_all_uses_with(src)
    graph.erase_node(n)


def untagged_name(n: fx.Node) -> str:
    """The name of the value a gradient tag stands for: ``n``'s own name, or, through tags and
    the clones :func:`strip_grad_tag` leaves, its input's. The same before and after
    ``strip_grad_tags``, so a record of which node a call reads survives the stripping."""
    while (n.target is TAG_GRAD or n.meta.get(CLONED_TAG)) and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n.name


def _identity_root(n: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The tensor ``n`` is a no-op view of, through ``detach`` and pairs of ``t``, and the views
    on the way (``n`` first; ``[]`` if ``n`` is none)."""
    chain: list[fx.Node] = []
    x = n
    while x.op == "call_function" and x.args and isinstance(x.args[0], fx.Node):
        src = x.args[0]
        if x.target in DETACH_OPS and len(x.args) == 1:
            chain.append(x)
            x = src
        elif (
            x.target is _T
            and src.op == "call_function"
            and src.target is _T
            and isinstance(src.args[0], fx.Node)
        ):
            chain += [x, src]
            x = src.args[0]
        else:
            break
    return x, chain


def fold_view_chains(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace ``detach(x)`` and ``t(t(x))`` (and chains of them) by ``x``.

    Autograd's trace leaves a ``detach`` on every gradient (AccumulateGrad's alias) and, in every
    linear layer's backward, ``t(t(weight))`` and ``t(t(mm(...)))``: on a deep stack of small
    linears a third of the graph's nodes, each a Python call and a new tensor object per step
    (~2 us each on a CPU) for nothing. Legal because each of these views has its input's sizes,
    strides, offset and storage: every reader sees the same memory the same way, so the results
    are the same bit for bit, and a write through either writes the same elements. The step runs
    without grad, so ``detach``'s ``requires_grad=False`` changes nothing either.

    Kept: a view the graph returns (the caller may hold the object), a view written in place, a
    view read by a split optimizer call (its record names its inputs: ``optimizer-split``), and
    a view that carries the gradient role (``spmd_role`` GRAD, found by later passes and the report)
    unless its input is used by nothing else (then the input takes the view's ``spmd_*`` metadata,
    as ``strip_grad_tag`` does). Run after ``strip_grad_tags`` (the tags sit between a gradient's
    ``detach`` and its readers until then). No-op when there is no such view.
    """
    erased: set[fx.Node] = set()
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n in erased:
            continue
        root, chain = _identity_root(n)
        if not chain or any(u.op == "output" or _SPLIT_OF in u.meta for u in n.users):
            continue
        if any(is_mutated(c) for c in chain):
            continue
        if n.meta.get(ROLE) is Role.GRAD and root.meta.get(ROLE) is not Role.GRAD:
            private = all(len(c.users) == 1 for c in chain[1:]) and len(root.users) == 1
            if not private or root.op != "call_function":
                continue
            for k in [k for k in root.meta if k.startswith("spmd_")]:
                del root.meta[k]
            root.meta.update({k: v for k, v in n.meta.items() if k.startswith("spmd_")})
        n.replace_all_uses_with(root)
        for c in chain:
            if not c.users:
                gm.graph.erase_node(c)
                erased.add(c)
    if not erased:
        return gm
    gm.graph.lint()
    gm.recompile()
    return gm
