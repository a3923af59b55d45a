"""Refuse a tensor the step reads from outside: a global, a closure variable, or a plain
(non-buffer) attribute of a module.

The step is traced once on fake stand-ins of its arguments, parameters, buffers and optimizer
state; any other tensor it reads is a real tensor in the middle of a fake trace, and torch's
fake mode stops at the first op that mixes them ("Please convert all Tensors to FakeTensors").
spmd could lift such a tensor into the graph as a constant, but the graph would then keep the
value (or the very tensor object) it saw while tracing, and a later ``mask = new_mask`` in the
user's code would silently not be seen. So spmd refuses it, naming the variable and the two
fixes: pass it to the step as an argument, or register it as a buffer of the module (both are
then inputs of the graph, read at every call).
"""

from __future__ import annotations

import linecache
import os
import sysconfig
import types
from collections.abc import Iterator

import torch
import torch.nn as nn

from passes.torch_compat import FakeTensor
from spmd.errors import CapturedTensorError

_MARKER = "Please convert all Tensors to FakeTensors"


def is_captured_tensor_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is fake mode's refusal of a real tensor met during the trace."""
    return isinstance(exc, AssertionError) and _MARKER in str(exc)


def _real(v: object) -> bool:
    return isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor)


def is_internal_file(filename: str) -> bool:
    """Whether ``filename`` is torch's, spmd's or the standard library's (not the user's, nor a
    model library's such as ``transformers``)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    skip = (
        os.path.dirname(torch.__file__),
        root + os.sep + "spmd",
        root + os.sep + "passes",
        sysconfig.get_paths()["stdlib"] + os.sep,
    )
    return filename.startswith(skip) or "<" in filename


def _candidates(frame: types.FrameType, names: dict[int, str]) -> Iterator[tuple[str, str]]:
    """(name as the user wrote it, what it is) for each real tensor ``frame`` can reach by name."""
    code = frame.f_code
    local = frame.f_locals
    for name in (*code.co_varnames, *code.co_cellvars, *code.co_freevars):
        if _real(local.get(name)):
            kind = "a closure variable" if name in code.co_freevars else "a local variable"
            yield name, kind
    for name in code.co_names:
        if name not in local and _real(frame.f_globals.get(name)):
            yield name, f"a global of {os.path.basename(code.co_filename)}"
    self_ = local.get("self")
    if isinstance(self_, nn.Module):
        path = names.get(id(self_))
        for attr, v in vars(self_).items():
            if _real(v) and not attr.startswith("_"):
                where = f"module {path!r}" if path else f"a {type(self_).__name__}"
                yield f"self.{attr}", f"a plain tensor attribute of {where} (not a buffer)"


def captured_tensor_error(exc: BaseException, module: nn.Module) -> CapturedTensorError:
    """The refusal of the captured tensor ``exc`` met: names it where the traceback shows it."""
    names = {id(m): (n or type(module).__name__) for n, m in module.named_modules()}
    tb = exc.__traceback__
    frames = []
    while tb is not None:
        if not is_internal_file(tb.tb_frame.f_code.co_filename):
            frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    for frame, lineno in reversed(frames):  # innermost first
        found = list(dict.fromkeys(_candidates(frame, names)))
        if not found:
            continue
        line = linecache.getline(frame.f_code.co_filename, lineno).strip()
        on_line = [c for c in found if c[0].split(".")[-1] in line]
        found = on_line or found
        what = ", ".join(f"`{n}` ({kind})" for n, kind in found)
        return CapturedTensorError(
            f"spmd.compile: the train step reads a tensor that is not an argument, parameter or buffer: "
            f"{what}, at {frame.f_code.co_filename}:{lineno} ({line!r}). The step is traced once and "
            "runs as a graph whose inputs are its arguments and the model's and optimizer's state; a "
            "tensor captured from outside would be frozen into it, and later changes to it not seen. "
            "Pass it to the step as an argument (train_step(model, optim, x, y, mask)), or register it "
            "on the module as a buffer (module.register_buffer('mask', mask), persistent=False if it is "
            "not to be saved); a constant can also be created inside the step."
        )
    return CapturedTensorError(
        "spmd.compile: the train step reads a tensor that is not an argument, parameter or buffer "
        f"(fake mode: {exc}). Pass it to the step as an argument, or register it on the module as a buffer."
    )


__all__ = ["captured_tensor_error", "is_captured_tensor_failure", "is_internal_file"]
