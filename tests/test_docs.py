"""The documentation builds, and its runnable examples run, so the docs cannot drift from the code.

- ``mkdocs build --strict`` (the build ``make docs`` runs, warnings as errors): a broken link, a page
  missing from the site, or a ``::: spmd.X`` reference to a symbol that was renamed or removed fails,
  and so does a docstring griffe cannot parse (a documented parameter not in the signature).
- Every Python block marked runnable in README.md and docs/ runs: a fenced ```python block whose
  preceding line is ``<!-- runnable -->`` (an HTML comment: invisible on GitHub and in the site).
  All blocks run in one subprocess (one torch import), each in a fresh namespace with
  ``__name__ == "__main__"``, in a temporary working directory, at world size 1 (no ``RANK`` in the
  environment; a block that wants more ranks uses ``spmd.simulate``). A failure names the file and
  line of its block. The convention is documented in docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- runnable -->"
DEADLINE_S = 240  # each subprocess; generous because CI machines are shared (idle: ~10 s build, ~30 s blocks)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def runnable_blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the code's first line, code) of each block marked runnable in ``path``.

    A marker not directly followed by a ```python fence, or a block left unclosed, is an error:
    a typo must not silently drop an example from the suite."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        if i + 1 >= len(lines) or not re.fullmatch(r"```python\s*", lines[i + 1]):
            raise AssertionError(f"{path}:{i + 1}: {MARKER} must be followed by a ```python fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{path}:{i + 2}: runnable block has no closing fence")
        blocks.append((i + 3, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


NOT_RUN = ("<!-- fragment -->", "<!-- needs a GPU -->")  # the reasons a python block may give for not running
# Pages whose python blocks are not checked for a marker yet (the page is being rewritten).
UNMARKED_PAGES: set[str] = set()


def test_every_python_block_runs_or_says_why_not() -> None:
    """A ```python block is runnable, or marked as a fragment or as needing a GPU (docs/architecture.md)."""
    unmarked = []
    for path in doc_files():
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            before = lines[i - 1].strip() if i else ""
            if re.fullmatch(r"```python\s*", line) and before not in (MARKER, *NOT_RUN):
                unmarked.append(f"{rel}:{i + 1}")
    unmarked = [u for u in unmarked if u.split(":")[0] not in UNMARKED_PAGES]
    assert not unmarked, f"python blocks neither {MARKER} nor marked {' / '.join(NOT_RUN)}: {unmarked}"


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPMD_DUMP_DIR")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def test_docs_build_strict(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for page in (
        "index.html",
        "reference/spmd/index.html",
        "reference/passes/index.html",
        "passes/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), page
    # The API reference really was generated from the docstrings (not an empty page).
    api = (tmp_path / "site" / "reference" / "spmd" / "index.html").read_text()
    assert "Compile a whole train step" in api


def test_runnable_blocks_run(tmp_path: Path) -> None:
    blocks = [
        {
            "where": f"{path.relative_to(ROOT)}:{line}",
            "file": str(path.relative_to(ROOT)),
            "line": line,
            "code": code,
        }
        for path in doc_files()
        for line, code in runnable_blocks(path)
    ]
    assert any(b["where"].startswith("README.md:") for b in blocks), "README.md's example must be runnable"
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(blocks))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_docs", str(spec)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    failures = proc.stdout[proc.stdout.find("FAILED ") :] if "FAILED " in proc.stdout else proc.stdout
    assert proc.returncode == 0, f"runnable doc blocks failed:\n{failures[:8000]}\n{proc.stderr[-4000:]}"
    ran = re.findall(r"^ok (\S+)", proc.stdout, flags=re.M)
    assert ran == [b["where"] for b in blocks], proc.stdout


# Every other page that quotes a headline number of docs/performance.md's "Current numbers" table:
# (file, a regex whose groups are the number as that page writes it, the table's headline).
HEADLINE_QUOTES: list[tuple[str, str, str]] = [
    ("README.md", r"(\S+ / \S+) an eager step without communication", "bench GPT step, `replicate`"),
    ("README.md", r"DDP (\d\.\d+x), FSDP2 (\d\.\d+x)", "bench GPT step, DDP / FSDP2"),
    ("README.md", r"fully_shard peaks at (\d\.\d+x) FSDP2's memory", "bench GPT peak memory"),
    ("README.md", r"(\S+ / \S+) on an AVX-512", "on an AVX-512 EPYC"),
    ("README.md", r"but (\S+ / \S+) on this AVX2 one", "on this AVX2 EPYC"),
    ("README.md", r"step times within (\d+-\d+)%", "step time, 2 gloo"),
    ("docs/plan.md", r"\*\*Step time\*\*: within (\d+-\d+)%", "step time, 2 gloo"),
    ("README.md", r"on one H100 within (\d+)%", "step time, one H100"),
    ("README.md", r"the cost model within (\d+)% of the measured", "step time, one H100"),
    ("docs/plan.md", r"within (\d+)% on one H100", "step time, one H100"),
    ("docs/gpu-quickstart.md", r"cost model within (\d+)% of the measured", "step time, one H100"),
    ("README.md", r"peaks within (\S+)% of `MemTracker` here", "against `MemTracker`"),
    ("docs/plan.md", r"\*\*Peak memory\*\*: within (\S+)% of `MemTracker`", "against `MemTracker`"),
    ("README.md", r"and (\S+)% of the peak", "peak memory, one H100"),
    ("docs/plan.md", r"within (\S+)% of the\s+measured peak on one H100", "peak memory, one H100"),
    ("README.md", r"falling from about (\S+) at step 0 to about (\S+) after 400", "validation loss"),
    ("docs/index.md", r"falling from\s+about (\S+) to about (\S+) in 400 steps", "validation loss"),
    ("README.md", r"spmd's step (\d+)% faster than FSDP2's", "faster than FSDP2's by"),
    ("docs/gpu-quickstart.md", r"spmd's step (\d+)% faster than FSDP2's", "faster than FSDP2's by"),
    ("README.md", r"automatic placements included, searched in (\d+) s", "default search with tp"),
    ("docs/plan.md", r"placements \(175 configurations, 25 lowered\): (\d+) s", "default search with tp"),
    ("README.md", r"(\d+ of \d+) sweep cases", "CUDA parity sweep"),
    ("docs/gpu-quickstart.md", r"on (\d+ of \d+) cases", "CUDA parity sweep"),
    ("README.md", r"simulated ([\d. /]+) GiB per rank", "remat none / selective"),
    (
        "docs/remat.md",
        r"\| `None` \| ([\d.]+) GiB[^\n]*\n\| `\"selective\"` \| ([\d.]+) GiB[^\n]*\n(?:\| `\"op\"`[^\n]*\n)?"
        r"\| `0\.5` \| ([\d.]+) GiB[^\n]*\n\| `\"full\"` \| ([\d.]+) GiB",
        "remat none / selective",
    ),
]


def _numbers(text: str) -> list[str]:
    return re.findall(r"\d+(?:[.,]\d+)*", text)


def test_headline_numbers_agree() -> None:
    """A headline number quoted on several pages has one source, docs/performance.md's "Current
    numbers" table: every quote's numbers must be the table row's (found by a unique substring)."""
    page = (ROOT / "docs" / "performance.md").read_text()
    table = page.split("## Current numbers", 1)[1].split("\n\n## ", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ][1:]
    wrong = []
    for file, pattern, key in HEADLINE_QUOTES:
        matches = [value for headline, value in rows if key in headline]
        assert len(matches) == 1, f"{key!r} must name exactly one row of the table, found {len(matches)}"
        found = re.search(pattern, (ROOT / file).read_text())
        assert found, f"{file}: no quote matching {pattern!r} (the page changed: update HEADLINE_QUOTES)"
        quoted = _numbers(" ".join(found.groups()))
        if quoted != _numbers(matches[0]):
            wrong.append(f"{file}: {' '.join(found.groups())!r}, but docs/performance.md says {matches[0]!r}")
    assert not wrong, "headline numbers disagree:\n" + "\n".join(wrong)


def _run_blocks(spec: Path) -> int:
    """Run each block in a fresh namespace in its own temporary directory; print ``ok <where>`` for
    each that ran, then every failure with its traceback (naming the doc file and its line)."""
    import linecache

    failed: list[str] = []
    for block in json.loads(spec.read_text()):
        where, name = block["where"], block["file"]
        # Padded so line numbers in tracebacks (and in spmd's source annotations) are the doc's own.
        code = "\n" * (block["line"] - 1) + block["code"]
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as cwd:
            os.chdir(cwd)
            try:
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
            except BaseException:
                failed.append(f"FAILED {where}\n{traceback.format_exc()}")
                continue
            finally:
                os.chdir(spec.parent)
        print(f"ok {where} ({time.perf_counter() - start:.1f} s)", flush=True)
    print("".join(failed), end="", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_run_blocks(Path(sys.argv[1])))
