"""A compiled step's cache entry: the executable, its stages and the compile's facts that the
graph does not hold (read by ``report()``, the dump and the fast path of an unchanged call), and
the two edits its stages get after the first run (layout fix-ups, inductor's step-aside)."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from passes.stages import Stages
from spmd.backend.runtime import INDUCTOR_STAGE, Executable
from spmd.backend.step_aside import EAGER
from spmd.frontend import guards

__all__ = ["Entry"]


@dataclasses.dataclass
class Entry:
    exe: Executable
    graphs: Stages
    # For report(): the compile's facts that the graph does not hold.
    world_size: int = 1
    parallel_style: str = ""
    trace_s: float | None = None
    compile_s: float | None = None
    backend: str = "eager"
    lower_s: float | None = None  # the backend's compile time (part of compile_s)
    lowered_code: str | None = None  # the backend's generated code (None for eager)
    lower_role: str | None = None  # shared compile: "alone", "leader" or "follower" (None for eager)
    lower_wait_s: float | None = None  # a follower's wait for its leader (part of lower_s)
    remat: str | float | None = None  # the remat policy the graph was built with
    inductor_fallback: str | None = None  # backend="inductor": "measure" or "never" (None for eager)
    # Plain module attributes the trace read (spmd.frontend.guards): the graph is reused only while they hold.
    attr_guards: list[guards.Guard] = dataclasses.field(default_factory=list)

    def record_layout_fix(self, gm: fx.GraphModule) -> None:
        """The first run inserted layout fix-ups into the final graph: show them as a stage."""
        del self.graphs["final"]
        self.graphs.record("fix_layouts", gm)
        self.graphs["final"] = gm

    def decided(self, kept: str) -> None:
        """An inductor step's measurement kept ``kept``. With eager kept, ``final`` becomes the
        graph that runs from now on, the eager backend's (``exe.alt``), and the inductor
        pipeline's graph stays as the stage before it, :data:`INDUCTOR_STAGE`."""
        alt = self.exe.alt
        if kept == EAGER and alt is not None:
            inductor_gm = self.graphs["final"]
            del self.graphs["final"]
            self.graphs[INDUCTOR_STAGE] = inductor_gm
            self.graphs["final"] = alt.gm
