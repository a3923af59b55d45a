"""Small structural clean-ups."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.graph_utils import is_mutated
from passes.meta import GRAD_OF, ROLE, Role
from passes.ops import TAG_GRAD

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
