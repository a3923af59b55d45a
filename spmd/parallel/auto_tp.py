"""Automatic tensor-parallel placements: the plan chosen from the traced step.

This module solves and writes the plan; :mod:`spmd.parallel.auto_tp_graph` finds the candidates in
the graph, :mod:`spmd.parallel.auto_tp_check` checks them with DTensor.

``DataParallel(style, tp_size=N)`` (or a mesh with a ``"tp"`` dimension) without a
``tp_plan`` (or with ``tp_plan="auto"``) calls :func:`choose` once per model, before the
model is distributed. The traced graph has single-device semantics on full-size state
whatever the placements, so the api traces the step on the undistributed model first
(:meth:`spmd.api.CompiledStep._entry`), this module chooses, and the choice is written as a
plan in the manual form (:func:`spmd.parallel.tensor_parallel.resolve_plan`: module name
patterns to ``ColwiseParallel``/``RowwiseParallel``, parameter names to a ``Placement``).
From there the manual path runs unchanged: ``prepare`` distributes the state with the plan
and the step is traced again on it (a second trace: the lifted state is other tensors then,
so reusing the first trace would mean re-keying every placeholder; a trace is seconds).

How it chooses, from the graph (never from module names or types):

1. **Candidates.** A *parameter matmul* is an ``mm``/``addmm`` (or experts' ``_grouped_mm``,
   a 3-D weight) whose second operand is a parameter, directly (GPT-2's ``Conv1D``, weight
   ``(in, out)``) or through a transpose (``nn.Linear``, weight ``(out, in)``); casts and views
   in between are followed. From each
   one's output the forward dataflow is followed through every op until it reaches another
   parameter matmul's activation operand (a *consumer*), the loss (``log_softmax`` /
   ``nll_loss``) or a *stop*: a reduction or a normalisation (which mixes the features a
   column split would divide), or a graph output. Producers whose flow ends only in consumers
   form, with those consumers, a **column -> row region** (q/k/v -> o, gate/up -> down, a
   fused qkv -> proj, GPT-2's ``c_fc`` -> ``c_proj``; GQA's ``repeat_kv`` and attention are
   ops on the way). A producer whose flow ends only in the loss is a **vocabulary-parallel
   head**; an ``embedding`` of a parameter indexed by the step's inputs (token ids, not a
   range of positions or a buffer of token types) is a **vocabulary-parallel embedding**. Everything
   else (a matmul whose output reaches a norm first, norms, biases of row-parallel layers)
   replicates.
2. **Repeated blocks solved once.** Regions with the same structure (the shapes and split
   dimensions of their parameters, the ops on their flow) form one class, e.g. the attention
   of every decoder layer; a class is sharded or replicated as a whole, so every layer gets
   the same choice. Regions that share a parameter (a tied embedding and head) decide together.
3. **Checked by DTensor.** All candidate classes are placed at once and the forward of the
   step runs on DTensors over the tp sub-mesh (fake tensors: nothing is computed) with the
   same expansion :func:`~spmd.parallel.tensor_parallel.expand_tp` uses. A class is *clean*
   when DTensor's own sharding propagation runs every op of its flow without a
   redistribution: the only collectives are the ones the split itself needs, outside the
   flow (the row output's all-reduce, the loss's). A class whose flow needs one (a fused qkv
   split unevenly over heads, a key/value head count tp does not divide, an op with no
   sharding rule, which runs on gathered inputs) is replicated, and the check runs again
   without it (at most once per class).
4. **Priced and decided** (:mod:`spmd.parallel.auto_tp_solve`). Each clean class is priced per
   rank: bytes of parameters, gradients and optimizer state saved (``1 - 1/tp`` of them),
   activation bytes saved on its flow, matmul time saved (forward and backward) and the time of
   the collectives the split adds (Megatron's minimum: a column -> row region one all-reduce of
   its output in forward and one of its input gradient in backward; an embedding one in
   forward; a head one in backward plus three small ones of the loss), on the device profile
   the step is lowered for. It is sharded where that saves time, or saves memory for at most 5%
   of the step's time; else replicated. Without a profile it is sharded (the tp degree asks for
   the split). The prices are what the report, the dump and the INFO log show as the reason.

5. **Sequence parallelism.** Between the sharded regions (norms, residual adds, the embedding's
   output, the final norm) the values are split on the sequence where every op there is token-wise
   (checked by the same DTensor run), as torchtitan's sequence-parallel plan writes it: one choice
   for the whole residual stream (:mod:`spmd.parallel.auto_tp_sp`).

The choice is deterministic: it reads only the graph (node order is the trace's), the shapes
and the profile, so every rank chooses the same plan. Cost: one forward expansion per round
(usually one) and one for sequence parallelism, one cost-model pass over the step, no solver.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Placement, Replicate, Shard

from passes.cost_model import DeviceProfile
from passes.meta import MODULE, ROLE, STATE_NAME, Role
from passes.torch_compat import StridedShard
from spmd.errors import ConfigError
from spmd.parallel.auto_tp_graph import Region, act_of, find_regions, mm_flops, nbytes

log = logging.getLogger("spmd")

aten = torch.ops.aten
AUTO = "auto"

# model -> its automatic choice (what prepare and the partitioner read, and tp_plan_of shows)
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, AutoPlan] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class Price:
    """What one region saves and adds per rank (bytes, FLOPs per step)."""

    state_bytes: int = 0  # parameters + gradients + optimizer state saved
    activation_bytes: int = 0  # forward values of the flow saved
    flops: int = 0  # matmul FLOPs saved, forward and backward
    collectives: int = 0  # collectives added
    collective_bytes: int = 0
    comms: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (kind, bytes) of each

    def __iadd__(self, o: Price) -> Price:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(o, f.name))
        return self


@dataclasses.dataclass
class Decision:
    """One class of identical regions (a repeated block's attention, MLP...) and its choice."""

    regions: list[Region]
    sharded: bool
    price: Price  # for all its regions together
    why: str

    def describe(self) -> str:
        r = self.regions[0]
        names = ", ".join(_short(p) for p in r.col)
        if r.row:
            names = (
                f"{names} -> {', '.join(_short(p) for p in r.row)}"
                if names
                else ", ".join(_short(p) for p in r.row)
            )
        words = {
            "pair": "column -> row",
            "head": "vocabulary-parallel head",
            "embedding": "vocabulary-parallel embedding",
        }
        kinds = list(dict.fromkeys(x.kind for x in self.regions))
        what = " and tied ".join(words[k] for k in kinds)
        n = f" (x{len(self.regions)})" if len(kinds) == 1 and len(self.regions) > 1 else ""
        verdict = "sharded" if self.sharded else "replicated"
        return f"{names}{n}: {what}, {verdict}: {self.why}"


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """The automatic choice for one model.

    ``plan``: the equivalent manual plan (``DataParallel(tp_plan=plan)`` runs the same step);
    ``placements``: each sharded parameter's placement on tp; ``reasons``: parameter fqn -> why
    (the line of its candidate class, sharded or replicated); ``decisions``: every class;
    ``solve_s``: seconds the choice took (the trace excluded).
    """

    plan: dict[str, Any]
    placements: dict[str, Placement]
    reasons: dict[str, str]
    decisions: list[Decision]
    solve_s: float

    def summary(self) -> str:
        lines = [d.describe() for d in self.decisions]
        return "\n".join(lines) if lines else "nothing to shard: every parameter replicates"


def chosen(module: nn.Module) -> AutoPlan | None:
    """The automatic choice made for ``module`` (None: none made)."""
    return _CHOSEN.get(module)


def adopt(module: nn.Module, choice: AutoPlan) -> None:
    """Remember ``choice``, made for a model of ``module``'s structure and the same tp degree, as
    ``module``'s (``spmd.plan``'s copies of one model: one choice per trace and tp degree)."""
    _CHOSEN[module] = choice


def chosen_plan(module: nn.Module) -> dict[str, Any]:
    """The plan chosen for ``module``; a ConfigError naming the fix if none was chosen yet."""
    choice = _CHOSEN.get(module)
    if choice is None:
        raise ConfigError(
            "spmd.DataParallel: automatic tensor-parallel placements are chosen from the traced "
            "step, so the model cannot be distributed before the step's first call (or "
            "train_step.lower(...)). Call the step first, or give the plan: "
            "tp_plan=spmd.tp_plan_of(model) from a run that chose it, or a plan of your own."
        )
    return choice.plan


def check_traceable(module: nn.Module) -> None:
    """Refuse a model the choice cannot trace (built on the meta device), naming the fix."""
    from spmd.parallel.sharding import is_meta_model

    if is_meta_model(module):
        raise ConfigError(
            "spmd.DataParallel: automatic tensor-parallel placements are chosen from a trace of the "
            "step on the model, and this model is on the meta device (its optimizer cannot step "
            "there). Give the plan (tp_plan=spmd.tp_plan_of(model) from a run on a small or fake "
            "copy, or tp_plans.llama()), or build the model off the meta device."
        )


# ----------------------------------------------------------------------------- the graph


def _price(r: Region, tp: int) -> Price:
    """The region's activations, FLOPs and collectives (its state is priced per class)."""
    keep = 1.0 - 1.0 / tp
    p = Price()
    p.activation_bytes = int(sum(nbytes(n) for n in r.flow) * keep)
    if r.kind != "embedding":
        p.flops = int(3 * sum(mm_flops(m) for m in r.mats) * keep)  # forward + 2 backward matmuls
    if r.kind == "pair":
        # Forward: the consumers' outputs summed over tp; backward: the producers' input gradient.
        ins = [a for a in map(act_of, r.producers) if isinstance(a, fx.Node)]
        p.comms = [
            ("all_reduce", sum(nbytes(m) for m in r.consumers)),
            ("all_reduce", max((nbytes(a) for a in ins), default=0)),
        ]
        # A statistic over all of a producer's features (OLMo 2's q/k norm): all-reduced both ways.
        p.comms += [("all_reduce", nbytes(st)) for st in r.statistics for _ in range(2)]
    elif r.kind == "embedding":
        p.comms = [("all_reduce", sum(nbytes(m) for m in r.mats))]
    else:  # the input gradient, and the loss's per-row maximum, sum and target logit (fp32)
        head = r.producers[0]
        rows = head.meta["val"].shape[0]
        x = head.args[-2]
        p.comms = [("all_reduce", nbytes(x) if isinstance(x, fx.Node) else 0)] + [
            ("all_reduce", 4 * rows)
        ] * 3
    p.collectives, p.collective_bytes = len(p.comms), sum(b for _, b in p.comms)
    return p


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _flops(n: float) -> str:
    for unit, div in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} FLOP"


def _why(p: Price) -> str:
    return (
        f"saves {_size(p.state_bytes)} of parameters, gradients and optimizer state and "
        f"{_size(p.activation_bytes)} of activations per rank, {_flops(p.flops)} per step; "
        f"adds {p.collectives} collective{'s' if p.collectives != 1 else ''} ({_size(p.collective_bytes)})"
    )


def _short(fqn: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", fqn)


# ----------------------------------------------------------------------------- the solve


def choose(
    module: nn.Module, gm: fx.GraphModule, mesh: Any, profile: DeviceProfile | None = None
) -> AutoPlan:
    """Choose ``module``'s tensor-parallel placements from its traced step ``gm`` (single-device
    semantics, traced on the undistributed model) for ``mesh``'s ``"tp"`` dimension, priced on
    ``profile`` (None: :func:`~spmd.parallel.auto_tp_solve.local_profile`); remembered for
    ``module`` (:func:`chosen`) and returned."""
    from spmd.parallel import auto_tp_solve as solve
    from spmd.parallel import plan as plan_mod
    from spmd.parallel.auto_tp_check import dirty_nodes

    t0 = time.perf_counter()
    tp_dim = plan_mod.tp_dim(mesh)
    assert tp_dim is not None
    tp = mesh.size(tp_dim)
    shapes: dict[str, tuple[int, ...]] = {}
    state_bytes: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder" or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        name, role, nb = str(n.meta.get(STATE_NAME)), n.meta.get(ROLE), nbytes(n)
        if role is Role.PARAM:
            shapes[name] = tuple(n.meta["val"].shape)
            state_bytes[name] = state_bytes.get(name, 0) + 2 * nb  # the parameter and its gradient
        elif role is Role.OPTIM_STATE and n.meta["val"].dim() > 0:
            owner = name.rsplit(".", 1)[0]
            state_bytes[owner] = state_bytes.get(owner, 0) + nb
    regions = [r for r in find_regions(gm, shapes) if _divides(r, shapes, tp)]
    classes = _classes(regions, shapes)
    decisions: list[Decision] = []
    live = list(range(len(classes)))
    why_not: dict[int, str] = {}
    for _ in range(len(classes) + 1):
        placements = _placements([r for i in live for r in classes[i]])
        plan_ = write_plan(module, placements)
        bad = dirty_nodes(gm, module, mesh, plan_)
        hit = [i for i in live if any(n in _region_nodes(r) for r in classes[i] for n in bad)]
        if not hit:
            break
        for i in hit:
            node = _first(gm, {n for r in classes[i] for n in _region_nodes(r)} & bad)
            why_not[i] = (
                f"DTensor redistributes inside it (at {node.target} in {node.meta.get(MODULE) or '<root>'!r})"
            )
        live = [i for i in live if i not in hit]
    else:  # pragma: no cover - each round drops at least one class
        live = []
    profile = profile if profile is not None else solve.local_profile()
    step_s = solve.step_time(gm, profile) if profile is not None and live else 0.0
    for i, regs in enumerate(classes):
        price = Price()
        for r in regs:
            price += _price(r, tp)
        # Each parameter once: a tied embedding and head share theirs.
        shared = {q for r in regs for q in r.params()}
        price.state_bytes = int(sum(state_bytes.get(q, 0) for q in shared) * (1.0 - 1.0 / tp))
        ok = i in live
        if not ok:
            why = why_not.get(i, "not clean")
        elif profile is None:  # no times to weigh: shard, as the tp degree asks
            why = f"{_why(price)}; no device profile to price them in time"
        else:
            saved = solve.compute_saved_s(
                [m for r in regs if r.kind != "embedding" for m in r.mats], tp, profile
            )
            added = solve.comm_s(price.comms, tp, profile)
            ok = solve.decide(saved, added, price.state_bytes + price.activation_bytes, step_s)
            why = solve.reason(
                ok, price.state_bytes, price.activation_bytes, price.comms, saved, added, step_s, profile
            )
        decisions.append(Decision(regs, ok, price, why))
    sharded = [r for d in decisions if d.sharded for r in d.regions]
    placements = _placements(sharded)
    plan_ = write_plan(module, placements)
    if sharded:  # the values between the sharded regions: split on the sequence, or replicated
        seq, seq_plan = _sequence(module, gm, mesh, tp, sharded, placements, profile, step_s)
        decisions.append(seq)
        plan_ = seq_plan or plan_
    reasons = {p: d.describe() for d in decisions for r in d.regions for p in r.params()}
    for d in decisions:  # the sequence-parallel line on the norms' parameters (no region's)
        for p in getattr(d, "params", ()):
            reasons.setdefault(p, d.describe())
    out = AutoPlan(plan_, placements, reasons, decisions, time.perf_counter() - t0)
    _CHOSEN[module] = out
    n_sharded = sum(d.sharded for d in decisions)
    log.info(
        "spmd: automatic tensor parallelism over %d ranks, priced on %s: %d of %d candidate "
        "classes sharded (%d parameters split), solved in %.2f s:\n  %s",
        tp,
        profile.name if profile is not None else "no device profile",
        n_sharded,
        len(decisions),
        len(placements),
        out.solve_s,
        out.summary().replace("\n", "\n  "),
    )
    return out


def _sequence(
    module: nn.Module,
    gm: fx.GraphModule,
    mesh: Any,
    tp: int,
    regions: list[Region],
    placements: dict[str, Placement],
    profile: DeviceProfile | None,
    step_s: float,
) -> tuple[Decision, dict[str, Any] | None]:
    """Sequence parallelism between the sharded ``regions`` (:mod:`spmd.parallel.auto_tp_sp`):
    its decision and, when it is taken, the plan with it."""
    from spmd.parallel import auto_tp_sp as sp

    stream = sp.find_stream(gm, regions, tp)
    if isinstance(stream, str):
        return sp.SequenceDecision([], False, Price(), stream), None
    entries = _styled(module, placements)
    why_not = sp.restyle(entries, module, stream, placements)
    plan_ = None
    if why_not is None:
        plan_ = _collapse(
            entries, [n for n, _ in module.named_modules()], [n for n, _ in module.named_parameters()]
        )
        bad = sp.dirty(gm, module, mesh, plan_, stream)
        if bad is not None:
            where = bad.meta.get(MODULE) or "<root>"
            why_not = (
                f"DTensor redistributes on it (at {bad.target} in {where!r}: the op needs the whole "
                "sequence, or has no rule for a split one)"
            )
    price, why = sp.price(gm, stream, regions, tp)
    if profile is not None:
        from spmd.parallel import auto_tp_solve as solve

        # Each swapped all-reduce becomes a reduce-scatter and an all-gather of its bytes.
        swapped = [b for r in regions for _, b in _price(r, tp).comms[: 2 if r.kind == "pair" else 1]]
        added = solve.comm_s(price.comms, tp, profile)
        added += sum(
            solve.comm_s([("reduce_scatter", b), ("all_gather", b)], tp, profile)
            - solve.comm_s([("all_reduce", b)], tp, profile)
            for b in swapped
        )
        ok = solve.decide(0.0, added, price.activation_bytes, step_s)
        clause = solve.clause(ok, added, step_s, price.activation_bytes > 0)
        why = f"{why}; {solve.ms(added)} of collectives added on {profile.name}: {clause}"
        if why_not is None and not ok:
            why_not = why
    elif why_not is None and price.activation_bytes <= price.collective_bytes:
        why_not = f"saves no more than it adds: {why}"
    ok = why_not is None
    return sp.SequenceDecision(
        [], ok, price, why if ok else str(why_not), stream=stream
    ), plan_ if ok else None


def _divides(r: Region, shapes: dict[str, tuple[int, ...]], tp: int) -> bool:
    return all(shapes[p][d] % (tp * r.strided.get(p, 1)) == 0 for p, d in r.params().items())


def _first(gm: fx.GraphModule, nodes: set[fx.Node]) -> fx.Node:
    """The first of ``nodes`` in graph order: the redistribution a reason names is the one that
    caused the rest (a set's order would name any of them)."""
    return next(n for n in gm.graph.nodes if n in nodes)


def _region_nodes(r: Region) -> set[fx.Node]:
    return r.flow | {m for m in r.mats if m.target is not aten.embedding.default}


def _classes(regions: list[Region], shapes: dict[str, tuple[int, ...]]) -> list[list[Region]]:
    """Regions grouped by structure; classes sharing a parameter merged (they decide together)."""
    by_sig: dict[tuple[Any, ...], int] = {}
    ids: list[int] = []
    for r in regions:
        ids.append(by_sig.setdefault(r.signature(shapes.__getitem__), len(by_sig)))
    parent = list(range(len(by_sig)))

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    owner: dict[str, int] = {}
    for r, c in zip(regions, ids):
        for p in r.params():
            if p in owner:
                parent[find(c)] = find(owner[p])
            owner.setdefault(p, c)
    out: dict[int, list[Region]] = {}
    for r, c in zip(regions, ids):
        out.setdefault(find(c), []).append(r)
    return list(out.values())


def _placements(regions: Iterable[Region]) -> dict[str, Placement]:
    out: dict[str, Placement] = {}
    for r in regions:
        for p, d in r.params().items():
            k = r.strided.get(p, 1)
            # A fused projection split into k parts: each rank its share of every part.
            out.setdefault(p, Shard(d) if k == 1 else StridedShard(d, split_factor=k))
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- the plan


def write_plan(module: nn.Module, placements: dict[str, Placement]) -> dict[str, Any]:
    """``placements`` as a manual plan: a ``ColwiseParallel``/``RowwiseParallel`` on each module
    whose style places its parameters exactly so (an ``nn.Linear``, ``nn.Embedding``, GPT-2's
    ``Conv1D``), a ``Placement`` for every other parameter; repeated names collapsed into
    ``*`` patterns where a pattern names exactly the same modules."""
    modules = dict(module.named_modules())
    return _collapse(_styled(module, placements), list(modules), [n for n, _ in module.named_parameters()])


def _styled(module: nn.Module, placements: dict[str, Placement]) -> dict[str, Any]:
    """:func:`write_plan`'s entries before collapsing: module fqn -> style, parameter fqn ->
    placement."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from spmd.parallel.tensor_parallel import resolve_plan

    modules = dict(module.named_modules())
    entries: dict[str, Any] = {}
    placed = set()
    for fqn, pl in placements.items():
        if fqn in placed:
            continue
        owner, _, attr = fqn.rpartition(".")
        m = modules.get(owner)
        style = None
        if m is not None and attr == "weight":
            holder = nn.Module()  # the style resolved on this module alone (a whole-model resolve per
            holder.add_module("m", m)  # parameter is seconds on an 80-layer model)
            for cand in (ColwiseParallel(), RowwiseParallel()):
                try:
                    got = resolve_plan(holder, {"m": cand}).params
                except ConfigError:
                    continue
                if all(placements.get(f"{owner}.{k[2:]}", Replicate()) == v for k, v in got.items()):
                    style = cand
                    break
        if style is not None and m is not None:
            entries[owner] = style
            placed |= {f"{owner}.{k}" for k, _ in m.named_parameters(recurse=False)}
        else:
            entries[fqn] = pl
            placed.add(fqn)
    return entries


def _collapse(entries: dict[str, Any], module_names: list[str], param_names: list[str]) -> dict[str, Any]:
    """Entries whose names differ only in layer indices, with the same value, as one ``*``
    pattern, where the pattern names exactly those entries' modules (or parameters)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key, value in entries.items():
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", key)
        groups.setdefault((pattern, _value_key(value)), []).append(key)
    out: dict[str, Any] = {}
    for (pattern, _), keys in groups.items():
        value = entries[keys[0]]
        names = param_names if isinstance(value, Placement) else module_names
        if pattern not in keys and {n for n in names if fnmatch.fnmatchcase(n, pattern)} == set(keys):
            out[pattern] = value
        else:
            out.update((k, entries[k]) for k in keys)
    return out


def _value_key(v: Any) -> str:
    """Entries with equal keys collapse: a placement by value, a style by its type and layouts."""
    if isinstance(v, Placement):
        return repr(v)
    layouts = ("input_layouts", "output_layouts", "sequence_sharding")
    return f"{type(v).__name__}{[getattr(v, a, None) for a in layouts]}"


def tp_plan_of(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan spmd chose for ``model`` (automatic placements), in the manual
    form ``DataParallel(tp_plan=...)`` takes: pass it to run the same placements without the
    choice, or edit it (a copy; module name patterns to ``ColwiseParallel``/``RowwiseParallel``
    and, where the values between the regions split on the sequence, ``SequenceParallel`` on the
    norms and ``output_layouts=Shard(1)`` on the row-parallel outputs; parameter names to a
    ``Placement`` on tp). ``spmd.parallel.tp_plans.without_sequence_parallel(plan)`` drops the
    sequence parallelism.

    Available after the first call of a step compiled with automatic placements on ``model``.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"spmd.tp_plan_of: pass the model the step was called with, got {type(model).__name__}."
        )
    choice = chosen(model)
    if choice is None:
        raise ConfigError(
            "spmd.tp_plan_of: no automatic tensor-parallel choice was made for this model. Call a step "
            "compiled with DataParallel(..., tp_size=N) (and no tp_plan) on it first."
        )
    return dict(choice.plan)
