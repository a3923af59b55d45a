"""The eager backend runs the final graph's own code with every operator bound once.

FX writes each call of the graph as ``torch.ops.aten.mm.default(a, b)``: four attribute lookups and
``OpOverload.__call__``, a Python frame whose only work is to call the C++ callable the overload
holds. On a graph of many small operators that is a large part of what a call costs beyond its
kernel, and it is a cost eager PyTorch's backward (run by the C++ autograd engine) never pays: on
the bench's overhead model (a 24-block ResMLP, ~1,400 calls a step) it was most of the 1.16-1.24x
that spmd's replicate step took over the eager step on a fake group.

:func:`bind_ops` compiles the GraphModule's generated code again with each ``torch.ops.<ns>.<op>.
<overload>(`` call replaced by a global bound to that overload's C++ callable
(:func:`passes.torch_compat.overload_callable`). The code is otherwise the same text, line for
line: the same operators with the same arguments in the same order, so the results are the same
bits, and a failing line reads ``name = ...`` as before, which is how
:func:`spmd.backend.runtime._failing_node` names the node that raised. The file name keeps FX's
``<eval_with_key>`` prefix, and the source is in :mod:`linecache` for tracebacks.

The code runs below the Autograd dispatch keys (``torch._C._AutoDispatchBelowAutograd``, as
autograd's own kernels call the ops they wrap). The runtime runs the graph under ``no_grad``,
where those kernels record nothing; skipping them skips a layer per call (a Python one for the
functional collectives and their waits, ``torch.library.register_autograd``: 4.5 us a
``wait_tensor`` against 0.55 us below it). ``ADInplaceOrView`` still runs: in-place ops bump
version counters and views keep their base, as under ``no_grad``.
"""

from __future__ import annotations

import functools
import itertools
import linecache
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes.torch_compat import AutoDispatchBelowAutograd, OpOverload, overload_callable

# FX's text for a call of an OpOverload target (``_get_qualified_name``): torch.ops.<ns>.<op>.<overload>(
_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_serial = itertools.count()


def _overload(namespace: str, name: str, overload: str) -> OpOverload | None:
    packet = getattr(getattr(torch.ops, namespace), name, None)
    op = getattr(packet, overload, None)
    return op if isinstance(op, OpOverload) else None


def bind_ops(gm: fx.GraphModule) -> Callable[..., Any]:
    """A callable running ``gm``'s current code (``gm(*args)`` without ``nn.Module.__call__``)
    with each operator call bound to the overload's C++ callable, below the Autograd dispatch
    keys. Build it again after ``gm.recompile()``; it holds ``gm`` (its ``self``)."""
    source = gm.code
    env = dict(gm.forward.__globals__)  # FX's globals for this code (torch, fx_pytree, ...)
    aliases: dict[str, str] = {}  # "torch.ops.aten.mm.default" -> its global's name

    def bind(m: re.Match[str]) -> str:
        op = _overload(*m.groups())
        if op is None:  # not an OpOverload (a higher-order operator): left as FX wrote it
            return m.group(0)
        name = m.group(0)[:-1]
        if name not in aliases:
            aliases[name] = f"_spmd_op{len(aliases)}"
            env[aliases[name]] = overload_callable(op)
        return aliases[name] + "("

    code = _CALL.sub(bind, source)
    filename = f"<eval_with_key>.spmd_bound_{next(_serial)}"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    exec(compile(code, filename, "exec"), env)
    forward = env["forward"]

    @functools.wraps(forward)  # run.__wrapped__: the compiled code's function
    def run(*args: Any) -> Any:
        with AutoDispatchBelowAutograd():
            return forward(gm, *args)

    weakref.finalize(run, linecache.cache.pop, filename, None)
    return run
