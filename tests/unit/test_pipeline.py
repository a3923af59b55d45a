"""The built-in pipeline on real partitioned graphs, compiled in one process under the fake
process group (world size 2): collective counts, prefetch distance and the in-flight cap.

A 4-block TinyGPT (units: tok, pos, blocks.0-3, ln_f; the head is tied to tok) in
fully_shard with defaults::

    forward : AG(tok) AG(pos) | AG(blocks.0) ... AG(blocks.3) AG(ln_f)   7 gathers, 1 per unit
    backward: AG(head=tok) AG(ln_f) AG(blocks.3) ... AG(blocks.0)        6 (pos is not read)
              RS per unit with gradients                                 7 reduce-scatters
"""

from __future__ import annotations

import pytest
import torch

import spmd
from passes import collectives as C
from passes.meta import GRAD_OF, MICROBATCH, PHASE, ROLE, STATE_NAME, Phase, Role
from passes.optimizer_overlap import is_fused_optimizer
from passes.prefetch import default_unit_of
from passes.scheduling import _pass_through_chain, inflight_profile
from passes.units import UNIT
from tests import models
from tests.unit.fake_pg import fake_process_group


@pytest.fixture(scope="module")
def fake_world():
    with fake_process_group(2):
        yield
    _LOWERED.clear()


_LOWERED: dict[tuple, torch.fx.GraphModule] = {}


def _lower(style: str, **knobs) -> torch.fx.GraphModule:
    """The final graph for these knobs (compiled once per module run; tests only read it).

    Units are not merged unless a test asks (``min_unit_mb``): the block structure is
    what most tests look at.
    """
    knobs.setdefault("min_unit_mb", 0)
    key = (style, tuple(sorted(knobs.items())))
    if key not in _LOWERED:
        _LOWERED[key] = _compile(style, **knobs)
    return _LOWERED[key]


def _compile(style: str, **knobs) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = models.TinyGPT(n_layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = spmd.compile(parallel_mode=spmd.DataParallel(style, **knobs), check_invariants=True)(
        models.train_step
    )
    x, y = models.batches("tinygpt", 1)[0]
    return step.lower(model, opt, x, y)["final"]


def _by(gm, kind, phase=None):
    return [
        c
        for c in C.collectives(gm.graph)
        if C.kind_of(c) is kind and (phase is None or c.meta[PHASE] is phase)
    ]


def test_fully_shard_counts(fake_world) -> None:
    gm = _lower("fully_shard")
    fwd = _by(gm, C.Kind.ALL_GATHER, Phase.FORWARD)
    bwd = _by(gm, C.Kind.ALL_GATHER, Phase.BACKWARD)
    rs = _by(gm, C.Kind.REDUCE_SCATTER)
    units = ["tok", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f"]
    assert [default_unit_of(c) for c in fwd] == units
    # Backward gathers take the unit of their first backward reader: the tied tok/head weight
    # is first needed by the head's backward. ln_f, the unit forward needs last, stays gathered
    # into backward (passes.last_unit): no backward gather of its own.
    assert [default_unit_of(c) for c in bwd] == ["head", "blocks.3", "blocks.2", "blocks.1", "blocks.0"]
    assert sorted(default_unit_of(c) for c in rs) == sorted(units)
    assert len(rs) == 7


def test_fully_shard_noreshard_gathers_once(fake_world) -> None:
    gm = _lower("fully_shard", reshard_after_forward=False)
    assert len(_by(gm, C.Kind.ALL_GATHER, Phase.FORWARD)) == 7
    assert _by(gm, C.Kind.ALL_GATHER, Phase.BACKWARD) == []


def test_replicate_buckets_by_cap(fake_world) -> None:
    gm = _lower("replicate")
    assert len(_by(gm, C.Kind.ALL_REDUCE)) == 1  # the whole model is far below 25 MiB
    n_params = sum(1 for _ in models.TinyGPT(n_layers=4).parameters())
    tiny = _lower("replicate", bucket_cap_mb=0.01)  # 10 KiB: a handful of gradients each
    n = len(_by(tiny, C.Kind.ALL_REDUCE))
    assert 1 < n < n_params
    for c in _by(tiny, C.Kind.ALL_REDUCE):
        assert C.bytes_of(c) <= 0.01 * 2**20 or len(C.inputs_of(c)) == 1


@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.BACKWARD])
def test_gathers_issued_one_unit_ahead(fake_world, phase: Phase) -> None:
    """Each unit's gather is issued before the previous unit computes with its parameters."""
    gm = _lower("fully_shard")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = _by(gm, C.Kind.ALL_GATHER, phase)
    assert len(gathers) >= 5
    for prev, cur in zip(gathers, gathers[1:]):
        chain = set(_pass_through_chain(C.wait_of(prev)))
        first_use = min(order[u] for n in chain for u in n.users if u not in chain)
        assert order[cur] < first_use, (default_unit_of(prev), default_unit_of(cur))


def test_no_prefetch_gathers_at_first_use(fake_world) -> None:
    gm = _lower("fully_shard", forward_prefetch=0, backward_prefetch=0)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    gathers = _by(gm, C.Kind.ALL_GATHER, Phase.FORWARD)
    for prev, cur in zip(gathers, gathers[1:]):
        assert order[cur] > order[C.wait_of(prev)]  # never two gathers in flight


def test_inflight_cap_honoured(fake_world) -> None:
    gm = _lower("fully_shard", max_inflight_bytes=1)
    for coll, inflight in inflight_profile(gm):
        assert inflight == C.bytes_of(coll)  # alone in flight: the cap forbids any overlap
    budget = 200_000
    gm = _lower("fully_shard", max_inflight_bytes=budget)
    prof = inflight_profile(gm)
    assert max(b for _, b in prof) <= max(budget, *(C.bytes_of(c) for c, _ in prof))
    unlimited = _lower("fully_shard", max_inflight_bytes=None)
    assert max(b for _, b in inflight_profile(unlimited)) > budget  # the cap was binding


def test_reduce_scatter_waits_sink_past_detach(fake_world) -> None:
    """A gradient's wait moves past autograd's detach to its first real use (not right after issue)."""
    gm = _lower("fully_shard", max_inflight_bytes=None)
    for rs in _by(gm, C.Kind.REDUCE_SCATTER):
        assert rs.next is not C.wait_of(rs)


def test_resharding_lowers_predicted_peak(fake_world) -> None:
    """With reshard_after_forward the gathered parameters die after forward and are gathered
    again in backward; without it they live through backward: the predicted peak shows it."""
    from passes.memory import estimate_peak_memory

    reshard = estimate_peak_memory(_lower("fully_shard")).peak_bytes
    keep = estimate_peak_memory(_lower("fully_shard", reshard_after_forward=False)).peak_bytes
    replicate = estimate_peak_memory(_lower("replicate")).peak_bytes
    assert reshard < keep < replicate


def test_tiny_units_merge_by_default(fake_world) -> None:
    """With the default min_unit_mb (1 MiB) the whole tiny model is one unit: one gather, in
    forward (the unit forward needs last stays gathered into backward), and one reduce-scatter;
    with a threshold of about two blocks, blocks pair up, and the final norm (a remainder far
    below the threshold) joins the last pair instead of being gathered alone."""
    gm = _lower("fully_shard", min_unit_mb=1.0)
    assert len(_by(gm, C.Kind.ALL_GATHER, Phase.FORWARD)) == 1
    assert len(_by(gm, C.Kind.ALL_GATHER, Phase.BACKWARD)) == 0
    assert len(_by(gm, C.Kind.REDUCE_SCATTER)) == 1
    per_block = C.bytes_of(_by(_lower("fully_shard"), C.Kind.ALL_GATHER, Phase.FORWARD)[2])  # blocks.0
    paired = _lower("fully_shard", min_unit_mb=1.5 * per_block / 2**20)
    units = [c.meta[UNIT] for c in _by(paired, C.Kind.ALL_GATHER, Phase.FORWARD)]
    assert units == ["tok..blocks.1", "blocks.2..ln_f"], units


def _accumulating_step(model, optim, x, y):
    """Two micro-batches; the second uses a parameter outside any module call first."""
    for xb, yb in zip(x.chunk(2), y.chunk(2)):
        reg = 1e-4 * model.tok.weight.square().sum()
        loss = models.loss_fn(model(xb), yb) / 2 + reg
        loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_accumulation_one_reduction_and_gathers_per_micro_batch(fake_world) -> None:
    """k micro-batches: every gradient is reduce-scattered once, after the last backward, as
    often as in a one-micro-batch step; parameters are gathered again for each micro-batch
    (so no two micro-batches' gathered copies are alive at once); everything between two
    backward calls is forward."""

    def compile_(fn):
        torch.manual_seed(0)
        model = models.TinyGPT(n_layers=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        step = spmd.compile(
            parallel_mode=spmd.DataParallel("fully_shard", min_unit_mb=0), check_invariants=True
        )(fn)
        x, y = models.batches("tinygpt", 1)[0]
        return step.lower(model, opt, x, y), model

    graphs, model = compile_(_accumulating_step)
    plain = compile_(models.train_step)[0]["final"]
    traced, gm = graphs["traced"], graphs["final"]

    grads = [n for n in traced.graph.nodes if n.meta.get(ROLE) is Role.GRAD]
    assert sorted(n.meta[GRAD_OF] for n in grads) == sorted(n for n, _ in model.named_parameters())
    assert {n.meta[MICROBATCH] for n in grads} == {1}
    second_fwd = [n for n in traced.graph.nodes if n.meta[MICROBATCH] == 1 and n.meta[PHASE] is Phase.FORWARD]
    assert any(a.name == "p_tok_weight" for n in second_fwd for a in n.all_input_nodes)  # `reg`

    rs = _by(gm, C.Kind.REDUCE_SCATTER)
    assert len(rs) == len(_by(plain, C.Kind.REDUCE_SCATTER))
    assert [c.meta[MICROBATCH] for c in rs] == [1] * len(rs)
    fwd_ag = _by(gm, C.Kind.ALL_GATHER, Phase.FORWARD)
    per_micro = [sum(c.meta[MICROBATCH] == m for c in fwd_ag) for m in (0, 1)]
    assert per_micro[0] == per_micro[1] == len(_by(plain, C.Kind.ALL_GATHER, Phase.FORWARD))


# ----------------------------------------------------------------------------- overlap_optimizer


def _waits_feeding(call: torch.fx.Node) -> set[torch.fx.Node]:
    """The waits a fused optimizer call's gradients come from."""
    out, stack, seen = set(), list(call.args[1]), set()
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if C.is_wait(n):
                out.add(n)
            else:
                stack.extend(n.all_input_nodes)
    return out


@pytest.mark.parametrize("style,knobs", [("replicate", {"bucket_cap_mb": 0.01}), ("fully_shard", {})])
def test_optimizer_split_per_bucket_after_its_wait(fake_world, style: str, knobs: dict) -> None:
    """Each piece of the fused AdamW sits after the last wait it reads and before any other wait;
    pieces run in the order their buckets arrive; every parameter is updated once."""
    gm = _lower(style, **knobs)
    calls = [n for n in gm.graph.nodes if is_fused_optimizer(n)]
    assert len(calls) >= 3
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    waits = [n for n in gm.graph.nodes if C.is_wait(n)]
    last_waits = [max(_waits_feeding(c), key=order.__getitem__) for c in calls]
    for call, mine in zip(calls, last_waits):
        assert not [w for w in waits if order[mine] < order[w] < order[call]], call.name
    assert [order[w] for w in last_waits] == sorted(order[w] for w in last_waits)
    updated = [p.meta[STATE_NAME] for c in calls for p in c.args[0] if STATE_NAME in p.meta]
    assert len(updated) == len(set(updated))


def test_optimizer_split_can_be_disabled(fake_world) -> None:
    torch.manual_seed(0)
    model = models.TinyGPT(n_layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mode = spmd.DataParallel("replicate", bucket_cap_mb=0.01)
    step = spmd.compile(parallel_mode=mode, disabled_passes=("overlap_optimizer",))(models.train_step)
    gm = step.lower(model, opt, *models.batches("tinygpt", 1)[0])["final"]
    assert len([n for n in gm.graph.nodes if is_fused_optimizer(n)]) == 1
    assert C.collectives(gm.graph) and [C.kind_of(c) for c in C.collectives(gm.graph)] == [
        C.kind_of(c) for c in C.collectives(_lower("replicate", bucket_cap_mb=0.01).graph)
    ]


def test_gloo_rewrite_only_where_asked(fake_world) -> None:
    """reduce_scatter_as_all_to_all joins the list only with ``gloo_collectives`` (spmd.api: every
    group gloo), after the optimizer split and before strip_grad_tags; the fake group is not gloo."""
    from spmd.pipeline import build_pipeline

    mode = spmd.DataParallel("fully_shard")
    assert "reduce_scatter_as_all_to_all" not in [p.name for p in build_pipeline(mode).passes]
    names = [p.name for p in build_pipeline(mode, gloo_collectives=True).passes]
    at = names.index("reduce_scatter_as_all_to_all")
    assert names[at - 1 : at + 2] == ["limit_inflight", "reduce_scatter_as_all_to_all", "overlap_optimizer"]
    gm = _lower("fully_shard")
    assert _by(gm, C.Kind.REDUCE_SCATTER) and not _by(gm, C.Kind.ALL_TO_ALL)
