"""Refuse a train step that draws from numpy's or Python's global random generator while traced.

A value drawn on the host during the trace (``np.random.rand()``, ``random.uniform(0, 1)``) is a
Python number or array at that moment: the graph keeps it as a constant, or keeps the branch it
chose, and replays it on every call, where eager draws anew each step. Hugging Face's speech models
do this in training (SpecAugment masks from ``np.random`` in Whisper / Wav2Vec2, LayerDrop from
``np.random.random()`` in Wav2Vec2 / WavLM, ``random.uniform`` in MusicGen): compiled, the same
frames would be masked and the same layers dropped at every step, a silently different training.
torch's generator is not affected: its draws are graph ops, replayed with fresh values.

:func:`refuse_host_random` wraps the drawing functions of ``numpy.random`` (the global
``RandomState``) and of :mod:`random` while the trace runs; the first call raises
:class:`~spmd.errors.HostRandomError` naming the function, the module path and the source line.
A draw through an alias the wrappers cannot see (``from random import random`` bound before the
trace) is caught afterwards by comparing the generators' states, with a less precise message.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from spmd.errors import HostRandomError

# Methods of the global generators that do not draw.
_NOT_DRAWS = frozenset(
    {"seed", "getstate", "setstate", "get_state", "set_state", "get_bit_generator", "set_bit_generator"}
)
_SKIP_DIRS = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # spmd
    os.path.dirname(random.__file__) + os.sep + "random.py",
    os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py",
)


def _generators() -> list[tuple[str, Any, Any]]:
    """(name, module, the global generator instance) of Python's random and, if imported, numpy's."""
    out: list[tuple[str, Any, Any]] = [("random", random, random._inst)]  # type: ignore[attr-defined]
    np = sys.modules.get("numpy")
    if np is not None:
        out.append(("numpy.random", np.random, np.random.mtrand._rand))
    return out


def _state(gen: Any) -> Any:
    if hasattr(gen, "getstate"):
        return gen.getstate()
    kind, keys, pos, has_gauss, cached = gen.get_state()
    return kind, keys.tobytes(), pos, has_gauss, cached


def _where(module: nn.Module) -> str:
    """' in module X at file:line (code)' for the innermost caller outside torch, spmd, numpy, random."""
    names = {id(m): (n or type(module).__name__) for n, m in module.named_modules()}
    np_file = getattr(sys.modules.get("numpy"), "__file__", None)
    skip = _SKIP_DIRS + ((os.path.dirname(np_file),) if np_file else ())
    mod = None
    frame = None
    f: types.FrameType | None = sys._getframe(2)
    while f is not None:
        self_ = f.f_locals.get("self")
        if mod is None and isinstance(self_, nn.Module) and id(self_) in names:
            mod = names[id(self_)]
        if frame is None and not f.f_code.co_filename.startswith(skip):
            frame = traceback.FrameSummary(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    out = f" in module {mod!r}" if mod else ""
    if frame is not None:
        out += f" at {frame.filename}:{frame.lineno} ({frame.line!r})"
    return out


def _message(call: str, where: str) -> str:
    return (
        f"spmd.compile: the train step draws from {call}{where} while it is traced. The value drawn now "
        "would be baked into the graph (as a constant, or as the branch it chose) and replayed at every "
        "step, where eager draws anew. Draw it with torch (torch.rand, torch.bernoulli, torch.randperm: "
        "graph ops, fresh values each step), or draw it outside the step and pass it in as a tensor. "
        "Hugging Face speech models draw SpecAugment masks and LayerDrop with numpy in training: set "
        "config.apply_spec_augment=False and the layerdrop options to 0 (Wav2Vec2 also takes precomputed "
        "mask_time_indices)."
    )


def _refusing(label: str, fn: Callable[..., Any], module: nn.Module, others: list[str]) -> Callable[..., Any]:
    """``fn`` refused on the tracing thread; another thread of the program (a data-loading thread,
    say) draws as usual, and is recorded in ``others`` (its draws change the generator's state)."""
    tracing = threading.get_ident()

    def refused(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != tracing:
            others.append(label)
            return fn(*args, **kwargs)
        raise HostRandomError(_message(f"{label}()", _where(module)))

    return refused


@contextlib.contextmanager
def refuse_host_random(module: nn.Module) -> Iterator[None]:
    """While the body runs (the trace), drawing from the global numpy / Python generators raises
    :class:`HostRandomError`; a draw the wrappers missed is refused at exit from the state change."""
    gens = _generators()
    before = [_state(gen) for _, _, gen in gens]
    saved: list[tuple[Any, str, Any]] = []
    others: list[str] = []  # draws by other threads while the trace ran
    for label, mod, gen in gens:
        for name in dir(mod):
            fn = getattr(mod, name)
            if name.startswith("_") or name in _NOT_DRAWS or getattr(fn, "__self__", None) is not gen:
                continue
            saved.append((mod, name, fn))
            setattr(mod, name, _refusing(f"{label}.{name}", fn, module, others))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    changed = [label for (label, _, gen), st in zip(gens, before) if _state(gen) != st]
    if changed and not others:  # with another thread drawing, a state change is no evidence
        which = f"the global {' and '.join(changed)} generator"
        raise HostRandomError(_message(which, " (through an alias the check cannot locate)"))
