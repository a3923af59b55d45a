"""The package tree's layering: imports between spmd's stages run one way, and passes never imports spmd.

Every module under ``spmd/`` belongs to one stage (:data:`STAGES`, in the order a step flows
through them; docs/architecture.md shows the same tree). A module may import its own stage and
the stages before it, never a later one: the front end knows nothing of the partitioner, no stage
imports the api, and nothing but the tools and ``spmd/__init__.py`` imports the tools (a tool's
command line, its ``__main__.py``, is an entry point like ``spmd/__init__.py`` and may import ``spmd``). Every
import counts, at module level, inside a function (a lazy import) or under ``TYPE_CHECKING``.
The imports are read with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Stage of each top-level name under spmd/ (a module or a package), in data-flow order.
STAGES: dict[str, int] = {
    "errors": 0,  # the exception hierarchy: every stage raises these
    "frontend": 1,  # the step's arguments, traced into one graph; guards and the cache key
    "parallel": 2,  # the parallel modes: partition the traced graph
    "profiles": 2,  # the device profiles (data): the automatic tp choice prices on them, as the tools do
    "pipeline": 3,  # the ordered passes over the partitioned graph
    "backend": 4,  # run the final graph (eager or inductor), call after call
    "reporting": 5,  # what a compiled step shows: the report, the dump
    "api": 6,  # spmd.compile and CompiledStep: drives the stages above
    "options": 6,  # spmd.compile's options and their checks (read by the api and the plan)
    "override": 6,  # spmd.Override: the user's stand-ins and graph hook, given to spmd.compile
    "entry": 6,  # a compiled step's cache entry (the api's record, read by report and dump)
    "simulate": 7,  # the tools, on top of the api
    "plan": 7,
    "calibrate": 7,
    "models": 7,
    "__init__": 8,  # the public surface
}
STAGE_NAMES = ["errors", "frontend", "parallel", "pipeline", "backend", "reporting", "api", "tools", "spmd"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module name ``path`` imports (absolute, relative imports resolved), with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from spmd import api` imports the module spmd.api, `from spmd.api import compile` spmd.api.
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def _stage_of(module: str) -> str | None:
    """The key in STAGES of a module name under spmd (None for anything else)."""
    parts = module.split(".")
    if parts[0] != "spmd":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else "__init__"


def _back_edges() -> list[str]:
    found = []
    for path in sorted((ROOT / "spmd").rglob("*.py")):
        rel = path.relative_to(ROOT / "spmd").parts
        # A command line (python -m spmd.simulate) is an entry point, like spmd/__init__.py.
        mine = STAGES.get("__init__" if path.name == "__main__.py" else rel[0].removesuffix(".py"))
        if mine is None:
            continue  # test_every_module_has_a_stage names it
        for name, line in _imports(path):
            theirs = _stage_of(name)
            if theirs is not None and STAGES[theirs] > mine:
                found.append(
                    f"{path.relative_to(ROOT)}:{line} ({STAGE_NAMES[mine]}) imports {name} "
                    f"({STAGE_NAMES[STAGES[theirs]]}, a later stage)"
                )
    return found


def test_every_module_has_a_stage() -> None:
    top = {p.name.removesuffix(".py") for p in (ROOT / "spmd").iterdir() if p.suffix == ".py" or p.is_dir()}
    top.discard("__pycache__")
    assert top - set(STAGES) == set(), "put the new module in a stage: STAGES here, docs/architecture.md"


def test_imports_between_stages_run_one_way() -> None:
    back = _back_edges()
    assert not back, "imports against the stage order:\n" + "\n".join(back)


def test_passes_never_imports_spmd() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / "passes").rglob("*.py"))
        for name, line in _imports(path)
        if name.split(".")[0] == "spmd"
    ]
    assert not found, "passes/ must not import spmd:\n" + "\n".join(found)
