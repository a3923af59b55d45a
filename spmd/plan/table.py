"""The plan's result: one :class:`PlanRow` per configuration lowered, and the :class:`Plan`
that holds them, judges them against a budget and prints them as a table."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from spmd.parallel.auto_tp import AUTO
from spmd.plan import search
from spmd.plan.space import code, parse_bytes, tp_summary
from spmd.reporting.report import PEAK_FROM_EAGER

__all__ = ["PlanRow", "Plan"]

_GiB = 2**30


@dataclasses.dataclass
class PlanRow:
    """One configuration and its predictions (per rank, per step)."""

    label: str  # short description of the configuration
    expression: str  # the spmd.compile(...) call that runs it
    options: dict[str, Any]  # DataParallel keyword arguments (and "remat" when searched)
    peak_bytes: int  # predicted peak memory per rank
    fits: bool | None  # peak <= memory_per_rank (None: no budget given)
    step_s: float  # predicted step time
    tokens_per_s: float  # tokens per second per device
    exposed_comm_s: float  # communication the compute waits for
    comm_s: float  # time of all collectives (overlapped or not)
    compute_s: float
    flops: float  # FLOPs of the step's ops with a torch.utils.flop_counter formula
    comm_bytes: int  # bytes of all collectives per rank
    lower_s: float  # time to lower this configuration here
    exact: bool = True  # lowered on the full model (False: extrapolated from folded copies)
    # the folded estimate {"peak_bytes", "step_s", ...} of a row later lowered exactly (else None)
    extrapolated: dict[str, float] | None = None
    # where the predicted peak is: (phase, module path) of the node running at it
    peak_site: tuple[str, str] = ("", "")
    # the loss heads passes.chunked_loss rewrote, in words (StepReport.loss_heads): their chunks
    # are the profile's device's (an accelerator's floor on a GPU profile)
    loss_heads: list[str] = dataclasses.field(default_factory=list)
    # which graph the peak (and the step time) is predicted from (StepReport.peak_from): with
    # backend="inductor", spmd's graph before inductor, which plans its own buffers
    peak_from: str = ""
    # bytes of the collectives per rank by mesh dimension ("tp", "dp_shard", "world", ...)
    comm_bytes_by_dim: dict[str, int] = dataclasses.field(default_factory=dict)
    # the mesh in words: "dp_shard 128 x tp 8" (the configuration's default mesh)
    mesh: str = ""
    # automatic tensor-parallel placements (tp_plan="auto"): one line per class of regions,
    # sharded or replicated and why (StepReport.tp_choices); empty otherwise
    tp_choices: list[str] = dataclasses.field(default_factory=list)

    @property
    def code(self) -> str:
        """:attr:`expression` with the imports it needs: one line of runnable Python."""
        return code(self.expression)


@dataclasses.dataclass
class Plan:
    """The searched configurations, fitting ones first, each group fastest first."""

    rows: list[PlanRow]
    world_size: int
    device: str
    tokens_per_step: int  # per rank
    memory_per_rank: int | None
    plan_s: float  # wall time of the whole plan
    traces: int  # traces taken (the rest reused one)
    profile: dict[str, Any]
    # the folded search: {"layers": dotted path of the blocks, "depth": their count, "folded": [L1, L2]}
    # (None: every row lowered on the full model)
    fold: dict[str, Any] | None = None
    # configurations spmd could not lower: (label, the error's first line)
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # configurations left out unlowered because their share of the parameters and optimizer
    # state alone is over the budget: (label, why)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # configurations of the grid not lowered: pass options of a partitioning outside the
    # ``refine`` best of each tp size, or remat policies past one that fits (refine=None lowers
    # them all)
    unsearched: int = 0
    refine: int | None = None
    # rows a folded search left extrapolated that confirm=None would have lowered on the full
    # model had it been cheap enough: (label, the estimated seconds)
    unconfirmed: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> PlanRow:
        """The fastest configuration that fits (the fastest one when none fits)."""
        return self.rows[0]

    def with_budget(self, memory_per_rank: int | str | None) -> Plan:
        """The same predictions judged against another memory budget (no new simulation)."""
        budget = parse_bytes(memory_per_rank)
        rows = [
            dataclasses.replace(r, fits=None if budget is None else r.peak_bytes <= budget) for r in self.rows
        ]
        rows.sort(key=lambda r: (r.fits is False, r.step_s, r.peak_bytes))
        return dataclasses.replace(self, rows=rows, memory_per_rank=budget)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def __str__(self) -> str:
        budget = f", memory per rank {self.memory_per_rank / _GiB:.1f} GiB" if self.memory_per_rank else ""
        head = (
            f"spmd plan: {self.world_size} ranks of {self.device}{budget}, {self.tokens_per_step} tokens per "
            f"rank per step; {len(self.rows)} configurations in {self.plan_s:.1f} s ({self.traces} trace(s))"
        )
        if self.fold is not None:
            l1, l2 = self.fold["folded"]
            exact = sum(r.exact for r in self.rows)
            head += (
                f"; {len(self.rows) - exact} row(s) extrapolated from {l1} and {l2} of the "
                f"{self.fold['depth']} blocks of {self.fold['layers']}, {exact} lowered exactly"
            )
        cols = [
            "#",
            "configuration",
            "mesh",
            "peak GiB",
            "fits",
            "step s",
            "tok/s/dev",
            "exposed comm s",
            "comm s",
        ]
        cols.append("lowered")
        table = [
            [
                str(i),
                r.label,
                r.mesh,
                f"{r.peak_bytes / _GiB:.2f}",
                {True: "yes", False: "no", None: "-"}[r.fits],
                f"{r.step_s:.4g}",
                f"{r.tokens_per_s:,.0f}",
                f"{r.exposed_comm_s:.3g}",
                f"{r.comm_s:.3g}",
                "exact" if r.exact else "extrapolated",
            ]
            for i, r in enumerate(self.rows)
        ]
        widths = [max(len(c), *(len(row[j]) for row in table)) for j, c in enumerate(cols)]
        lines = [head, "  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in table]
        heads = dict.fromkeys(h for r in self.rows for h in r.loss_heads)
        lines += [f"chunked {h} (on {self.device})" for h in heads]
        sources = dict.fromkeys(r.peak_from for r in self.rows if r.peak_from != PEAK_FROM_EAGER)
        lines += [f"peaks and step times predicted from {what}" for what in sources]
        auto = dict.fromkeys(
            f"tp {r.options['tp_size']}: auto: {tp_summary(r.tp_choices)}"
            for r in self.rows
            if r.options.get("tp_plan") == AUTO
        )
        lines += list(auto)
        lines += [f"not lowered: {label}: {why}" for label, why in self.failed]
        if self.skipped:
            lines.append(
                f"not lowered, over the budget on their state alone: {len(self.skipped)} "
                f"configuration(s): {search.skipped_words(self.skipped)}"
            )
        if self.unsearched:
            lines.append(
                f"pass options searched for the {self.refine} best partitioning(s) of each tp size only: "
                f"{self.unsearched} configuration(s) not lowered (refine=None lowers every one)"
            )
        for label, est in self.unconfirmed:
            if not self.best.exact and self.best.label == label:
                lines.append(
                    f"best row not lowered on the full model (at least {est:.0f} s here: the deeper copy's "
                    "lowering scaled to the depth, which the full model's outgrows; confirm=True lowers it)"
                )
                break
        lines.append(f"best: {self.best.code}")
        return "\n".join(lines)
