"""Carry the step's first all-gathers across the iteration boundary.

Under fully_shard a step starts by all-gathering its first unit's parameters, so the
first forward op waits for a whole collective latency. This pass moves a copy of
those gathers (and the ops that build their input from the parameter shards) to the
end of the step, after the optimizer has written those shards, and returns the
in-flight, unwaited result as an extra graph output; the graph takes the same
tensor as an extra input and waits on it where the gather used to be waited. The
runtime (``spmd.backend.carry``) hands each call's carried outputs to the next call, or,
when it cannot (first call, something may have changed the parameters in between),
issues the gathers itself from :func:`issue_module` before the call.

Rewrite, for each carried gather ``g`` (``chain`` = the ops from parameter
placeholders to ``g``'s input)::

    before:  p -> chain -> g -> wait(g) -> users              ... optimizer writes p ... -> output(outs)
    after:   carried_i (placeholder) -> wait(carried_i) -> users ... optimizer writes p
             ... -> p -> chain' -> g' -> output(outs, g')       (g' after every write of p)

Why it is legal: the carried gathers are the leading collectives of the graph (no
collective comes before them), their inputs depend only on parameter shards, and
nothing in the graph writes those shards before the original gather. So the value
``g`` would gather at the start of call k+1 is the value of the shards at the end of
call k -- what ``g'`` gathers -- provided nothing outside the step changed them in
between (the runtime checks that). Collective order across calls is unchanged:
``[c2..cn, g']`` at call k followed by ``[c2..cn, g']`` at call k+1 is the old
``[g, c2..cn]`` sequence shifted by one collective; ``g'`` is placed after the last
collective of the step, so no collective crosses another.

Invariant this pass adds (checked by :func:`check_carried`, run from
``passes.invariants.check_invariants``): every carried placeholder is waited exactly
once and read by nothing else; every carried output is an unwaited all-gather, read by
nothing but the output node, issued after the graph's every other collective and
after every write to the storages its input chain reads; and placeholder ``i`` and
output ``i`` carry the same op, shapes and dtype.

Where it runs: last (after ``strip_grad_tags``): every earlier pass expects each
collective to have its wait in the same graph. No-op (same ``gm``) when the first
collective is not a movable all-gather, or when the graph does not write the
parameters it gathers (an eval step, a gradient-accumulation micro-step).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from passes import collectives as C
from passes import torch_compat
from passes.graph_utils import storage_of, written_storages
from passes.meta import PHASE, ROLE, Phase, Role, copy_meta
from passes.stages import rebuilt
from passes.torch_compat import OpOverload

# On a carried placeholder and on the collective feeding the matching output: its index
# among the carried tensors (placeholder i is what output i of the previous call was).
CARRIED = "spmd_carried"


def carry_first_gathers(gm: fx.GraphModule, *, max_gathers: int = 1) -> fx.GraphModule:
    """Move the step's leading all-gathers (at most ``max_gathers``) to the end of the
    previous call (see the module doc)."""
    graph = gm.graph
    if carried_placeholders(gm):
        return gm  # already carried (the pass is applied once)
    colls = C.collectives(graph)
    writes = [(n, written_storages(n)) for n in graph.nodes]
    order = {n: i for i, n in enumerate(graph.nodes)}
    chosen: list[tuple[fx.Node, list[fx.Node]]] = []
    for g in colls[:max_gathers]:
        chain = _movable_chain(g, writes, order)
        if chain is None:
            break
        chosen.append((g, chain))
    if not chosen:
        return gm
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    # After the last collective of the step and the last write to what the chains read.
    read = {s for _, chain in chosen for n in chain if n.op == "placeholder" for s in [storage_of(n)] if s}
    last_write = max((order[n] for n, ws in writes if ws & read), default=-1)
    anchor = max([order[colls[-1]], last_write])
    after = list(graph.nodes)[anchor]
    output = graph.output_node()
    new_outs: list[fx.Node] = []
    for i, (g, chain) in enumerate(chosen):
        wait = C.wait_of(g)
        # The copy issued at the end of the step: chain', then g'.
        env: dict[fx.Node, fx.Node] = {}
        for n in [*chain, g]:
            if n.op == "placeholder":
                env[n] = n
                continue
            with graph.inserting_after(after):
                new = graph.node_copy(n, env.__getitem__)
            new.meta = dict(n.meta)
            new.meta[PHASE] = Phase.OPTIMIZER
            env[n] = new
            after = new
        env[g].meta[CARRIED] = i
        new_outs.append(env[g])
        # The placeholder that replaces the gather at the start of the step.
        with graph.inserting_after(last_placeholder):
            ph = graph.placeholder(f"carried_gather_{i}")
        ph.meta["val"] = g.meta.get("val")
        copy_meta(ph, g, role=Role.COMM)
        ph.meta[CARRIED] = i
        last_placeholder = ph
        wait.replace_input_with(g, ph)
        graph.erase_node(g)
        for n in reversed(chain):
            if n.op != "placeholder" and not n.users:
                graph.erase_node(n)
    outs = output.args[0]
    if isinstance(outs, list | tuple):
        output.args = ([*outs, *new_outs],)
    else:
        output.args = ([outs, *new_outs],)
    graph.lint()
    gm.recompile()
    return gm


def _movable_chain(
    g: fx.Node, writes: list[tuple[fx.Node, set]], order: dict[fx.Node, int]
) -> list[fx.Node] | None:
    """The nodes from parameter placeholders to ``g`` (graph order, placeholders included),
    or None if ``g`` cannot be carried."""
    if C.kind_of(g) is not C.Kind.ALL_GATHER or C.is_coalesced(g) or len(C.waits_of(g)) != 1:
        return None
    if any(u is not C.wait_of(g) for u in g.users):
        return None
    chain: set[fx.Node] = set()
    stack = list(g.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in chain:
            continue
        chain.add(n)
        if n.op == "placeholder":
            if n.meta.get(ROLE) is not Role.PARAM:
                return None  # depends on the batch, optimizer state, a carried tensor...
            continue
        if n.op != "call_function" or C.is_collective(n) or C.is_wait(n):
            return None
        if isinstance(n.target, OpOverload) and torch_compat.op_schema(n.target).is_mutable:
            return None
        stack.extend(n.all_input_nodes)
    params = [n for n in chain if n.op == "placeholder"]
    storages = {s for p in params if (s := storage_of(p)) is not None}
    if len(storages) != len(params):
        return None  # a value without a storage: cannot tell what writes it
    # The step must write every parameter it gathers (else it is not a train step: no carry),
    # and nothing may write them before the gather reads them.
    written = set().union(*(ws for _, ws in writes))
    if not storages <= written:
        return None
    if any(ws & storages and order[n] < order[g] for n, ws in writes):
        return None
    return sorted(chain, key=order.__getitem__)


def carried_placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    """The carried placeholders, by index."""
    found = [n for n in gm.graph.nodes if n.op == "placeholder" and CARRIED in n.meta]
    return sorted(found, key=lambda n: n.meta[CARRIED])


def carried_outputs(gm: fx.GraphModule) -> list[fx.Node]:
    """The carried collectives the graph returns last, by index."""
    outs = gm.graph.output_node().args[0]
    outs = list(outs) if isinstance(outs, list | tuple) else [outs]
    found = [o for o in outs if isinstance(o, fx.Node) and CARRIED in o.meta and C.is_collective(o)]
    return sorted(found, key=lambda n: n.meta[CARRIED])


def issue_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph that issues the carried gathers itself: same placeholders as ``gm`` minus the
    carried ones, returns the unwaited gathers. The runtime runs it when it has no valid
    carried tensors, with the inputs of the call about to run."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and CARRIED not in n.meta:
            env[n] = graph.node_copy(n, env.__getitem__)
            env[n].meta = dict(n.meta)
    outs = carried_outputs(gm)
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = list(outs)
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        needed.append(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted(needed, key=order.__getitem__):
        env[n] = graph.node_copy(n, env.__getitem__)
        env[n].meta = dict(n.meta)
    graph.output([env[o] for o in outs])
    return rebuilt(gm, graph)


def check_carried(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """Violations of the carried-gather invariant (module doc), as (node name, message)."""
    phs, outs = carried_placeholders(gm), carried_outputs(gm)
    if not phs and not outs:
        return []
    bad: list[tuple[str, str]] = []
    if [p.meta[CARRIED] for p in phs] != list(range(len(phs))) or len(phs) != len(outs):
        return [
            (
                "",
                f"carried placeholders {[p.name for p in phs]} do not match outputs {[o.name for o in outs]}",
            )
        ]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    colls = C.collectives(gm.graph)
    for ph, out in zip(phs, outs):
        if len(ph.users) != 1 or not C.is_wait(next(iter(ph.users))):
            bad.append((ph.name, f"carried placeholder {ph.name} must be read by exactly one wait"))
        if C.kind_of(out) is not C.Kind.ALL_GATHER or list(out.users) != [gm.graph.output_node()]:
            bad.append((out.name, f"carried output {out.name} must be an all-gather read only by the output"))
        pv, ov = ph.meta.get("val"), out.meta.get("val")
        if (
            isinstance(pv, torch.Tensor)
            and isinstance(ov, torch.Tensor)
            and (tuple(pv.shape) != tuple(ov.shape) or pv.dtype != ov.dtype)
        ):
            bad.append(
                (ph.name, f"carried placeholder {ph.name} and output {out.name} differ in shape/dtype")
            )
        later = [c for c in colls if c not in outs and order[c] > order[out]]
        if later:
            bad.append(
                (out.name, f"carried output {out.name} is issued before the collective {later[0].name}")
            )
        chain = _ancestors(out)
        read = {s for n in chain if n.op == "placeholder" and (s := storage_of(n)) is not None}
        for n in gm.graph.nodes:
            if order[n] > order[out] and written_storages(n) & read:
                bad.append((out.name, f"{n.name} writes what the carried gather {out.name} sent, after it"))
    return bad


def _ancestors(out: fx.Node) -> list[fx.Node]:
    """Every node ``out`` depends on, placeholders included."""
    seen: set[fx.Node] = set()
    stack = [out]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return list(seen)
