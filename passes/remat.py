"""Rematerialization: recompute in backward some forward values that backward reads.

Autograd saves, for backward, every forward value a backward op reads (a layer norm's
input, a GELU's input, an attention's output and log-sum-exp...); they live from their
forward op to their backward use and make most of a training step's peak. This pass
chooses, by a policy, which of them stay saved and which are recomputed in backward,
and rewrites the traced whole-step graph accordingly:

for each saved value chosen for recompute, the forward nodes needed to compute it again
(back to values that stay saved, or to the step's inputs and parameters) are copied into
backward, just before its first backward reader, and that reader (and every later
backward reader of the same micro-batch) reads the copy. Chains of recompute share their
nodes. A copy is marked ``Phase.BACKWARD`` with the module path and micro-batch of its
original, and ``meta[REMAT]`` names the original. Forward nodes left without users are
removed.

Policies (``spmd.compile(remat=...)``):

- ``"selective"``: outputs of matmuls, convolutions, attention and collectives stay saved;
  the cheap ops between them (elementwise, activations, norms, rotary, views, casts,
  softmax, embedding look-ups) are recomputed. The loss head -- what runs after the last
  block: the final norm, the output projection, the loss's cast to float32 and its
  log-softmax -- is not recomputed, as torchtitan's checkpointing (which wraps each block
  and nothing else) leaves it: recomputing the log-softmax of the [tokens, vocab] logits
  saves memory but costs a pass over them (about 18 ms a step at the Llama 3.1 8B's shapes).
- ``"op"``: torchtitan's op-level selective checkpointing (``activation_checkpoint.mode =
  "selective"``, ``selective_ac_option = "op"``; ``_custom_policy`` in torchtitan's
  ``parallelize_llama.py`` / ``activation_checkpoint.py``): as ``"selective"``, but of each
  block's matmuls (``mm``/``addmm``, counted in forward order per block and micro-batch, as
  torchtitan's per-block counter) every second one is not kept (the 2nd, 4th, ...: in a Llama
  block k, o and up projections): the min cut recomputes it where that saves bytes. More
  matmul FLOPs, less memory than ``"selective"``; the loss head is kept as there.
- ``"full"``: only what crosses a block boundary (the input of each block, i.e. the output
  of the one before) stays saved; everything inside a block is recomputed.
- a float ``b`` in (0, 1): torch's ``activation_memory_budget``
  (``torch/_functorch/partitioners.py``, ``choose_saved_values_set``): the saved bytes are at
  most ``floor + b * (top - floor)``, where ``top`` is what ``"selective"`` saves, the loss
  head recomputable as torch's partitioner has it (torch's budget 1: its default min cut,
  which saves the compute-intensive outputs and recomputes the cheap ops) and ``floor`` what
  ``"full"`` saves (torch's 0: recompute all that can be; here a recompute never crosses a
  block). Which matmul/attention outputs stay saved is a 0-1
  knapsack over their recompute cost (FLOPs, counted with ``torch.utils.flop_counter``),
  solved by torch's ``dp_knapsack``; ties go to recomputing earlier blocks (what they give up
  is not back in memory at the start of backward). ``1.0`` is ``None`` (nothing recomputed:
  spmd's default saves what autograd saves, where torch's default cut already recomputes).

In every policy, what is saved given the must-save values is a minimum cut over the
forward graph (as torch's min-cut partitioner, ``torch/_functorch/partitioners.py``):
cutting a node costs its bytes, weighted by ``1.1 ** distance to backward`` so that a
value is saved close to its backward use rather than far upstream.

A *block* is a communication unit, ``passes.prefetch.unit_path`` of the node's module
(``layers.3.mlp.fc`` -> ``layers.3``). A recompute never crosses a block boundary: a value
that a node of another block (or another micro-batch) reads is never recomputed. Without
this, recomputing a residual stream would recompute every earlier block at the start of
backward, where everything it recomputes would live until its own block's backward.

Why it is legal: a copy runs the same ATen op on the same inputs (the originals' values
or their own copies), so it computes the same bits (ATen's CPU and CUDA kernels are
deterministic for a given shape and input; ops tagged ``nondeterministic_bitwise`` are not
recomputed). Never recomputed (kept saved):

- random ops (``nondeterministic_seeded``: dropout, ``bernoulli``, ``rand*``): their
  generator has moved on; replaying its state is not implemented;
- ops that write any tensor in place, and ops whose inputs or own storage are written in
  place anywhere between the op and the end of its micro-batch's backward (a recompute
  would read the written value);
- ops outside ATen (custom ops, the RNG-state ops, collectives and their waits), getitems
  of those, and the tracer's casts of forward inputs (mixed precision: the partitioner
  finds them by ``meta[CAST_OF]``);
- forward nodes that only derive from parameters and buffers (a weight's transpose or
  compute cast): they are not activations; the partitioner re-derives them for backward
  from its own gather (fully_shard, ``reshard_after_forward``);
- forward ops that already run inside backward (recomputed by the user's
  ``torch.utils.checkpoint``): their placement stands.

Where it runs: on the traced graph (single-device semantics, phases in meta), before the
parallel mode's partitioner, so that fully_shard with ``reshard_after_forward`` gathers the
parameters of recomputed matmuls in backward like any other backward reader. With a
policy of ``None`` (or ``1.0``) it is not in the pipeline; when nothing is chosen for
recompute it returns the same gm.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Iterable
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from passes import op_accounting, torch_compat
from passes.graph_utils import mutated_nodes, storage_of, written_storages
from passes.meta import CAST_OF, INPUT_CAST, MICROBATCH, MODULE, PHASE, ROLE, Phase, Role
from passes.prefetch import unit_path
from passes.torch_compat import OpOverload

log = logging.getLogger("spmd.passes")

__all__ = ["REMAT", "RematSummary", "check_policy", "node_flops", "rematerialize", "summarize"]

# On a node copied into backward by this pass: the name of the forward node it recomputes.
REMAT = "spmd_remat_of"

Policy = str | float | None

_aten = torch.ops.aten

# The matmuls "op" counts per block, every second one not kept (torchtitan's policy counts aten.mm;
# addmm is a linear with a bias, which torchtitan's Llama does not have).
_COUNTED_MM = {_aten.mm, _aten.addmm}

# Outputs that "selective" keeps saved: compute-heavy ops (what torchtitan's selective policy
# and Megatron's selective recomputation keep) and communication.
_EXPENSIVE = {
    _aten.mm,
    _aten.addmm,
    _aten.bmm,
    _aten.baddbmm,
    _aten.matmul,
    _aten.linear,
    _aten._scaled_mm,
    _aten.convolution,
    _aten._convolution,
    _aten.convolution_backward,
    _aten.scaled_dot_product_attention,
    _aten._scaled_dot_product_attention_math,
    _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu,
    _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_cudnn_attention,
    _aten._flash_attention_forward,
    _aten._efficient_attention_forward,
}


def check_policy(remat: object) -> Policy:
    """``remat`` if it is a valid policy, else ValueError naming the valid ones."""
    if remat is None or remat in ("selective", "full", "op"):
        return remat  # type: ignore[return-value]
    if isinstance(remat, int | float) and not isinstance(remat, bool):
        b = float(remat)
        if 0.0 < b <= 1.0:
            return b
        raise ValueError(
            f"remat={remat!r}: a float is a memory budget, torch's activation_memory_budget, and must be "
            "in (0, 1] (1.0 keeps everything, like remat=None; towards 0 less is saved and more "
            "recomputed); for the least memory use remat='full'."
        )
    raise ValueError(
        f"remat={remat!r}: must be None (save what autograd saves), 'selective' (recompute cheap ops), "
        "'op' (torchtitan's selective_ac_option='op': also every second matmul of a block), "
        "'full' (recompute each block from its input) or a float in (0, 1] (a memory budget: "
        "torch's activation_memory_budget, from 'full' near 0 to 'selective' near 1; 1.0 is None)."
    )


# --------------------------------------------------------------------------- analysis


@dataclasses.dataclass
class _Graph:
    """What the policy and the rewrite need to know about the traced graph."""

    order: dict[fx.Node, int]
    forward: list[fx.Node]  # forward-phase call_function nodes placed before their backward
    bw_start: dict[int, int]  # micro-batch -> position of its first backward node
    saved: list[fx.Node]  # forward values a backward node of the same micro-batch reads
    recomputable: set[fx.Node]
    free: set[fx.Node]  # derived from parameters/buffers only: never copied, never counted


def _mb(n: fx.Node) -> int:
    return int(n.meta.get(MICROBATCH, 0))


def _unit(n: fx.Node) -> str:
    return unit_path(n.meta.get(MODULE, ""))


def _is_aten(target: Any) -> bool:
    return isinstance(target, OpOverload) and target.namespace in ("aten", "prims")


def _is_random(n: fx.Node) -> bool:
    """Whether ``n`` draws from a random generator. Attention ops are tagged
    ``nondeterministic_seeded`` for their dropout: with ``dropout_p == 0`` they draw nothing."""
    target = n.target
    if not isinstance(target, OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, a in enumerate(torch_compat.op_schema(target).arguments):
        if a.name == "dropout_p":
            p = n.kwargs.get("dropout_p", n.args[i] if i < len(n.args) else a.default_value)
            return bool(p != 0.0)
    return True


def _tensors(val: Any) -> list[torch.Tensor]:
    vals = val if isinstance(val, list | tuple) else [val]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def _storage_bytes(n: fx.Node) -> int:
    """Bytes kept alive by saving ``n``: its storages (a view keeps its whole base)."""
    total = 0
    for t in _tensors(n.meta.get("val")):
        try:
            total += t.untyped_storage().nbytes()
        except (NotImplementedError, RuntimeError):
            total += t.numel() * t.element_size()
    return total


def _storages(n: fx.Node) -> set[StorageWeakRef]:
    out = set()
    for t in _tensors(n.meta.get("val")):
        try:
            out.add(StorageWeakRef(t.untyped_storage()))
        except (NotImplementedError, RuntimeError):
            pass
    return out


def _backward_users(n: fx.Node, g_order: dict[fx.Node, int], bw_start: dict[int, int]) -> list[fx.Node]:
    """Readers of forward node ``n`` that run in its micro-batch's backward (by position: a
    forward-tagged op placed inside backward was recomputed by the user's checkpoint)."""
    mb = _mb(n)
    start = bw_start.get(mb)
    if start is None:
        return []
    return [
        u
        for u in n.users
        if _mb(u) == mb and g_order[u] >= start and u.meta.get(PHASE) in (Phase.FORWARD, Phase.BACKWARD)
    ]


def _analyse(gm: fx.GraphModule) -> _Graph:
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    bw_start: dict[int, int] = {}
    bw_end: dict[int, int] = {}
    for n in nodes:
        if n.meta.get(PHASE) is Phase.BACKWARD:
            bw_start.setdefault(_mb(n), order[n])
            bw_end[_mb(n)] = order[n]
    forward = [
        n
        for n in nodes
        if n.op == "call_function"
        and n.meta.get(PHASE) is Phase.FORWARD
        and _mb(n) in bw_start
        and order[n] < bw_start[_mb(n)]
    ]
    # Where each storage is written in place.
    writes: dict[StorageWeakRef, list[int]] = {}
    for n in nodes:
        for s in written_storages(n):
            writes.setdefault(s, []).append(order[n])

    def written_between(n: fx.Node, lo: int, hi: int) -> bool:
        ss = set(_storages(n))
        for i in n.all_input_nodes:
            s = storage_of(i)
            if s is not None:
                ss.add(s)
        return any(lo < p <= hi for s in ss for p in writes.get(s, ()))

    free: set[fx.Node] = set()
    recomputable: set[fx.Node] = set()
    for n in forward:
        ins = n.all_input_nodes
        if (
            ins
            and _is_aten(n.target)
            and not mutated_nodes(n)
            and not _is_random(n)
            and all(
                i in free or (i.op == "placeholder" and i.meta.get(ROLE) in (Role.PARAM, Role.BUFFER))
                for i in ins
            )
        ) or (n.target is operator.getitem and n.args[0] in free):
            free.add(n)
            continue
        if n.target is operator.getitem:
            ok = n.args[0] in recomputable  # type: ignore[operator]
        else:
            tags = n.target.tags if isinstance(n.target, OpOverload) else ()
            ok = (
                _is_aten(n.target)
                and not _is_random(n)
                and torch.Tag.nondeterministic_bitwise not in tags
                and not mutated_nodes(n)
                and n.meta.get(CAST_OF) != INPUT_CAST
                and bool(_tensors(n.meta.get("val")))
            )
        if ok and written_between(n, order[n], bw_end[_mb(n)]):
            ok = False
        if ok:
            recomputable.add(n)
    saved = [n for n in forward if n not in free and _backward_users(n, order, bw_start)]
    return _Graph(order, forward, bw_start, saved, recomputable, free)


def _base_bans(g: _Graph) -> set[fx.Node]:
    """Forward nodes no policy recomputes: the unrecomputable ones, and values read by another
    block or micro-batch (a recompute stays inside its block)."""
    fwd = set(g.forward)
    banned = {n for n in g.forward if n not in g.recomputable and n not in g.free}
    for n in g.forward:
        if n in g.free or n in banned:
            continue
        if any(u in fwd and (_unit(u) != _unit(n) or _mb(u) != _mb(n)) for u in n.users):
            banned.add(n)
        elif any(i.op == "call_function" and i not in fwd for i in n.all_input_nodes):
            banned.add(n)  # reads a value computed outside forward (another micro-batch's backward)
    return banned


def _is_block(unit: str) -> bool:
    """Whether a unit path is one of a stack's blocks (``layers.3``), not the model's root or head."""
    return any(p.isdigit() for p in unit.split("."))


def _loss_head(g: _Graph) -> set[fx.Node]:
    """The forward nodes after the last block's (in graph order, per micro-batch): the final norm,
    the output projection and the loss. Empty where the model has no numbered blocks."""
    last: dict[int, int] = {}
    for n in g.forward:
        if _is_block(_unit(n)):
            last[_mb(n)] = g.order[n]
    return {n for n in g.forward if _mb(n) in last and g.order[n] > last[_mb(n)] and not _is_block(_unit(n))}


def _every_second_mm(g: _Graph) -> set[fx.Node]:
    """The 2nd, 4th, ... matmul (``mm``/``addmm``) of each block and micro-batch's forward."""
    count: dict[tuple[str, int], int] = {}
    out: set[fx.Node] = set()
    for n in g.forward:
        if not (isinstance(n.target, OpOverload) and n.target.overloadpacket in _COUNTED_MM):
            continue
        key = (_unit(n), _mb(n))
        count[key] = count.get(key, 0) + 1
        if count[key] % 2 == 0 and _is_block(key[0]):
            out.add(n)
    return out


def _is_expensive(n: fx.Node) -> bool:
    return isinstance(n.target, OpOverload) and n.target.overloadpacket in _EXPENSIVE


def _min_cut(g: _Graph, banned: set[fx.Node]) -> set[fx.Node]:
    """The forward nodes to save so that backward gets every value it reads, saving the fewest
    (distance-weighted) bytes, given that ``banned`` nodes cannot be recomputed."""
    saved_set = set(g.saved)
    # Distance (in edges) from each forward node to the nearest backward reader.
    dist: dict[fx.Node, int] = {}
    fwd = [n for n in g.forward if n not in g.free]
    fwd_set = set(fwd)
    for n in reversed(fwd):
        d = 1 if n in saved_set else 10**9
        for u in n.users:
            if u in dist:
                d = min(d, dist[u] + 1)
        dist[n] = d
    net = nx.DiGraph()
    inf = float("inf")
    for n in fwd:
        if dist[n] >= 10**9:
            continue  # backward needs nothing from it
        weight = _storage_bytes(n) * 1.1 ** min(dist[n], 100)
        net.add_edge((n, "in"), (n, "out"), capacity=math.ceil(weight))
        if n in banned:
            net.add_edge("source", (n, "in"), capacity=inf)
        if n in saved_set:
            net.add_edge((n, "out"), "sink", capacity=inf)
        for i in n.all_input_nodes:
            if i in fwd_set and dist.get(i, 10**9) < 10**9:
                net.add_edge((i, "out"), (n, "in"), capacity=inf)
    if "source" not in net or "sink" not in net:
        return set()
    _, (reach, _) = nx.minimum_cut(net, "source", "sink")
    return {n for n in fwd if (n, "in") in reach and (n, "out") not in reach}


def _bytes(nodes: Iterable[fx.Node]) -> int:
    seen: set[StorageWeakRef] = set()
    total = 0
    for n in nodes:
        for t in _tensors(n.meta.get("val")):
            try:
                s = StorageWeakRef(t.untyped_storage())
                nbytes = t.untyped_storage().nbytes()
            except (NotImplementedError, RuntimeError):
                total += t.numel() * t.element_size()
                continue
            if s not in seen:
                seen.add(s)
                total += nbytes
    return total


def node_flops(n: fx.Node) -> int:
    """FLOPs of one run of ``n`` (:func:`passes.op_accounting.node_flops`: ``torch.utils.flop_counter``'s
    formulas, 0 for ops without one). CPU flash attention is counted on every torch version: its
    formula entered ``flop_registry`` in torch 2.15 only, and when 2.13 counted it as 0, the knapsack took
    an attention output for free to recompute and chose other blocks than on 2.15."""
    return int(op_accounting.node_flops(n))


def _choose(g: _Graph, policy: Policy) -> set[fx.Node]:
    """The forward nodes to keep saved under ``policy`` (a subset chosen by min cut)."""
    base = _base_bans(g)
    if policy == "full":
        return _min_cut(g, base)
    expensive = {n for n in g.forward if n in g.recomputable and n not in base and _is_expensive(n)}
    if policy == "selective":
        return _min_cut(g, base | expensive | _loss_head(g))
    if policy == "op":
        return _min_cut(g, base | (expensive - _every_second_mm(g)) | _loss_head(g))
    assert isinstance(policy, float)
    # torch's activation_memory_budget (torch/_functorch/partitioners.py, choose_saved_values_set):
    # the budget is a point between the bytes of the least that can be saved (0: recompute all
    # that can be; here "full", as a recompute never crosses a block) and those of the cut that
    # saves every compute-intensive output and recomputes the cheap ops (1: torch's default
    # min cut; here "selective"); the knapsack chooses which matmul/attention outputs to give up.
    keep_sel = _min_cut(g, base | expensive)
    keep_full = _min_cut(g, base)
    floor, top = _bytes(keep_full), _bytes(keep_sel)
    if top <= floor:
        return keep_sel
    budget = floor + policy * (top - floor)
    from passes.torch_compat import dp_knapsack

    items = sorted(expensive, key=g.order.__getitem__)
    items = [n for n in items if _storage_bytes(n) > 0]
    total = float(sum(_storage_bytes(n) for n in items)) or 1.0
    memory = [_storage_bytes(n) / total for n in items]
    # Ties (the same matmul in every block) go to recomputing the earlier blocks: their backward
    # runs last, when the later blocks' activations are freed, so what they give up lowers the
    # peak at the start of backward; a recompute in the last block is back in memory right there.
    runtime = [(float(node_flops(n)) or 1.0) * (1.0 + 1e-3 * k / len(items)) for k, n in enumerate(items)]
    room = budget - floor
    keep = keep_full
    for _ in range(8):  # the cut's bytes are not the items' sum: shrink the room until it fits
        _, to_save, _ = dp_knapsack(memory, runtime, max(room, 0.0) / total)
        keep = _min_cut(g, base | {items[i] for i in to_save})
        over = _bytes(keep) - budget
        if over <= 0 or room <= 0:
            break
        room -= over
    if _bytes(keep) > budget:
        keep = keep_full
    return keep


# --------------------------------------------------------------------------- rewrite


def rematerialize(gm: fx.GraphModule, *, policy: Policy) -> fx.GraphModule:
    """Recompute in backward the saved forward values ``policy`` does not keep (see module doc)."""
    policy = check_policy(policy)
    if policy is None or policy == 1.0:
        return gm
    g = _analyse(gm)
    if not g.saved:
        return gm
    keep = _choose(g, policy)
    keep |= g.free
    fwd = set(g.forward)
    to_recompute = [n for n in g.saved if n not in keep]
    if not to_recompute:
        return gm
    graph = gm.graph
    copies: dict[fx.Node, fx.Node] = {}

    def ensure(n: fx.Node, before: fx.Node) -> fx.Node:
        """The backward copy of forward node ``n`` (made before ``before`` on first need)."""
        if n not in fwd or n in keep:
            return n
        if n in copies:
            return copies[n]
        assert n in g.recomputable, f"remat: {n.name} chosen for recompute but cannot be"
        for i in n.all_input_nodes:
            ensure(i, before)
        with graph.inserting_before(before):
            c = graph.node_copy(n, lambda a: copies.get(a, a))
        c.meta = dict(n.meta)
        c.meta[PHASE] = Phase.BACKWARD
        c.meta.pop(CAST_OF, None)
        c.meta[REMAT] = n.name
        copies[n] = c
        return c

    readers = {t: set(_backward_users(t, g.order, g.bw_start)) for t in to_recompute}
    for u in sorted({u for us in readers.values() for u in us}, key=g.order.__getitem__):
        for i in [i for i in u.all_input_nodes if u in readers.get(i, ())]:
            u.replace_input_with(i, ensure(i, u))
    # Forward nodes that only backward read are now dead.
    for n in reversed(g.forward):
        if not n.users and n in g.recomputable:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    log.info(
        "remat=%s: %d saved values recomputed by %d nodes in backward", policy, len(to_recompute), len(copies)
    )
    return gm


# --------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class RematSummary:
    """What a graph saves for backward and what it recomputes (bytes of one run, one rank)."""

    saved_bytes: int  # activations forward computes and backward reads (storages, counted once)
    recomputed_bytes: int  # activations backward computes again instead (the copies' storages)
    recompute_flops: int  # FLOPs of the recomputing nodes
    step_flops: int  # FLOPs of the whole step, recompute included

    @property
    def extra_flops_fraction(self) -> float:
        base = self.step_flops - self.recompute_flops
        return self.recompute_flops / base if base else 0.0


def summarize(gm: fx.GraphModule) -> RematSummary:
    """Saved vs recomputed activation bytes and recompute FLOPs of a traced (or remat) graph."""
    g = _analyse(gm)
    copies = [n for n in gm.graph.nodes if REMAT in n.meta]
    # What backward reads of the copies: the recomputed values (not every intermediate).
    read = [
        c for c in copies if any(u.meta.get(PHASE) is Phase.BACKWARD and REMAT not in u.meta for u in c.users)
    ]
    step_flops = sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")
    return RematSummary(
        saved_bytes=_bytes(g.saved),
        recomputed_bytes=_bytes(read),
        recompute_flops=sum(node_flops(c) for c in copies),
        step_flops=step_flops,
    )
