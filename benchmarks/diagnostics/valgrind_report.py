"""Read valgrind memcheck logs (``benchmarks/diagnostics/valgrind_hunt.sh``): errors by kind and by place.

    .venv/bin/python benchmarks/diagnostics/valgrind_report.py LOG...         # summary of the logs
    .venv/bin/python benchmarks/diagnostics/valgrind_report.py --supp LOG...  # their suppressions

The summary counts each log's error contexts by kind ("Invalid read", "Invalid write", "Invalid
free", "uninitialised", ...; memcheck prints an error once per context, and its ERROR SUMMARY line,
quoted, counts every occurrence), then lists every distinct error (kind and its innermost frames) with the
library it was raised in (gloo, c10d, libtorch, CPython, the loader, OpenMP, ...), how often, and
for an invalid access the block it hit (freed where, allocated where). ``--supp`` turns the
``--gen-suppressions=all`` blocks of a log into a suppressions file: each cut to its innermost
``--frames`` frames (so the same start-up error reached from another call path is suppressed
too) and named after its kind and innermost function.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass, field

_PREFIX = re.compile(r"^==(\d+)== ?(.*)$")
_FRAME = re.compile(r"^\s*(at|by) 0x[0-9A-F]+: (.*)$")
# The first line of an error (memcheck's wording), reduced to a kind.
_KINDS = [
    ("Invalid read", re.compile(r"^Invalid read of size")),
    ("Invalid write", re.compile(r"^Invalid write of size")),
    ("Invalid free", re.compile(r"^Invalid free\(\)")),
    ("Mismatched free", re.compile(r"^Mismatched free\(\)")),
    ("Overlapping memcpy", re.compile(r"^Source and destination overlap")),
    ("Uninitialised (jump)", re.compile(r"^Conditional jump or move depends on uninitialised")),
    ("Uninitialised (use)", re.compile(r"^Use of uninitialised value")),
    ("Uninitialised (syscall)", re.compile(r"^Syscall param .* uninitialised")),
    ("Syscall unaddressable", re.compile(r"^Syscall param .* unaddressable")),
    ("Fishy argument", re.compile(r"^Argument '.*' of function .* has a fishy")),
    ("Process terminating", re.compile(r"^Process terminating with default action of signal")),
]
# Where an error was raised: the innermost frame's function or object, first match wins.
_PLACES = [
    ("gloo", re.compile(r"gloo::|libgloo")),
    ("c10d", re.compile(r"c10d::")),
    ("libtorch", re.compile(r"libtorch|libc10|at::|c10::|torch::|dnnl|mkl")),
    ("OpenMP", re.compile(r"libgomp|libiomp|omp_|kmp")),
    ("loader", re.compile(r"ld-linux|\(dl-[\w-]+\.c:|_dl_")),
    ("glibc", re.compile(r"libc\.so|\(\w[\w-]*\.S:\d+\)|libc_start|libstdc\+\+|libgcc")),
    ("CPython", re.compile(r"libpython|\(\w+\.[ch]:\d+\)|python3")),
]


# The kinds a write to freed or out-of-bounds heap memory shows as.
_HEAP_KINDS = (
    "Invalid read",
    "Invalid write",
    "Invalid free",
    "Mismatched free",
    "Overlapping memcpy",
    "Syscall unaddressable",
)


def kind_of(line: str) -> str | None:
    for name, pat in _KINDS:
        if pat.search(line):
            return name
    return None


@dataclass
class Error:
    kind: str
    head: str
    frames: list[str] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)  # "Address ... free'd" and its stacks


@dataclass
class Log:
    path: str
    pid: str = ""
    command: str = ""
    errors: list[Error] = field(default_factory=list)
    summary: str = ""
    terminated: str = ""
    supps: list[list[str]] = field(default_factory=list)


def parse(path: str) -> Log:
    log = Log(path)
    cur: Error | None = None
    in_detail = False
    supp: list[str] | None = None
    with open(path, errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if supp is not None:
                supp.append(line)
                if line == "}":
                    log.supps.append(supp)
                    supp = None
                continue
            if line == "{":
                supp = [line]
                cur = None
                continue
            m = _PREFIX.match(line)
            if not m:
                continue
            log.pid, text = m.group(1), m.group(2)
            if text.startswith("Command: "):
                log.command = text[len("Command: ") :]
                continue
            if text.startswith("ERROR SUMMARY"):
                log.summary = text
                continue
            k = kind_of(text)
            if k is not None:
                cur = Error(k, text)
                in_detail = False
                if k == "Process terminating":
                    log.terminated = text
                log.errors.append(cur)
                continue
            if cur is None:
                continue
            fm = _FRAME.match(text)
            if fm:
                (cur.detail if in_detail else cur.frames).append(fm.group(2))
            elif text.strip() == "":
                cur = None
            else:  # "Address 0x.. is 8 bytes inside a block of size 64 free'd", "Block was alloc'd at"
                in_detail = True
                cur.detail.append(text.strip())
    return log


# Frames that only pass a call on (valgrind's allocator, glibc's system-call wrappers): an
# error is placed at the first frame after them.
_PASS_ON = re.compile(
    r"vgpreload|^(malloc|free|operator delete|memcpy|memmove)\b"
    r"|^(__\w+|send|recv|write|read|writev|readv|sendmsg|recvmsg) \(\w+\.c:\d+\)"
)


def place(frames: list[str]) -> str:
    """The library an error was raised in: the innermost frame that does more than pass a call on."""
    for fr in frames:
        if _PASS_ON.search(fr):
            continue
        for name, pat in _PLACES:
            if pat.search(fr):
                return name
        return "other"
    return "?"


def summarize(logs: list[Log], depth: int) -> str:
    out: list[str] = []
    total: collections.Counter[str] = collections.Counter()
    contexts: dict[tuple[str, tuple[str, ...]], list[Error]] = collections.defaultdict(list)
    for log in logs:
        kinds = collections.Counter(e.kind for e in log.errors)
        total.update(kinds)
        out.append(
            f"{log.path}: pid {log.pid} `{log.command[:100]}` | {log.summary or 'no ERROR SUMMARY (killed?)'}"
            + (f" | {log.terminated}" if log.terminated else "")
        )
        out.append("  contexts: " + (", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) or "no errors"))
        for e in log.errors:
            contexts[(e.kind, tuple(e.frames[:depth]))].append(e)
    out.append("TOTAL contexts: " + (", ".join(f"{k}: {n}" for k, n in sorted(total.items())) or "no errors"))
    heap = sum(n for k, n in total.items() if k in _HEAP_KINDS)
    out.append(f"heap error contexts ({', '.join(_HEAP_KINDS)}): {heap}")
    out.append(f"\n{len(contexts)} distinct errors (kind + innermost {depth} frames):")
    for (kind, frames), errs in sorted(contexts.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        out.append(f"\n[{kind}] x{len(errs)} in {place(list(frames))}: {errs[0].head}")
        out.extend(f"    {fr}" for fr in frames)
        for d in errs[0].detail[: 2 * depth + 2]:
            out.append(f"      | {d}")
    return "\n".join(out)


def suppressions(logs: list[Log], frames: int) -> str:
    seen: dict[tuple[str, ...], str] = {}
    for log in logs:
        for block in log.supps:
            body = [ln.strip() for ln in block[2:-1]]  # drop "{", the name placeholder and "}"
            tool, callers = body[0], body[1:]
            extra = []  # Memcheck:Param carries the syscall's parameter on its own line
            if tool == "Memcheck:Param" and callers:
                extra, callers = callers[:1], callers[1:]
            key = (tool, *extra, *callers[:frames])
            if key not in seen:
                first = next((c.split(":", 1)[1] for c in callers if c.startswith("fun:")), "obj")
                seen[key] = f"startup-noise-{tool.split(':')[1]}-{first}-{len(seen)}"
    out = [
        "# valgrind memcheck suppressions: the start-up noise that",
        "# `benchmarks/diagnostics/valgrind_hunt.sh noise`",
        "# recorded (import torch, torch.distributed and spmd, one matmul; no process group), cut to",
        "# the innermost frames by `benchmarks/diagnostics/valgrind_report.py --supp`.",
        "# See benchmarks/results/crashes.md, 'valgrind', for how each family was judged a false positive.",
    ]
    for key, name in seen.items():
        out.append("{")
        out.append(f"   {name}")
        out.extend(f"   {ln}" for ln in key)
        out.append("}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--supp", action="store_true", help="print the logs' suppressions, deduplicated")
    ap.add_argument("--frames", type=int, default=8, help="frames kept per suppression / shown per error")
    args = ap.parse_args(argv)
    logs = [parse(p) for p in args.logs]
    print(suppressions(logs, args.frames) if args.supp else summarize(logs, args.frames), end="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
