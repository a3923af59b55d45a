"""spmd.backend.lowering: backend='inductor' at world size 1, and the collective order check.

The order check is tested on hand-written graphs and code (no compile); one inductor
compile (ConvBN: parameters, BatchNorm buffers and fused SGD momentum all mutated in
place) runs three steps against the eager backend. (Not Adam here: BatchNorm makes the
conv bias gradient ~1e-9 of noise, which Adam scales up to lr-sized steps of either sign,
so any rounding difference shows; the dist test covers fused AdamW.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx

import spmd
from spmd.backend import inductor_rewrites
from spmd.backend.lowering import check_collective_order, code_order, graph_order
from tests import models

# Per step, inductor vs the eager backend: fusion changes float rounding, nothing else.
TOL = dict(rtol=1e-5, atol=1e-5)

_c10d = torch.ops._c10d_functional


def _two_all_reduces() -> fx.GraphModule:
    """x(8) -> all_reduce -> wait ; y(4) -> all_reduce -> wait ; return both."""
    g = fx.Graph()
    outs = []
    for name, n in (("x", 8), ("y", 4)):
        p = g.placeholder(name)
        p.meta["val"] = torch.empty(n)
        ar = g.call_function(_c10d.all_reduce.default, (p, "avg", "0"))
        ar.meta["val"] = torch.empty(n)
        w = g.call_function(_c10d.wait_tensor.default, (ar,))
        w.meta["val"] = torch.empty(n)
        outs.append(w)
    g.output(outs)
    return fx.GraphModule(torch.nn.Module(), g)


_CODE = """
        buf0 = empty_strided_cpu((8, ), (1, ), torch.float32)
        buf3 = buf0; del buf0  # reuse
        # Topologically Sorted Source Nodes: [all_reduce], Original ATen: [_c10d_functional.all_reduce]
        torch.ops._c10d_functional.all_reduce_.default(buf3, 'avg', '0')
        torch.ops._c10d_functional.wait_tensor.default(buf3)
        buf5 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg1_1, 2, '0')
        assert_size_stride(buf5, (6, 2), (2, 1), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
        torch.ops._c10d_functional.all_reduce_.default(arg0_1, 'sum', '0')
"""


def test_code_order_reads_kinds_groups_and_sizes() -> None:
    """Sizes come from the assert after a call, or from the buffer (followed through reuse) or
    graph input an in-place all_reduce_ works on; waits are not collectives."""
    got = code_order(_CODE, [torch.empty(4), torch.empty(3, 2)])
    assert got == [
        ("all_reduce", False, "0", (8,)),
        ("all_gather", False, "0", (12,)),
        ("all_reduce", False, "0", (4,)),
    ]


# Collectives as torch 2.14's inductor writes them: the output check is assert_tensor_metadata, then
# assert_alignment (the first two from tests/dist/test_inductor.py's fully_shard step, with the op
# names in the checks shortened to OP; the coalesced one in their format).
_CODE_2_14 = """
        buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg2_1, 2, '0')
        assert_tensor_metadata(buf1, (4, 16), (16, 1), torch.float32, OP)
        assert_alignment(buf1, 16, OP)
        assert_size_stride_grouped((arg0_1, arg1_1), ((8, 8), (8, )), ((8, 1), (1, )), 'input')
        # Topologically Sorted Source Nodes: [all_gather_into_tensor_default_5], Original ATen: [...]
        buf2 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf0, 2, '0')
        assert_tensor_metadata(buf2, (212, ), (1, ), torch.float32, OP)
        assert_alignment(buf2, 16, OP)
        buf3 = torch.ops._c10d_functional.all_gather_into_tensor_coalesced.default([buf0, buf1], 2, '0')
        buf4 = buf3[0]
        assert_tensor_metadata(buf4, (212, ), (1, ), torch.float32, OP)
        assert_alignment(buf4, 16, OP)
        buf5 = buf3[1]
        assert_tensor_metadata(buf5, (8, 16), (16, 1), torch.float32, OP)
        assert_alignment(buf5, 16, OP)
        buf6 = buf7[0]
        assert_tensor_metadata(buf6, (3, ), (1, ), torch.float32, OP)
"""


def test_code_order_reads_sizes_from_torch_2_14_checks() -> None:
    """torch 2.14 checks a collective's output with assert_tensor_metadata (then assert_alignment):
    the sizes are read from it, so two all-gathers of one group issued in swapped order differ
    (without the sizes only kinds and groups would be compared, and the swap would pass). Only the
    checks of the call's own outputs count (buf6 is another op's)."""
    assert code_order(_CODE_2_14) == [
        ("all_gather", False, "0", (64,)),
        ("all_gather", False, "0", (212,)),
        ("all_gather", True, "0", (212, 128)),
    ]


def test_check_collective_order_accepts_same_order_and_names_first_difference() -> None:
    gm = _two_all_reduces()
    assert [o[3] for o in graph_order(gm)] == [(8,), (4,)]
    same = "torch.ops._c10d_functional.all_reduce_.default(arg0_1, 'avg', '0')\n"
    same += "torch.ops._c10d_functional.all_reduce_.default(arg1_1, 'avg', '0')\n"
    inputs = [torch.empty(8), torch.empty(4)]
    assert len(check_collective_order(gm, same, inputs)) == 2
    swapped = "\n".join(reversed(same.splitlines()))
    with pytest.raises(
        spmd.LoweringError, match=r"first difference at collective #0: the graph issues all_reduce of 8"
    ):
        check_collective_order(gm, swapped, inputs)
    with pytest.raises(spmd.LoweringError, match=r"1 in the code, 2 in the graph"):
        check_collective_order(gm, same.splitlines()[0], inputs)


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(spmd.ConfigError, match="backend='tvm' is not supported"):
        spmd.compile(backend="tvm")


@pytest.fixture
def inductor_cache(tmp_path, monkeypatch):
    # A fresh cache: a .so truncated by a killed run corrupts later runs.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    return tmp_path


def test_world_size_1_inductor_matches_eager_backend_in_place(inductor_cache, monkeypatch) -> None:
    """ConvBN + fused SGD with momentum: loss, parameters, BatchNorm buffers and optimizer state
    within TOL of the eager backend after every step, all updated in their own storage, over the
    steps that alternate inductor's code and the eager backend's graph (spmd.backend.step_aside) and
    after. With the eager candidate timed faster (injected), it is kept: from the same state, a later
    step equals the eager backend's bit for bit (inductor's rounds differently). The report and the
    dump show the backend, its code, the eager candidate's graph and the decision."""
    from spmd.backend import step_aside

    monkeypatch.setattr(
        step_aside, "time_call", lambda which, fn, flat: (fn(*flat), 2.0 if which == "inductor" else 1.0)
    )
    compiled = models.build("convbn")
    eager = models.twin(compiled)
    co, eo = (
        models.make_optimizer("sgd_momentum_fused", compiled),
        models.make_optimizer("sgd_momentum_fused", eager),
    )
    dump = inductor_cache / "dump"
    ind = spmd.compile(backend="inductor", dump_dir=str(dump))(models.train_step)
    eag = spmd.compile()(models.train_step)
    ptrs = None
    n = step_aside.MIN_CALLS  # a clear win: decided after the fewest timed pairs
    for i, (x, y) in enumerate(models.batches("convbn", n + 2)):
        if i == n:  # decided: the eager side starts from the compiled side's state
            with torch.no_grad():
                for a, b in zip(compiled.state_dict().values(), eager.state_dict().values()):
                    b.copy_(a)
                for a, b in zip(co.state.values(), eo.state.values()):
                    for k in a:
                        b[k].copy_(a[k])
        got, want = ind(compiled, co, x, y), eag(eager, eo, x, y)
        torch.testing.assert_close(got, want, **TOL)
        state = [*compiled.parameters(), *compiled.buffers()]
        state += [v for s in co.state.values() for v in s.values()]
        ptrs = ptrs or [t.data_ptr() for t in state]
        assert [t.data_ptr() for t in state] == ptrs
        exact = i >= n
        for (name, a), (_, b) in zip(compiled.state_dict().items(), eager.state_dict().items()):
            if exact:
                assert torch.equal(a, b), f"step {i}: {name} is not the eager runtime's"
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        for a, b in zip(co.state.values(), eo.state.values()):
            for k in a:
                torch.testing.assert_close(a[k], b[k], **TOL)
    assert compiled.bn.num_batches_tracked.item() == n + 2
    report = ind.report()
    assert report.backend == "inductor" and report.lower_s and report.lower_s <= report.compile_s
    assert "inductor (lowered in" in str(report)
    assert report.kept == "eager" and report.measured_ms == {"inductor": 2000.0, "eager": 1000.0}
    assert eag.report().backend == "eager" and eag.lowered_code is None
    assert "def call(" in ind.lowered_code
    files = sorted(os.listdir(dump / "train_step" / "rank0"))
    # eager kept: "final" (the graph that runs) is the eager backend's, after the graph inductor compiled
    final = files.index(next(f for f in files if f.endswith("_final.py")))
    assert files[final - 1].endswith("_inductor_graph.py") and files[final + 1].endswith("_inductor.py")
    assert not any(f.endswith("_eager_alternative.py") for f in files)
    assert ind.graphs["final"] is ind._last.exe.alt.gm
    assert "eager (median step" in (dump / "train_step" / "rank0" / "report.txt").read_text()


def test_cat_onto_legacy_empty_becomes_a_clone_in_eager_layout() -> None:
    """``cat([tensor([]), k.transpose(1, 2)], -2)`` (HF ``DynamicCache``, use_cache=True): eager
    skips the 1-D empty input and returns a contiguous tensor; inductor gets a contiguous
    clone instead (its cat decomposition would keep k's transposed layout). A cat of two real
    inputs and an empty keeps the real two. The final graph is not modified."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from spmd.backend.inductor_rewrites import for_inductor as _for_inductor

    def f(k, a):
        kt = k.transpose(1, 2)
        c = torch.cat([torch.empty(0), kt], -2)
        d = torch.cat([a, torch.empty(0), a], 0)
        return c.view(-1), d

    k, a = torch.randn(2, 3, 4), torch.randn(2, 2)
    gm = make_fx(f)(k, a)
    before = gm.code
    lowered = _for_inductor(gm)
    assert gm.code == before and lowered is not gm
    cats = [n for n in lowered.graph.nodes if n.target is torch.ops.aten.cat.default]
    clones = [n for n in lowered.graph.nodes if n.target is torch.ops.aten.clone.default]
    assert len(cats) == 1 and len(cats[0].args[0]) == 2
    assert len(clones) == 1 and clones[0].kwargs == {"memory_format": torch.contiguous_format}
    for got, want in zip(lowered(k, a), f(k, a)):
        assert torch.equal(got, want)


def test_code_order_reads_cpp_wrapper_code() -> None:
    """With inductor_config={"cpp_wrapper": True} the code is C++ and collectives with a C shim are
    called through it (all_reduce_, seen in replicate); kind and group are read, sizes are not."""
    code = """
AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu__c10d_functional_all_reduce_(buf16, "avg", "0", &buf17_handle));
AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu__c10d_functional_wait_tensor(buf16, &buf23_handle));
AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu__c10d_functional_all_reduce_(buf20, "sum", "3", &buf21_handle));
"""
    assert code_order(code) == [("all_reduce", False, "0", None), ("all_reduce", False, "3", None)]


@pytest.mark.parametrize("optim_name", ["adamw_fused", "adam_fused"])
def test_inline_optimizer_matches_eager_backend_in_place(inductor_cache, optim_name) -> None:
    """MLP + fused Adam(W), inductor_optimizer='inline': inductor fuses the update itself (no call to
    ATen's fused kernel in its code); loss, parameters and Adam state stay within TOL of the eager
    backend for three steps, every tensor updated in its own storage."""
    compiled = models.build("mlp")
    eager = models.twin(compiled)
    co, eo = models.make_optimizer(optim_name, compiled), models.make_optimizer(optim_name, eager)
    ind = spmd.compile(backend="inductor", inductor_optimizer="inline")(models.train_step)
    eag = spmd.compile()(models.train_step)
    ptrs = None
    for x, y in models.batches("mlp", 3):
        torch.testing.assert_close(ind(compiled, co, x, y), eag(eager, eo, x, y), **TOL)
        state = [*compiled.parameters(), *(v for s in co.state.values() for v in s.values())]
        ptrs = ptrs or [t.data_ptr() for t in state]
        assert [t.data_ptr() for t in state] == ptrs
        for (n, a), (_, b) in zip(compiled.state_dict().items(), eager.state_dict().items()):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=n: f"{n}: {m}")
        for a, b in zip(co.state.values(), eo.state.values()):
            for k in a:
                torch.testing.assert_close(a[k], b[k], **TOL)
    assert "fused_adam" not in ind.lowered_code  # neither ATen's kernel nor its opaque twin


def test_unknown_optimizer_lowering_is_a_config_error() -> None:
    with pytest.raises(spmd.errors.ConfigError, match="inductor_optimizer"):
        spmd.compile(backend="inductor", inductor_optimizer="magic")
    with pytest.raises(spmd.errors.ConfigError, match="inductor_gemm"):
        spmd.compile(backend="inductor", inductor_gemm="cublas")


def test_onednn_gemm_matches_eager_backend(inductor_cache, monkeypatch) -> None:
    """MLP + fused AdamW, inductor_gemm='onednn' with no size floor: every matmul of the lowered code is
    oneDNN's (no ATen mm/addmm left); loss and parameters stay within TOL of the eager backend for
    three steps. With the default floor the MLP's tiny matmuls stay ATen's."""
    monkeypatch.setattr(inductor_rewrites, "_ONEDNN_MIN_MACS", 0)
    compiled = models.build("mlp")
    eager = models.twin(compiled)
    co, eo = models.make_optimizer("adamw_fused", compiled), models.make_optimizer("adamw_fused", eager)
    ind = spmd.compile(backend="inductor", inductor_gemm="onednn")(models.train_step)
    eag = spmd.compile()(models.train_step)
    for x, y in models.batches("mlp", 3):
        torch.testing.assert_close(ind(compiled, co, x, y), eag(eager, eo, x, y), **TOL)
        for (n, a), (_, b) in zip(compiled.state_dict().items(), eager.state_dict().items()):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert "onednn_mm" in ind.lowered_code
    assert "extern_kernels.mm(" not in ind.lowered_code and "extern_kernels.addmm(" not in ind.lowered_code


def test_checkpointed_dropout_is_refused_not_reordered() -> None:
    """Inductor schedules random ops freely around the generator restore that checkpointing
    traces (measured: the recomputed dropout ran before the restore, so its mask differed from
    the forward's and the gradients were wrong); such a step is refused with the fix named."""
    from tests.unit.test_tracing import _CheckpointedDropout

    step = models.train_step
    model = _CheckpointedDropout()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with pytest.raises(spmd.errors.LoweringError, match="backend='eager'"):
        spmd.compile(backend="inductor")(step)(model, opt, x, y)
    # The eager backend runs the restore where the trace put it (test_tracing checks its values).
    spmd.compile()(step)(model, opt, x, y)
