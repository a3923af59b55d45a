"""MkDocs hooks: serve ``passes/README.md`` (the pass invariants, kept next to the code) as the page
``passes.md``; drop Sphinx role prefixes from rendered docstrings.

The file stays where contributors edit it; the site renders it without a copy in ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def on_files(files: Files, config: Any) -> Files:
    text = (ROOT / "passes" / "README.md").read_text()
    files.append(File.generated(config, "passes.md", content=text))
    return files


# Docstrings use Sphinx roles (:class:`X`), which mkdocstrings' Google-style parser leaves as text
# (":class:" before the code). Show just the code.
_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub("", html)
