"""The check behind :func:`spmd.parallel.auto_tp.choose`: where does DTensor redistribute?

The forward of the traced step runs once on DTensors over the mesh's ``"tp"`` sub-mesh,
with the parameters placed as a candidate plan says and the plan's module boundaries, by the
same interpreter :func:`spmd.parallel.tensor_parallel.expand_tp` expands the step with
(:class:`spmd.parallel.expand_graph._Expander`): DTensor's own sharding strategies choose every
op's local form, so a candidate is checked by what will run, not by a rule table. Tensors are
fake (nothing is computed, nothing is sent), nothing is traced, and the run stops at the first
backward node. Each node that made DTensor issue a collective (redistributing its inputs, or
running on gathered inputs for want of a sharding strategy), or that DTensor could not
propagate at all, is returned: the caller knows which candidate region each lies in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication

from passes.meta import PHASE, ROLE, STATE_NAME, Phase, Role
from passes.torch_compat import StridedShard
from spmd.frontend.kernel_layouts import KernelLayoutFakeMode
from spmd.parallel import expand_rules
from spmd.parallel import plan as plan_mod
from spmd.parallel.auto_tp_graph import whole_statistic
from spmd.parallel.expand_graph import _Expander, _LocalView, _wrap

_ALL_REDUCE = torch.ops.c10d_functional.all_reduce
_GROUPED_MM = torch.ops.aten._grouped_mm.default


class _Stop(Exception):
    """Raised at the first node after forward: the check has seen what it needs."""


class _Probe(_Expander):
    """The expansion's interpreter, run eagerly on fake DTensors, recording per node whether
    DTensor communicated while fetching its inputs or running it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dirty: set[fx.Node] = set()

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "placeholder" and n.meta.get(PHASE) in (Phase.BACKWARD, Phase.OPTIMIZER):
            raise _Stop
        if n.op == "output":
            raise _Stop
        with CommDebugMode() as comm:
            try:
                out = super().run_node(n)
            except _Stop:
                raise
            except Exception:  # noqa: BLE001 - DTensor cannot propagate the candidate here
                self.dirty.add(n)
                raise _Stop from None
        if comm.get_total_counts() and not (
            self._completes_statistic(n, comm) or self._completes_row_output(n, comm)
        ):
            self.dirty.add(n)
        return out

    def _completes_row_output(self, n: fx.Node, comm: CommDebugMode) -> bool:
        """Whether ``n`` is a grouped (experts') matmul whose only collectives are all-reduces:
        of partial sums, a row-parallel output's (its own, or the previous layer's where the
        experts read it). No module style ends the experts' region, so the expansion reduces
        them at the matmul (``_Expander.call_function``); a split the op could not take would
        gather instead."""
        return n.target is _GROUPED_MM and set(comm.get_comm_counts()) == {_ALL_REDUCE}

    def _completes_statistic(self, n: fx.Node, comm: CommDebugMode) -> bool:
        """Whether ``n``'s only collectives are all-reduces of partial statistics over split
        features (:func:`spmd.parallel.auto_tp_graph.whole_statistic`): the small collective a
        norm over a column split's features needs, priced by the solve rather than refused."""
        if set(comm.get_comm_counts()) != {_ALL_REDUCE}:
            return False
        partial = [
            a
            for a in n.all_input_nodes
            if isinstance(self.env.get(a), DTensor)
            and any(isinstance(p, Partial) for p in self.env[a].placements)
        ]
        return bool(partial) and all(
            isinstance(a.args[0], fx.Node) and whole_statistic(a, a.args[0].meta["val"].shape[-1])
            for a in partial
        )


def dirty_nodes(
    gm: fx.GraphModule,
    module: nn.Module,
    mesh: Any,
    tp_plan: dict[str, Any],
    *,
    probe: Callable[..., _Probe] = _Probe,
) -> set[fx.Node]:
    """The forward nodes of ``gm`` where DTensor communicates (or fails) under ``tp_plan``
    (see the module docstring). A failure stops the run: its node is the last one returned.
    ``probe``: the interpreter that records them (a subclass may count only some collectives)."""
    from spmd.parallel.tensor_parallel import resolve_plan

    expand_rules.register()
    tp = plan_mod.tp_dim(mesh)
    assert tp is not None
    resolved = resolve_plan(module, tp_plan)
    view = _LocalView(mesh, plan_mod.data_dims(mesh))
    rep = (Replicate(),) * mesh.ndim

    def spec(pl: Any) -> tuple[Any, ...]:
        out = list(rep)
        out[tp] = pl
        return tuple(out)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake = KernelLayoutFakeMode(allow_non_fake_inputs=True)
    ins: list[Any] = []
    for ph in placeholders:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor):
            ins.append(val)
            continue
        pl: Placement = Replicate()
        if ph.meta.get(ROLE) is Role.PARAM:
            pl = resolved.params.get(str(ph.meta.get(STATE_NAME)), Replicate())
        shape = list(val.shape)
        if isinstance(pl, Shard | StridedShard):
            shape[pl.dim % len(shape)] //= mesh.size(tp)
        with fake:
            local = torch.empty(shape, dtype=val.dtype, device=val.device)
        inner = view.inner(spec(pl))
        assert inner is not None
        ins.append(_wrap(local, view.mesh, inner, val))
    param_pl = {
        str(ph.meta.get(STATE_NAME)): view.inner(
            spec(resolved.params.get(str(ph.meta.get(STATE_NAME)), Replicate()))
        )
        for ph in placeholders
        if ph.meta.get(ROLE) is Role.PARAM
    }
    boundaries = {
        f: tuple((x,) if x is not None else None for x in pls) for f, pls in resolved.layouts.items()
    }
    run = probe(
        gm,
        view.mesh,
        param_pl,
        {},
        view,
        reduce_local=False,
        boundaries=boundaries,
        replicate_unknown=True,
        vocab_parallel_loss=True,
    )
    try:
        with fake, implicit_replication(), torch.no_grad():
            run.run(*ins)
    except _Stop:
        pass
    return run.dirty
