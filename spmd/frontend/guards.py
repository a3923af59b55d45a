"""Never run a stale graph: attribute guards and the cheap "nothing changed" test of a call.

A traced graph bakes in every plain attribute the step read from the model's modules
(``Dropout.p``, a float ``scale``, a bool flag the forward branches on, ``training``).
:func:`record_reads` collects those reads during the trace (``nn.Module.__getattribute__``
is patched for its duration only) as :class:`Guard` s; a cached graph is only reused
while all its guards hold, otherwise the step retraces (:class:`spmd.api.CompiledStep`).
The same goes for plain attributes of the objects modules hold that are neither modules
nor tensors (a Hugging Face ``config``: ``self.config.num_hidden_layers``,
``self.config._attn_implementation``): their classes' ``__getattribute__`` is patched for
the trace too. Writes to such objects do not go through ``nn.Module``, so their guards
(:attr:`Guard.on_module` false) are checked on every call, the fast path included.

:func:`module_version` is a process-wide counter bumped by anything that can change a
module tree between calls: attribute writes and deletes (which also cover swapped
submodules, replaced ``forward`` s, ``train()``/``eval()``), parameter, buffer and
submodule registration, ``_apply`` (``to()``, ``cuda()``, ``half()``), hook
registration on modules and the removal of any hook handle. While it has not moved
since the last call, that call's checks (structure walk, signature, guards) still hold,
which lets a cached step skip them (:class:`LastCall` in :mod:`spmd.backend.lastcall`). A bump is
only ever a reason to take the slow path, so counting too much is harmless; assigning the
object an attribute already holds (``model.train()`` on a training model) does not bump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils.hooks

from passes import torch_compat

log = logging.getLogger("spmd")

# Values a graph can bake in as constants; anything else (tensors, modules, containers)
# is covered by the signature, the structure check, or not read as a constant.
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
# Packages whose objects are not user state a forward branches on (meshes, process groups).
_NOT_CONFIG = ("torch", "spmd", "passes", "builtins")


def _is_plain(value: Any) -> bool:
    """A value a graph bakes in: a plain scalar, an enum member, a tuple of them (``Conv2d.padding``)."""
    t = type(value)
    if t in _PLAIN or isinstance(value, enum.Enum):
        return True
    return t is tuple and all(type(v) in _PLAIN or isinstance(v, enum.Enum) for v in value)


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types (``2`` does not match a traced ``2.0``; nor ``(2,)`` ``(2.0,)``)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


# nn.Module's own bookkeeping attributes (dicts, hook flags), set in every instance;
# ``training`` is the one plain attribute among them that forwards read.
_INTERNAL = frozenset(nn.Module().__dict__) - {"training"}
MISSING = object()

_version = [0]
_installed = [False]


def module_version() -> int:
    """A counter that moves whenever any module tree may have changed (see module docstring)."""
    return _version[0]


def _bumping(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _version[0] += 1
        return fn(*args, **kwargs)

    wrapper.__spmd_bumps__ = True  # type: ignore[attr-defined]
    return wrapper


def _setattr_bumping(fn: Any) -> Any:
    """``__setattr__`` that bumps only when the value is not the very object already there:
    ``model.train()`` on a model already training (every step, in many loops) stays free."""

    @functools.wraps(fn)
    def wrapper(self: nn.Module, name: str, value: Any) -> None:
        d = self.__dict__
        if name in d:
            same = d[name] is value
        else:
            same = False
            for kind in ("_parameters", "_buffers", "_modules"):
                members = d.get(kind)
                if members is not None and name in members:
                    same = members[name] is value
                    break
        if not same:
            _version[0] += 1
        fn(self, name, value)

    wrapper.__spmd_bumps__ = True  # type: ignore[attr-defined]
    return wrapper


_MODULE_METHODS = (
    "__delattr__",
    "register_parameter",
    "register_buffer",
    "register_module",
    "add_module",
    "_apply",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_backward_hook",
)


def install() -> None:
    """Patch the methods that change a module tree to bump :func:`module_version` (once)."""
    if _installed[0]:
        return
    for name in _MODULE_METHODS:
        fn = getattr(nn.Module, name)
        if not getattr(fn, "__spmd_bumps__", False):
            setattr(nn.Module, name, _bumping(fn))
    if not getattr(nn.Module.__setattr__, "__spmd_bumps__", False):
        nn.Module.__setattr__ = _setattr_bumping(nn.Module.__setattr__)  # type: ignore[method-assign]
    handle = torch.utils.hooks.RemovableHandle
    if not getattr(handle.remove, "__spmd_bumps__", False):
        handle.remove = _bumping(handle.remove)  # type: ignore[method-assign]
    _installed[0] = True


def global_hooks_key() -> tuple[int, ...]:
    """How many global module hooks are registered (``register_module_forward_hook`` & co.)."""
    return tuple(len(d) for d in torch_compat.global_module_hook_dicts())


@dataclasses.dataclass(frozen=True)
class Guard:
    """``module.<attr> == value`` (same type too) held when the graph was traced."""

    path: str  # the module's path in the model ("" for the root)
    attr: str
    value: Any
    namespace: dict[str, Any] = dataclasses.field(compare=False, repr=False)  # the module's __dict__
    # False for an attribute of a non-module object (a config): its writes do not bump
    # module_version, so the fast path checks this guard on every call.
    on_module: bool = True
    # The attribute must still hold this very object (a config object the trace read from:
    # replacing it, ``model.args = dataclasses.replace(model.args, ...)``, changes what it reads).
    same_object: bool = False

    def holds(self) -> bool:
        now = self.namespace.get(self.attr, MISSING)
        return now is self.value if self.same_object else _same(now, self.value)

    def describe(self) -> str:
        now = self.namespace.get(self.attr, MISSING)
        where = f"{self.path}.{self.attr}" if self.path else self.attr
        if self.same_object:
            return f"{where} was replaced (a new {type(now).__name__} object)"
        now_txt = "deleted" if now is MISSING else repr(now)
        return f"{where} changed from {self.value!r} to {now_txt}"


def first_failing(guards: list[Guard]) -> Guard | None:
    for g in guards:
        if not g.holds():
            return g
    return None


def snapshot(guards: list[Guard]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """A shallow copy of every namespace (module or config ``__dict__``) the guards read."""
    spaces = {id(g.namespace): g.namespace for g in guards if g.attr}
    return [(ns, dict(ns)) for ns in spaces.values()]


def restore(saved: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Put the attributes :func:`snapshot` copied back (added ones removed)."""
    for ns, copy in saved:
        for name in [n for n in ns if n not in copy]:
            del ns[name]
        ns.update(copy)


def _held_objects(
    module: nn.Module, depth: int = 2
) -> tuple[dict[int, tuple[str, Any]], list[tuple[str, str, dict[str, Any], Any, bool]]]:
    """Objects reachable from ``module``'s submodules' instance attributes (``config``, and
    ``config.text_config`` one level down) that are user state, with a path to each; and
    every place holding one: (holder path, attribute, holder ``__dict__``, object, holder is a module).

    Only instances of Python classes defined outside torch, with a ``__dict__``, count:
    not modules, tensors, containers, functions, classes or enum members.
    """
    found: dict[int, tuple[str, Any]] = {}
    holders: list[tuple[str, str, dict[str, Any], Any, bool]] = []
    frontier = [
        (name, attr, vars(m), value, True)
        for name, m in module.named_modules()
        for attr, value in vars(m).items()
        if attr not in _INTERNAL
    ]
    for _ in range(depth):
        nxt: list[tuple[str, str, dict[str, Any], Any, bool]] = []
        for holder in frontier:
            where, attr, _, obj, _ = holder
            t = type(obj)
            if (
                isinstance(obj, nn.Module | torch.Tensor | type | enum.Enum)
                or t.__module__.split(".", 1)[0] in _NOT_CONFIG
                or t.__module__.split(".", 1)[0] in sys.stdlib_module_names  # loggers, locks, ...
                or not isinstance(getattr(obj, "__dict__", None), dict)
            ):
                continue
            holders.append(holder)
            if id(obj) in found:
                continue
            path = f"{where}.{attr}" if where else attr
            found[id(obj)] = (path, obj)
            nxt.extend((path, a, vars(obj), v, False) for a, v in vars(obj).items())
        frontier = nxt
    return found, holders


def _patch_getattribute(cls: type, record: Any) -> Any:
    """Make ``cls.__getattribute__`` call ``record(self, name, value)``; returns an undo function."""
    had_own = "__getattribute__" in cls.__dict__
    own = cls.__dict__.get("__getattribute__")
    previous: Any = cls.__getattribute__

    def getattribute(self: Any, name: str) -> Any:
        value = previous(self, name)
        record(self, name, value)
        return value

    cls.__getattribute__ = getattribute  # type: ignore[method-assign,assignment]

    def undo() -> None:
        if had_own:
            cls.__getattribute__ = own  # type: ignore[method-assign,assignment]
        else:
            del cls.__getattribute__  # type: ignore[misc]

    return undo


@contextlib.contextmanager
def record_reads(module: nn.Module) -> Iterator[list[Guard]]:
    """Record every plain instance attribute of ``module``'s submodules, and of the
    non-module objects they hold (:func:`_held_objects`), read inside the block.

    The first read of each (object, attribute) decides the guarded value. Reads of a value
    the block itself wrote first are still recorded as read. A step that changes an
    attribute it reads (Hugging Face classifiers set ``config.problem_type`` in their first
    forward) leaves guards that fail right after the trace: ``spmd.api`` then traces once
    more and keeps that trace's guards (the values after the first call) where the second
    trace gives the same graph and changes nothing it reads.
    """
    paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    held, holders = _held_objects(module)
    seen: dict[tuple[int, str], Guard] = {}

    def record(self: Any, name: str, value: Any) -> None:
        if name[:2] == "__" or (id(self), name) in seen or not _is_plain(value):
            return
        module_path = paths.get(id(self))
        on_module = module_path is not None
        if module_path is not None:
            if name in _INTERNAL:
                return
            path = module_path
        elif id(self) in held:
            path = held[id(self)][0]
        else:
            return
        ns = object.__getattribute__(self, "__dict__")
        if name in ns:
            seen[(id(self), name)] = Guard(path, name, value, ns, on_module)
        elif not on_module and (id(self), "") not in seen:
            # Read through a property or a name map (HF's ``attribute_map``: ``n_layer`` ->
            # ``num_hidden_layers``), not found in __dict__: guard every plain attribute.
            seen[(id(self), "")] = Guard(path, "", None, {}, on_module)  # marks the object done
            for attr, v in list(ns.items()):
                if _is_plain(v) and attr[:2] != "__":
                    seen.setdefault((id(self), attr), Guard(path, attr, v, ns, on_module))

    guards: list[Guard] = []
    undo = [_patch_getattribute(nn.Module, record)]
    try:
        for cls in dict.fromkeys(type(obj) for _, obj in held.values()):
            try:
                undo.append(_patch_getattribute(cls, record))
            except TypeError:  # a class that cannot be patched: its reads stay unguarded
                log.debug("spmd: cannot guard attribute reads of %s", cls.__qualname__)
        yield guards
    finally:
        for u in reversed(undo):
            u()
        guards.extend(g for g in seen.values() if g.attr)
        read = {key[0] for key in seen}
        guards.extend(
            Guard(where, attr, obj, ns, on_module, same_object=True)
            for where, attr, ns, obj, on_module in holders
            if id(obj) in read
        )
        log.debug("spmd: %d attribute guards: %s", len(guards), [f"{g.path}.{g.attr}" for g in guards][:20])
