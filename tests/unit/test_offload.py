"""CPU offload (``DataParallel('fully_shard', offload_policy=spmd.CPUOffloadPolicy())``) on a
CPU-only machine: the state and the graph structure, under the fake process group (world
size 2) with a CUDA ``DeviceMesh`` (which the fake group allows without a GPU).

What runs for real: ``DataParallel.distribute`` puts every parameter shard and the optimizer
state on the CPU under a CUDA mesh, the tracer's device rules see them as CUDA tensors, and
the partitioner plus the whole pass pipeline rewrite a step whose traced values are fake
CUDA tensors. What is stood in: the trace itself. Tracing forward + backward on fake CUDA
tensors needs a CUDA build (autograd's AccumulateGrad asks for the CUDA device guard and
aborts), so the step is traced on the CPU and its values are re-propagated as CUDA
(``_retarget``): exactly what the tracer gives on a GPU machine. Values are not checked here
(no device to run on); the expected graph, per offloaded shard::

    p (CPU shard) -> _to_copy(cuda) -> [pad] -> all_gather -> wait -> forward   (and again in backward)
    grad (cuda) -> [pad] -> reduce_scatter -> wait -> [slice] -> _to_copy(cpu) -> optimizer (CPU)
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import spmd
from passes import collectives as C
from passes.fused_align import ALIGNED_FUSED
from passes.meta import GRAD_OF, PHASE, ROLE, Phase, Role
from spmd.frontend import optim as optim_utils
from spmd.frontend import step_inputs, tracing
from spmd.pipeline import build_pipeline
from tests import models
from tests.dist import parity_models as pm
from tests.dist.workers import train_step_clip
from tests.unit.fake_pg import fake_process_group

CUDA = torch.device("cuda", 0)
H2D = torch.ops.aten._to_copy.default


@pytest.fixture(scope="module")
def cuda_mesh():
    with fake_process_group(2):
        yield init_device_mesh("cuda", (2,))


def _mode(mesh, **knobs) -> spmd.DataParallel:
    # pin_memory needs an accelerator; the graph is the same apart from non_blocking.
    return spmd.DataParallel(
        "fully_shard", mesh=mesh, offload_policy=spmd.CPUOffloadPolicy(pin_memory=False), **knobs
    )


def _retarget(gm: fx.GraphModule, fake_inputs: list[torch.Tensor]) -> None:
    """Make a CPU-traced step the step a GPU trace gives: ``device=cpu`` arguments become CUDA
    and every ``meta['val']`` is propagated again from CUDA inputs (0-d CPU inputs, the
    learning rate and Adam's ``step``, stay on the CPU as on a GPU)."""
    for n in gm.graph.nodes:
        if n.kwargs.get("device") == torch.device("cpu"):
            n.kwargs = {**n.kwargs, "device": CUDA}
    gm.recompile()
    with torch.no_grad():  # no autograd metadata: that is what needs the CUDA build
        FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate_dont_convert_inputs(
            *fake_inputs
        )


def _lower(
    mesh, name: str, fn, **knobs
) -> tuple[dict[str, fx.GraphModule], torch.nn.Module, torch.optim.Optimizer]:
    dp = _mode(mesh, **knobs)
    model = pm.build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    twin = models.twin(model)  # traced on the CPU, standing in for the GPU trace
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    optim_utils.ensure_state(twin_opt, list(twin.parameters()))
    dp.distribute(model, opt)

    x, y = pm.batch(name, 0, 0)
    twin_args = step_inputs.split_args((twin, twin_opt, x, y), {})
    twin_state = step_inputs.lift_state(twin, twin_opt)
    traced = tracing.trace_step(fn, twin_args, twin_state)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = step_inputs.lift_state(model, opt)
    with mode:
        x_dev, y_dev = torch.empty_like(x, device=CUDA), torch.empty_like(y, device=CUDA)
    step_args = step_inputs.split_args((model, opt, x_dev, y_dev), {})
    step_inputs.check_devices(fn, step_args, state)  # offloaded state computes on the mesh's device
    fakes = [tracing._trace_input(t, mode) for t in state.tensors(opt)] + [x_dev, y_dev]
    _retarget(traced.gm, fakes)
    graphs = {"traced": traced.gm}
    gm = dp.partition(traced.gm, state, step_args)
    graphs["partitioned"] = fx.GraphModule(gm, gm.graph.__deepcopy__())  # type: ignore[operator]
    graphs["final"] = build_pipeline(dp).run(gm, check=True)
    return graphs, model, opt


def _val(n: fx.Node) -> torch.Tensor | None:
    v = n.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _is_copy_to(n: fx.Node, device_type: str) -> bool:
    dev = n.kwargs.get("device")
    return (
        n.op == "call_function"
        and n.target is H2D
        and isinstance(dev, torch.device)
        and dev.type == device_type
    )


def _reaches_placeholder_directly(n: fx.Node) -> bool:
    """Whether ``n`` reads a parameter placeholder by a path without a host-to-device copy."""
    stack, seen = [n], set()
    while stack:
        cur = stack.pop()
        for i in cur.all_input_nodes:
            if i in seen or _is_copy_to(i, "cuda"):
                continue
            seen.add(i)
            if i.op == "placeholder":
                if i.meta.get(ROLE) is Role.PARAM:
                    return True
                continue
            stack.append(i)
    return False


def _check_structure(gm: fx.GraphModule, n_params: int) -> None:
    gathers = [c for c in C.collectives(gm.graph) if C.kind_of(c) is C.Kind.ALL_GATHER]
    scatters = [c for c in C.collectives(gm.graph) if C.kind_of(c) is C.Kind.REDUCE_SCATTER]
    assert gathers and scatters
    for ag in gathers:  # every all-gather is fed by host-to-device copies of CPU shards, on the device
        assert not _reaches_placeholder_directly(ag), ag.format_node()
        assert _val(ag).device.type == "cuda", ag.format_node()
    params = [n for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get(ROLE) is Role.PARAM]
    assert len(params) == n_params
    for p in params:
        assert _val(p).device.type == "cpu", p.name
        for u in p.users:  # forward/backward read the shard only through a copy to the device
            assert u.meta[PHASE] is Phase.OPTIMIZER or _is_copy_to(u, "cuda"), u.format_node()
    for rs in scatters:  # every path from a reduce-scatter's wait to the optimizer crosses a D2H copy
        frontier, seen, d2h = [C.wait_of(rs)], set(), 0
        while frontier:
            for u in frontier.pop().users:
                if u in seen:
                    continue
                seen.add(u)
                if _is_copy_to(u, "cpu"):
                    assert u.kwargs["non_blocking"] is False and u.meta[ROLE] is Role.GRAD, u.format_node()
                    d2h += 1
                    continue
                assert u.meta[PHASE] is not Phase.OPTIMIZER, u.format_node()
                frontier.append(u)
        assert d2h >= 1, rs.format_node()
    grads = [n for n in gm.graph.nodes if n.meta.get(ROLE) is Role.GRAD and n.meta.get(GRAD_OF)]
    assert grads and all(_val(g).device.type == "cpu" for g in grads)
    opt_nodes = [
        n for n in gm.graph.nodes if n.meta.get(PHASE) is Phase.OPTIMIZER and n.op == "call_function"
    ]
    # The fused kernel, or (ragged shards to align) the op that runs it on aligned copies.
    assert any(
        n.target is torch.ops.aten._fused_adamw_.tensor_lr
        or (n.target is ALIGNED_FUSED and n.args[9] == "_fused_adamw_.tensor_lr")
        for n in opt_nodes
    )
    for n in opt_nodes:  # the optimizer runs on CPU tensors only (the norm's all-reduce excepted)
        if n.meta.get(ROLE) is Role.COMM or _is_copy_to(n, "cuda"):
            continue
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, list | tuple) else [vals]:
            if isinstance(v, torch.Tensor):
                assert v.device.type == "cpu", n.format_node()
        for i in n.all_input_nodes:
            if _val(i) is not None and i.meta.get(ROLE) is not Role.COMM:
                assert _val(i).device.type == "cpu", (n.format_node(), i.format_node())
    mms = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)]
    assert mms and all(_val(n).device.type == "cuda" for n in mms)  # compute stays on the device


def test_distribute_puts_shards_and_optimizer_state_on_the_cpu(cuda_mesh) -> None:
    model = pm.build("uneven")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _mode(cuda_mesh).distribute(model, opt)
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.device_type == "cuda", n
        assert (
            p._local_tensor.device.type == "cpu"
            and p._local_tensor.untyped_storage().nbytes() == p._local_tensor.nbytes
        ), n
        assert step_inputs.compute_device(p).type == "cuda", n
    for st in opt.state.values():
        for k, v in st.items():
            local = v._local_tensor if isinstance(v, DTensor) else v
            assert local.device.type == "cpu", k
    mode = FakeTensorMode()
    assert tracing._trace_input(next(model.parameters()), mode).device.type == "cuda"


@pytest.mark.parametrize(
    "name,fn", [("uneven", train_step_clip), ("tinygpt", models.train_step)], ids=["uneven_clip", "tinygpt"]
)
def test_offload_graph_structure(cuda_mesh, name: str, fn) -> None:
    graphs, model, _ = _lower(cuda_mesh, name, fn, min_unit_mb=0)
    n_params = len(dict(model.named_parameters()))
    for stage in ("partitioned", "final"):
        _check_structure(graphs[stage], n_params)
    part = graphs["partitioned"]
    # one host-to-device copy per all-gather before bucketing (forward, and backward re-gathers)
    h2d = [n for n in part.graph.nodes if _is_copy_to(n, "cuda") and n.meta.get(ROLE) is Role.COMM]
    gathers = [c for c in C.collectives(part.graph) if C.kind_of(c) is C.Kind.ALL_GATHER]
    norms_h2d = sum(1 for n in h2d if n.meta[PHASE] is Phase.OPTIMIZER)
    assert len(h2d) - norms_h2d == len(gathers)
    assert "aten._to_copy.default" in graphs["final"].print_readable(print_output=False)


def test_offload_policy_is_fully_shard_only() -> None:
    with pytest.raises(spmd.ConfigError, match="needs parallel_style='fully_shard'"):
        spmd.DataParallel("replicate", offload_policy=spmd.CPUOffloadPolicy())
    with pytest.raises(spmd.ConfigError, match="must be spmd.CPUOffloadPolicy"):
        spmd.DataParallel("fully_shard", offload_policy=True)  # type: ignore[arg-type]
    with pytest.raises(spmd.ConfigError, match="pin_memory must be True or False"):
        spmd.CPUOffloadPolicy(pin_memory=1)  # type: ignore[arg-type]


def test_offload_policy_is_ignored_on_a_cpu_model(cuda_mesh) -> None:
    """A CPU mesh: nothing to offload, the final graph is the one without the policy."""
    cpu_mesh = init_device_mesh("cpu", (2,))
    codes = []
    for policy in (None, spmd.CPUOffloadPolicy(pin_memory=False)):
        m = pm.build("mlp")
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        dp = spmd.DataParallel("fully_shard", mesh=cpu_mesh, offload_policy=policy)
        step = spmd.compile(parallel_mode=dp)(models.train_step)
        codes.append(step.lower(m, opt, *pm.batch("mlp", 0, 0))["final"].code)
    assert codes[0] == codes[1] and "_to_copy" not in codes[1]
