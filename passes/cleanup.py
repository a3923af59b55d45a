"""Small structural clean-ups."""

from __future__ import annotations

import torch
import torch.fx as fx

from passes.graph_utils import is_mutated
from passes.meta import GRAD_OF, MICROBATCH, MODULE, PHASE, ROLE, Role
from passes.ops import TAG_GRAD
from passes.torch_compat import DETACH_OPS

_aten = torch.ops.aten

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


# The metadata every traced node carries; a view with more (a gradient role, a unit, a layout
# fix-up) is something a pass or the report may look for, and is kept.
_PLAIN_META = frozenset({ROLE, PHASE, MODULE, MICROBATCH})


def identity_view_source(n: fx.Node) -> fx.Node | None:
    """The node whose tensor ``n`` is, layout and all, if ``n`` is such a view: ``detach`` or
    ``alias`` of it, or ``t`` of a ``t`` of it (sizes, strides, offset and storage unchanged)."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.target in DETACH_OPS:
        return n.args[0]
    inner = n.args[0]
    if n.target is _aten.t.default and inner.op == "call_function" and inner.target is _aten.t.default:
        src = inner.args[0]
        return src if isinstance(src, fx.Node) else None
    return None


def drop_identity_views(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every view that is its input's own layout (:func:`identity_view_source`) by the input.

    Legal: the view has its input's storage, sizes, strides and offset, so every reader reads the
    same values and every in-place writer writes the same memory; what goes is a tensor object,
    which no op of the graph tells apart from its input. Kept: a view the graph returns (the
    runtime hands its outputs to the caller, as ``.grad``s among others) and a view whose metadata
    says more than an activation's (``_PLAIN_META``: passes find gradients and units by theirs).
    A ``t`` whose only reader was the outer ``t`` of a dropped pair goes with it.

    Why: the eager backend calls each op from Python, about 1 us a call beyond its kernel, and
    backward is full of these (each weight gradient is ``detach(t(t(mm)))``: 3 of the ~1,400 calls
    a step on the bench's stack of small blocks).

    Invariant: afterwards no node but the kept ones is such a view (:func:`check_identity_views`).
    """
    graph = gm.graph
    changed = False
    for n in list(graph.nodes):
        src = identity_view_source(n)
        if src is None or not _droppable(n):
            continue
        inner = n.args[0]
        n.replace_all_uses_with(src)
        graph.erase_node(n)
        assert isinstance(inner, fx.Node)
        if inner is not src and not inner.users and _droppable(inner):
            graph.erase_node(inner)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    if left := check_identity_views(gm):
        raise RuntimeError(f"drop_identity_views left views it drops: {left}")
    return gm


def _droppable(n: fx.Node) -> bool:
    extra = {k for k in n.meta if k.startswith("spmd_")} - _PLAIN_META
    role = n.meta.get(ROLE, Role.ACTIVATION)
    return not extra and role in (Role.ACTIVATION, Role.UPDATE) and all(u.op != "output" for u in n.users)


def check_identity_views(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """:func:`drop_identity_views`' invariant, as ``(node name, message)`` violations."""
    return [
        (n.name, f"{n.target} is its input's own layout and was not dropped")
        for n in gm.graph.nodes
        if identity_view_source(n) is not None and _droppable(n)
    ]
