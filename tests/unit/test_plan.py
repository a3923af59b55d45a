"""Per-parameter plans (spmd/parallel/plan.py): configuration errors, and the hybrid_shard,
ignored and per-module-style graphs compiled in one process under the fake process group.

hybrid_shard at world size 4 on a (2 x 2) mesh (replicate x shard), rank 0's view::

    shard group   (mesh dim "shard"):     ranks [0, 1]   all-gather, reduce-scatter(avg), norm sums
    replicate group (mesh dim "replicate"): ranks [0, 2]   all-reduce(avg) of each reduce-scattered shard
    whole mesh:                           ranks [0..3]   broadcast of mutated buffers (BatchNorm)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd
from passes import collectives as C
from passes.invariants import fingerprint
from passes.meta import PLACEMENT, STATE_NAME
from spmd.parallel import plan, sharding
from spmd.reporting.dump import annotated_code


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 30))
        self.expert = nn.Linear(30, 30)
        self.head = nn.Linear(30, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.expert(self.body(x))))


def step_clip(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad()
    return loss


def _lower(mode: spmd.DataParallel):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = spmd.compile(parallel_mode=mode, check_invariants=True)(step_clip)
    g = torch.Generator().manual_seed(0)
    graphs = step.lower(model, opt, torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))
    return model, opt, graphs


@pytest.fixture
def world4(monkeypatch):
    """A fake world of 4 ranks, seen from rank ``r`` (call it), nodes of 2 ranks."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    started = []

    def start(rank: int = 0) -> None:
        if started:
            dist.destroy_process_group()
            sharding._DEFAULT_MESHES.clear()
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        started.append(rank)

    yield start
    if started:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()


def _ranks(coll) -> list[int]:
    return plan.group_ranks(C.group_of(coll))


def test_hybrid_shard_graph(world4) -> None:
    world4(0)
    model, opt, graphs = _lower(spmd.DataParallel("hybrid_shard"))
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.device_mesh.shape == (2, 2)
        assert p.placements == (Replicate(), Shard(0))
        assert p.to_local().shape[0] == -(-p.shape[0] // 2)  # sharded over 2 ranks, not 4
    exp_avg = opt.state[model.head.weight]["exp_avg"]
    assert isinstance(exp_avg, DTensor) and exp_avg.placements == (Replicate(), Shard(0))
    part = graphs["partitioned"]
    colls = C.collectives(part.graph)
    by_kind = {k: [c for c in colls if C.kind_of(c) is k] for k in C.Kind}
    assert {tuple(_ranks(c)) for c in by_kind[C.Kind.ALL_GATHER]} == {(0, 1)}
    assert {tuple(_ranks(c)) for c in by_kind[C.Kind.REDUCE_SCATTER]} == {(0, 1)}
    assert [_ranks(c) for c in by_kind[C.Kind.BROADCAST]] == [[0, 1, 2, 3]] * 3  # BatchNorm mean, var, count
    grads_ar = [c for c in by_kind[C.Kind.ALL_REDUCE] if C.reduce_op_of(c) == "avg"]
    norm_ar = [c for c in by_kind[C.Kind.ALL_REDUCE] if C.reduce_op_of(c) == "sum"]
    # one all-reduce across replicas per reduce-scattered gradient, reading its wait
    assert len(grads_ar) == len(by_kind[C.Kind.REDUCE_SCATTER]) == 10  # 5 layers, weight and bias
    for ar in grads_ar:
        assert _ranks(ar) == [0, 2]
        src = C.inputs_of(ar)[0]
        assert C.is_wait(src) and C.kind_of(C.collective_of(src)) is C.Kind.REDUCE_SCATTER
    # clip_grad_norm_: partial sums of squares over the shard group only (replicas hold equal shards)
    assert norm_ar and {tuple(_ranks(c)) for c in norm_ar} == {(0, 1)}
    # bucketing merges within a group, never across: the final graph keeps one group per kind
    final = C.collectives(graphs["final"].graph)
    assert len(final) < len(colls)
    for c in final:
        want = {C.Kind.BROADCAST: [0, 1, 2, 3], C.Kind.ALL_REDUCE: None}.get(C.kind_of(c), [0, 1])
        if want is not None:
            assert _ranks(c) == want, c
    assert {tuple(_ranks(c)) for c in final if C.kind_of(c) is C.Kind.ALL_REDUCE} == {(0, 2), (0, 1)}
    # the dump says where each parameter lives and which ranks each collective spans
    code = annotated_code(part)
    assert "(Replicate(), Shard(dim=0)), shard over ranks [0, 1], all-reduce over ranks [0, 2]" in code
    assert ", ranks [0, 2]" in code


def test_hybrid_fingerprints_agree_across_shard_groups(world4) -> None:
    """Rank 0 and rank 2 sit in different shard groups: raw group names differ, shapes agree."""
    fps = {}
    for rank in (0, 2):
        world4(rank)
        gm = _lower(spmd.DataParallel("hybrid_shard"))[2]["final"]
        fps[rank] = (fingerprint(gm), fingerprint(gm, group_key=plan.group_label))
    assert fps[0][0] != fps[2][0]
    assert fps[0][1] == fps[2][1]


@pytest.mark.parametrize("style", ["fully_shard", "hybrid_shard"])
def test_ignored_and_module_styles_graph(world4, style) -> None:
    world4(0)
    mode = spmd.DataParallel(style, ignored_modules=["expert"], module_styles={"head": "replicate"})
    model, opt, graphs = _lower(mode)
    assert type(model.expert.weight.data) is torch.Tensor  # plain, rank-local
    assert "exp_avg" in opt.state[model.expert.weight]
    hybrid = style == "hybrid_shard"
    assert model.head.weight.placements == ((Replicate(), Replicate()) if hybrid else (Replicate(),))
    assert model.body[0].weight.placements == ((Replicate(), Shard(0)) if hybrid else (Shard(0),))
    gm = graphs["partitioned"]
    params = {n.meta[STATE_NAME]: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in ("expert.weight", "expert.bias"):
        assert params[name].meta[PLACEMENT].startswith("ignored")
    colls = C.collectives(gm.graph)
    modules = {(C.kind_of(c), c.meta["spmd_module"]) for c in colls}
    assert not any(m == "expert" for _, m in modules)  # never gathered, never reduced
    head = [c for c in colls if c.meta["spmd_module"] == "head"]
    assert head and {C.kind_of(c) for c in head} == {C.Kind.ALL_REDUCE}
    assert all(_ranks(c) == [0, 1, 2, 3] for c in head)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"parallel_style": "hybrid_shard", "mesh": "m1"}, "needs 2 data dimensions"),
        (
            {"parallel_style": "fully_shard", "mesh": "m2"},
            "needs one data dimension.*hybrid_shard.*name the model dimension .tp.",
        ),
        ({"module_styles": {"head": "hybrid_shard"}}, r"module_styles\['head'\]"),
        ({"ignored_modules": "expert"}, "must be a list"),
    ],
)
def test_config_errors(world4, kwargs, match) -> None:
    world4(0)
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"m1": init_device_mesh("cpu", (4,)), "m2": init_device_mesh("cpu", (2, 2))}
    if kwargs.get("mesh") in meshes:
        kwargs = {**kwargs, "mesh": meshes[kwargs["mesh"]]}
    with pytest.raises(spmd.ConfigError, match=match):
        spmd.DataParallel(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"module_styles": {"haed": "replicate"}}, "'haed', which is not a module"),
        ({"ignored_modules": ["body.9"]}, "'body.9'"),
        ({"ignored_params": ["head.weigth"]}, "Did you mean 'head.weight'"),
        ({"ignored_modules": [nn.Linear(2, 2)]}, "not a module of the model"),
    ],
)
def test_bad_fqns_named(world4, kwargs, match) -> None:
    world4(0)
    with pytest.raises(spmd.ConfigError, match=match):
        _lower(spmd.DataParallel("fully_shard", **kwargs))


def test_hybrid_default_mesh_needs_local_world_size(world4, monkeypatch) -> None:
    world4(0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(spmd.ConfigError, match="LOCAL_WORLD_SIZE is not set"):
        _lower(spmd.DataParallel("hybrid_shard"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(spmd.ConfigError, match="not a multiple of LOCAL_WORLD_SIZE=3"):
        _lower(spmd.DataParallel("hybrid_shard"))


def test_tied_parameter_with_two_styles() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

    with pytest.raises(spmd.ConfigError, match="tied"):
        plan.assign_styles(Tied(), "fully_shard", module_styles={"b": "replicate"})
    styles = plan.assign_styles(Tied(), "fully_shard", module_styles={"a": "replicate", "b": "replicate"})
    assert set(styles.values()) == {"replicate"}


def test_longest_module_fqn_wins() -> None:
    styles = plan.assign_styles(
        Net(), "fully_shard", module_styles={"": "replicate", "body.3": "fully_shard"}
    )
    assert styles["body.3.weight"] == "fully_shard"
    assert styles["body.0.weight"] == styles["head.bias"] == "replicate"
