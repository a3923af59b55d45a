"""passes/torch_compat.py: every private torch name spmd uses still exists, and nobody else touches one.

The first tests fail naming the entry a torch release removed; the last one scans the source of ``spmd/``,
``passes/`` and ``examples/`` (not ``tests/`` or ``benchmarks/``: tests may reach into torch to build their
fixtures, and they do not ship) and fails naming each module and line that uses a private torch name
itself instead of importing it from the compat module.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from typing import Any

import torch

from passes import torch_compat
from passes.torch_compat import PRIVATE_ATTRIBUTES, PRIVATE_NAMES, PRIVATE_OPS, Private

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("spmd", "passes", "examples")
COMPAT = ROOT / "passes" / "torch_compat.py"

# Private names of other libraries, not torch's: where they come from.
NOT_TORCH = {
    "_getframe": "sys._getframe",
    "_inst": "random._inst",
    "_rand": "numpy.random.mtrand._rand",
    "_experts_implementation": "a transformers config field",
    "_supports_sdpa": "a transformers model class attribute (spmd.models: eager where it is False)",
}

# Attributes that only instances carry: an instance to look them up on.
SAMPLES = {
    "torch._ops.OpOverload": lambda: torch.ops.aten.add.Tensor,
    "torch.nn.Module": lambda: torch.nn.Linear(1, 1),
}


def _missing_names(entries: dict[str, Private]) -> list[str]:
    missing = []
    for name, entry in entries.items():
        try:
            entry.resolve()
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} = {entry.module}.{entry.attr or ''} (checked on {entry.checked}): {e}")
    return missing


def _resolve_dotted(path: str) -> Any:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(path)


def test_every_private_name_resolves() -> None:
    missing = _missing_names(PRIVATE_NAMES)
    assert not missing, (
        f"torch {torch.__version__} lacks private names spmd uses; give passes/torch_compat.py a branch "
        "for this version:\n" + "\n".join(missing)
    )


def test_a_missing_name_is_named() -> None:
    assert _missing_names({"gone": Private("torch", "_no_such_name")}) == [
        f"gone = torch._no_such_name (checked on {torch_compat.CHECKED}): "
        "module 'torch' has no attribute '_no_such_name'"
    ]


def test_every_private_attribute_exists() -> None:
    missing = []
    for attr, (owner, checked) in PRIVATE_ATTRIBUTES.items():
        obj = SAMPLES[owner]() if owner in SAMPLES else _resolve_dotted(owner)
        if not hasattr(obj, attr):
            missing.append(f"{owner}.{attr} (checked on {checked})")
    assert not missing, f"torch {torch.__version__} lacks private attributes spmd uses: {missing}"


def test_every_private_op_exists() -> None:
    missing = [
        op for op in PRIVATE_OPS if not hasattr(getattr(torch.ops, op.split(".")[0]), op.split(".")[1])
    ]
    assert not missing, f"torch {torch.__version__} lacks the operators {missing} (passes/torch_compat.py)"


def test_lazy_names_resolve_through_the_module() -> None:
    assert torch_compat.compile_fx is PRIVATE_NAMES["compile_fx"].resolve()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> dict[pathlib.Path, ast.Module]:
    files = [f for d in SCANNED for f in sorted((ROOT / d).rglob("*.py")) if f != COMPAT]
    return {f: ast.parse(f.read_text(), str(f)) for f in files}


def _our_names(trees: dict[pathlib.Path, ast.Module]) -> set[str]:
    """Every name our own code defines: a private attribute with one of these names is ours."""
    names: set[str] = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    names.add(n.attr)
            elif isinstance(n, ast.arg) or isinstance(n, ast.keyword) and n.arg:
                names.add(n.arg)
            elif isinstance(n, ast.alias):
                names.add((n.asname or n.name).split(".")[0])
    return names


def private_torch_uses(trees: dict[pathlib.Path, ast.Module]) -> list[str]:
    """``file:line: name`` for each private torch name used outside the compat module."""
    ours = _our_names(trees) | set(NOT_TORCH) | {op.split(".")[1] for op in PRIVATE_OPS}
    ops_namespaces = {op.split(".")[0] for op in PRIVATE_OPS}
    found = []
    for f, tree in trees.items():
        where = f.relative_to(ROOT)
        torch_alias: dict[str, str] = {}  # local name -> the torch path it stands for
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] == "torch":
                        if any(_private(p) for p in a.name.split(".")):
                            found.append(f"{where}:{n.lineno}: import {a.name}")
                        torch_alias[a.asname or "torch"] = a.name if a.asname else "torch"
            elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "torch":
                for a in n.names:
                    full = f"{n.module}.{a.name}"
                    if any(_private(p) for p in full.split(".")):
                        found.append(f"{where}:{n.lineno}: from {n.module} import {a.name}")
                    torch_alias[a.asname or a.name] = full
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _private(n.attr):
                chain, base = [], n
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in torch_alias:
                    full = ".".join([torch_alias[base.id], *reversed(chain)])
                    ns = full.split(".")[2] if full.startswith("torch.ops.") else ""
                    if ns not in ops_namespaces and n.attr not in ours:
                        found.append(f"{where}:{n.lineno}: {full}")
                elif n.attr not in ours:
                    found.append(f"{where}:{n.lineno}: .{n.attr}")
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(n.args) > 1
                and isinstance(n.args[1], ast.Constant)
                and isinstance(n.args[1].value, str)
                and _private(n.args[1].value)
                and n.args[1].value not in ours
            ):
                found.append(f"{where}:{n.lineno}: {n.func.id}(..., {n.args[1].value!r})")
    return sorted(set(found))


def test_no_private_torch_name_outside_the_compat_module() -> None:
    found = private_torch_uses(_sources())
    assert not found, (
        "these modules use a private torch name themselves; add it to passes/torch_compat.py (with the "
        "versions it was checked on) and import it from there:\n" + "\n".join(found)
    )


def test_the_scan_sees_each_kind_of_private_use() -> None:
    src = (
        "import torch\nimport torch.distributed as dist\nfrom torch._guards import detect_fake_mode\n"
        "torch.compiler._is_compiling_flag = True\ndist.distributed_c10d._get_default_group()\n"
        "mesh._flatten()\ngetattr(mesh, '_flatten')\nimport torch.testing._internal.common_utils\n"
    )
    found = private_torch_uses({ROOT / "spmd" / "example.py": ast.parse(src)})
    assert [line.split(": ", 1)[1] for line in found] == [
        "from torch._guards import detect_fake_mode",
        "torch.compiler._is_compiling_flag",
        "torch.distributed.distributed_c10d._get_default_group",
        "._flatten",
        "getattr(..., '_flatten')",
        "import torch.testing._internal.common_utils",
    ]
