"""MkDocs hook: serve ``passes/README.md`` (the pass invariants, kept next to the code) as the page ``passes.md``.

The file stays where contributors edit it; the site renders it without a copy in ``docs/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: Any) -> Files:
    text = (ROOT / "passes" / "README.md").read_text()
    files.append(File.generated(config, "passes.md", content=text))
    return files
