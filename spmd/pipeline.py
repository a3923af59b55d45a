"""The ordered pass list, with the reason for each position."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch.fx as fx

from passes.cleanup import strip_grad_tags
from passes.driver import NamedPass, run_passes
from spmd.errors import PassError
from spmd.parallel import ParallelMode


@dataclasses.dataclass
class Pipeline:
    passes: list[NamedPass]

    def run(
        self,
        gm: fx.GraphModule,
        *,
        disabled: Iterable[str] = (),
        check: bool = False,
        record: Callable[[str, fx.GraphModule], None] | None = None,
    ) -> fx.GraphModule:
        names = {p.name for p in self.passes}
        unknown = sorted(set(disabled) - names)
        if unknown:
            raise PassError(f"spmd: disabled_passes names unknown passes {unknown}; the passes are {sorted(names)}.")
        from passes.driver import PassFailure

        try:
            return run_passes(gm, self.passes, disabled=disabled, check=_checker() if check else None, record=record)
        except PassFailure as exc:
            raise PassError(str(exc)) from exc


def _checker() -> Callable[[fx.GraphModule, str], None]:
    def check(gm: fx.GraphModule, name: str) -> None:
        gm.graph.lint()

    return check


def build_pipeline(parallel_mode: ParallelMode) -> Pipeline:
    """The built-in passes, in order."""
    passes = [
        NamedPass(
            name="strip_grad_tags",
            fn=strip_grad_tags,
            reason="last: the partitioner and the passes before it find gradients by their tags",
        ),
    ]
    return Pipeline(passes)
