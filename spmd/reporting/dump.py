"""Write every graph stage as readable Python, one file per stage and rank."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from passes import collectives as C
from passes.meta import (
    ASYNC_TP_CHUNK,
    CAST_OF,
    CHUNKED_LOSS,
    LAYOUT_FIX,
    MICROBATCH,
    MODULE,
    NODE_PLACEMENTS,
    PHASE,
    PLACEMENT,
    ROLE,
    STATE_NAME,
    TP_CHOICE,
    Phase,
)

if TYPE_CHECKING:
    from spmd.reporting.report import StepReport

log = logging.getLogger("spmd")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def annotated_code(gm: fx.GraphModule) -> str:
    """``gm``'s Python with a ``# phase | role | module`` comment on each line that computes a node
    (``# micro-batch i phase | ...`` in a step that accumulates gradients, and
    ``| cast of <name>`` on mixed-precision casts).

    Collectives also name the global ranks of their group (different shard groups of a hybrid
    mesh have different names), and a header lists how each parameter is distributed.
    """
    from spmd.parallel.expand_graph import describe_placements
    from spmd.parallel.plan import group_ranks
    from spmd.reporting.report import _size, dimension_of

    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    notes = {}
    # Steps that accumulate over micro-batches say which forward/backward each line is in.
    multi_micro = any(
        n.meta.get(MICROBATCH, 0) > 0 and n.meta.get(PHASE) is not Phase.OPTIMIZER for n in gm.graph.nodes
    )
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module", "placeholder"):
            phase, role = n.meta.get(PHASE), n.meta.get(ROLE)
            if phase is None and role is None:
                continue
            note = f"{getattr(phase, 'value', phase)} | {getattr(role, 'value', role)}"
            if multi_micro and phase is not Phase.OPTIMIZER:
                note = f"micro-batch {n.meta.get(MICROBATCH, 0)} {note}"
            if n.meta.get(MODULE):
                note += f" | {n.meta[MODULE]}"
            if n.meta.get(CAST_OF):  # a mixed-precision compute cast
                note += f" | cast of {n.meta[CAST_OF]}"
            if (pl := n.meta.get(NODE_PLACEMENTS)) is not None:  # DTensorExpandMode
                note += f" | {describe_placements(pl)}"
            if n.meta.get(CHUNKED_LOSS):  # passes.chunked_loss
                note += f" | {n.meta[CHUNKED_LOSS]}"
            if n.meta.get(LAYOUT_FIX):  # a copy into the traced layout (passes.layouts)
                note += " | layout fix-up"
            if (chunk := n.meta.get(ASYNC_TP_CHUNK)) is not None:  # passes.async_tp
                note += f" | async_tp chunk {chunk[0] + 1} of {chunk[1]}"
            if C.is_collective(n):  # which mesh dimension, how many bytes, which ranks
                note += f" | {dimension_of(C.group_of(n))}, {_size(C.bytes_of(n))}"
                if ranks := group_ranks(C.group_of(n)):
                    note += f", ranks {ranks}"
            notes[n.name] = note
    out = [
        f"# {n.meta[STATE_NAME]}: {n.meta[PLACEMENT]}"
        + (f"  (tp: {n.meta[TP_CHOICE]})" if n.meta.get(TP_CHOICE) else "")
        for n in gm.graph.nodes
        if n.op == "placeholder" and n.meta.get(PLACEMENT)
    ]
    if out:
        out.insert(0, "# parameters, as the partitioner distributed them:")
    for line in code.splitlines():
        stripped = line.strip()
        name = stripped.split(":", 1)[0].split("=", 1)[0].strip()
        if "=" in stripped and not stripped.startswith("#") and name in notes:
            line = f"{line}  # {notes[name]}"
        out.append(line)
    return "\n".join(out) + "\n"


def dump_stages(dump_dir: str, step_name: str, graphs: Mapping[str, fx.GraphModule]) -> str:
    """Write ``graphs`` to ``dump_dir/<step>/rank<r>/NN_<stage>.py``; returns that directory."""
    where = dump_where(dump_dir, step_name)
    for i, (stage, gm) in enumerate(graphs.items()):
        dump_graph(where, i, stage, gm, step_name)
    log.info("spmd: wrote %d graph stages to %s", len(graphs), where)
    return where


def dump_where(dump_dir: str, step_name: str) -> str:
    """This rank's directory of ``step_name``'s dump, ``dump_dir/<step>/rank<r>`` (created)."""
    where = os.path.join(dump_dir, step_name, f"rank{_rank()}")
    os.makedirs(where, exist_ok=True)
    return where


def dump_graph(where: str, index: int, stage: str, gm: fx.GraphModule, step_name: str) -> None:
    """Write ``gm`` as ``where/NN_<stage>.py`` (annotated Python)."""
    with open(os.path.join(where, f"{index:02d}_{stage}.py"), "w") as f:
        f.write(f"# stage {stage!r} of {step_name}: {len(gm.graph.nodes)} nodes\n")
        f.write(annotated_code(gm))


def dump_code(where: str, index: int, stage: str, code: str, *, source: str = "final") -> None:
    """Write a backend's generated code as the stage after the graphs: ``where/NN_<stage>.py``;
    ``source``: the stage the backend compiled."""
    with open(os.path.join(where, f"{index:02d}_{stage}.py"), "w") as f:
        f.write(f"# stage {stage!r}: the graph of stage {source!r} as the {stage} backend compiled it\n")
        f.write(code)


def remove_stale_stages(where: str, written: list[str]) -> None:
    """Remove the ``NN_<stage>.py`` files in ``where`` that are not in ``written`` (the dump's
    files now): left by an earlier dump of the step whose stages have since moved or been
    renamed (layout fix-ups added, the eager backend's graph kept)."""
    keep = set(written)
    for name in os.listdir(where):
        if re.fullmatch(r"\d\d+_\w+\.py", name) and name not in keep:
            os.remove(os.path.join(where, name))


def dump_report(where: str, report: StepReport) -> None:
    """Write ``report`` as ``report.json`` and ``report.txt`` into ``where`` (next to the stages)."""
    with open(os.path.join(where, "report.json"), "w") as f:
        f.write(report.to_json() + "\n")
    with open(os.path.join(where, "report.txt"), "w") as f:
        f.write(str(report) + "\n")


def dump_entry(dump_dir: str, step_name: str, entry: Any, *, stages: bool = True) -> None:
    """Write a compiled step's cache entry (``spmd.entry.Entry``): its stages (``stages``),
    the backend's code and, while it is a candidate, the eager backend's graph of an inductor
    step (as the two stages after the graphs), and the report. With ``stages``, files of stages
    no longer there are removed (a stage renamed or moved: fix-ups, the eager graph kept)."""
    from spmd.backend.runtime import ALT_STAGE, INDUCTOR_STAGE
    from spmd.reporting.report import entry_report

    where = dump_where(dump_dir, step_name)
    written = []
    if stages:
        dump_stages(dump_dir, step_name, entry.graphs)
        written = [f"{i:02d}_{name}.py" for i, name in enumerate(entry.graphs)]
    n = len(entry.graphs)
    if entry.lowered_code is not None:
        source = INDUCTOR_STAGE if INDUCTOR_STAGE in entry.graphs else "final"
        dump_code(where, n, entry.backend, entry.lowered_code, source=source)
        written.append(f"{n:02d}_{entry.backend}.py")
    alt = entry.exe.alt
    if alt is not None and INDUCTOR_STAGE not in entry.graphs:
        dump_graph(where, n + 1, ALT_STAGE, alt.gm, step_name)
        written.append(f"{n + 1:02d}_{ALT_STAGE}.py")
    if stages:
        remove_stale_stages(where, written)
    dump_report(where, entry_report(entry, "final"))
