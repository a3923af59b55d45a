"""Graph queries every pass needs: which nodes an op writes to."""

from __future__ import annotations

import torch
import torch.fx as fx


def _flat_nodes(arg: object) -> list[fx.Node]:
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, list | tuple):
        return [n for a in arg for n in _flat_nodes(a)]
    return []


def mutated_nodes(node: fx.Node) -> list[fx.Node]:
    """The argument nodes that ``node`` writes to in place (``add_``, ``_foreach_mul_``, ``copy_``...)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out: list[fx.Node] = []
    schema = target._schema
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if a.kwarg_only or i >= len(node.args):
            val = node.kwargs.get(a.name)
        else:
            val = node.args[i]
        out.extend(_flat_nodes(val))
    return out


def is_mutated(node: fx.Node) -> bool:
    """Whether any user of ``node`` writes to it in place."""
    return any(node in mutated_nodes(u) for u in node.users)
