"""passes/remat.py through ``spmd.compile(remat=...)``: the policies recompute what they say,
keep the budget, and change no bit of the result.

Parity: each policy against ``remat=None`` on models we did not write (Hugging Face Llama,
GPT-2, BERT, T5, tiny configs), eager backend, world size 1 (gloo), replicate (every policy)
and fully_shard ("full": the recompute reads the backward gather), two steps,
``torch.equal`` on the loss, every parameter and every gradient. Each parity case also
asserts that something was recomputed, so it fails with the pass switched off.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import spmd
from passes import collectives as C
from passes.meta import MODULE, PHASE, Phase
from passes.prefetch import unit_path
from passes.remat import REMAT, node_flops, summarize
from spmd.parallel import sharding
from tests import sweep_models as sm
from tests.models import TinyGPT, loss_step, train_step

POLICIES = ["selective", 0.5, "full"]


@pytest.fixture
def gloo1():
    assert not dist.is_initialized(), "a process group leaked from another test"
    saved = dict(sharding._DEFAULT_MESHES)
    sharding._DEFAULT_MESHES.clear()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()
        sharding._DEFAULT_MESHES.update(saved)


@pytest.fixture
def fake2():
    assert not dist.is_initialized(), "a process group leaked from another test"
    saved = dict(sharding._DEFAULT_MESHES)
    sharding._DEFAULT_MESHES.clear()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sharding._DEFAULT_MESHES.clear()
        sharding._DEFAULT_MESHES.update(saved)


def _hf(name: str) -> sm.Case:
    pytest.importorskip("transformers")
    if name == "hf_llama":
        return sm._causal("LlamaConfig", "LlamaForCausalLM", **sm._LLAMA_LIKE)()
    if name == "hf_gpt2":  # dropout 0.1 everywhere: random ops stay saved
        return sm._causal("GPT2Config", "GPT2LMHeadModel", n_embd=32, n_layer=2, n_head=4)()
    return sm.MODELS[name]()


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


def _run(case_name: str, style: str, remat):
    torch.manual_seed(0)
    case = _hf(case_name)
    model = case.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def step(model, opt, *batch):
        loss = case.loss(model, *batch)
        loss.backward()
        opt.step()
        grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        opt.zero_grad()
        return loss, grads

    compiled = spmd.compile(parallel_mode=spmd.DataParallel(style), remat=remat)(step)
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(2):
        torch.manual_seed(10 + i)  # dropout draws the same bits in both runs
        out.append(compiled(model, opt, *case.batch(g)))
    return model, out, compiled


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "hf_bert", "hf_t5"])
def test_policies_bit_for_bit(gloo1, name: str, style: str) -> None:
    ref, ref_out, _ = _run(name, style, None)
    # fully_shard: "full" only, the policy that recomputes matmuls (backward gathers); every
    # policy under fully_shard runs at 2 ranks in tests/dist/test_remat.py. Keeps the suite short.
    for policy in POLICIES if style == "replicate" else ["full"]:
        model, out, compiled = _run(name, style, policy)
        recomputed = [n for n in compiled.graphs["rematerialize"].graph.nodes if REMAT in n.meta]
        assert recomputed, f"{name} {style} remat={policy}: nothing recomputed"
        for i, ((loss, grads), (rloss, rgrads)) in enumerate(zip(out, ref_out)):
            assert torch.equal(loss, rloss), f"{name} {style} remat={policy}: loss of call {i}"
            for j, (a, b) in enumerate(zip(grads, rgrads)):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (
                    f"{name} {style} remat={policy}: gradient {j} of call {i}"
                )
        for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(_full(p), _full(q)), f"{name} {style} remat={policy}: {pname}"


def _gpt(remat, parallel_mode=None, *, batch: int = 8):
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, d_model=64, n_layers=3, n_heads=4, seq=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 128, (batch, 65), generator=g)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    step = spmd.compile(parallel_mode=parallel_mode, remat=remat)(train_step)
    step(model, opt, x, y)
    return step, (model, opt, x, y)


def test_full_saves_only_block_inputs() -> None:
    """remat='full': of the values a block computes, backward reads only the block's output
    (the next block's input); the block's matmuls and attention are recomputed in backward,
    each copy in the block of its original."""
    step, _ = _gpt("full")
    gm = step.graphs["rematerialize"]
    for n in gm.graph.nodes:
        unit = unit_path(n.meta.get(MODULE, ""))
        if (
            n.op != "call_function"
            or n.meta.get(PHASE) is not Phase.FORWARD
            or not unit.startswith("blocks.")
        ):
            continue
        if all(i.op == "placeholder" for i in n.all_input_nodes):
            continue  # a parameter's transpose: not an activation (fully_shard re-gathers it)
        if any(u.meta.get(PHASE) is Phase.BACKWARD for u in n.users):
            others = {
                unit_path(u.meta.get(MODULE, "")) for u in n.users if u.meta.get(PHASE) is Phase.FORWARD
            }
            assert others - {unit}, f"{n.name} ({unit}) is saved for backward but is not a block output"
    copies = [n for n in gm.graph.nodes if REMAT in n.meta]
    kinds = {str(n.target) for n in copies}
    assert "aten.addmm.default" in kinds and any("scaled_dot_product" in k for k in kinds), kinds
    for c in copies:
        assert c.meta[PHASE] is Phase.BACKWARD
        assert unit_path(c.meta[MODULE]).startswith("blocks.") or c.meta[MODULE] in (
            "",
            "ln_f",
            "head",
            "tok",
        )


def test_selective_keeps_matmuls_and_attention() -> None:
    """remat='selective' recomputes no matmul or attention, and recomputes layer norms and GELU."""
    step, _ = _gpt("selective")
    copies = [n for n in step.graphs["rematerialize"].graph.nodes if REMAT in n.meta]
    kinds = {str(n.target) for n in copies}
    assert not any(k.startswith(("aten.addmm", "aten.mm", "aten._scaled_dot")) for k in kinds), kinds
    assert "aten.native_layer_norm.default" in kinds and "aten.gelu.default" in kinds, kinds
    rep = step.report()
    assert rep.recompute_flops == 0 and rep.activation_recomputed_bytes > 0


def _copies_outside_blocks(step) -> list[str]:
    gm = step.graphs["rematerialize"]
    return [
        f"{n.name} ({n.meta.get(MODULE, '')!r})"
        for n in gm.graph.nodes
        if REMAT in n.meta and not any(p.isdigit() for p in unit_path(n.meta.get(MODULE, "")).split("."))
    ]


@pytest.mark.parametrize("policy", ["selective", "op"])
def test_selective_keeps_the_loss_head(policy) -> None:
    """remat='selective' (and 'op') recompute nothing after the last block -- the final norm, the
    head's matmul, the loss's log-softmax -- as torchtitan's checkpointing, which wraps only the
    blocks; inside the blocks they still recompute."""
    step, _ = _gpt(policy)
    assert not _copies_outside_blocks(step), _copies_outside_blocks(step)
    assert step.report().activation_recomputed_bytes > 0


def test_op_recomputes_every_second_block_matmul() -> None:
    """remat='op' is torchtitan's selective_ac_option='op': of each block's forward matmuls the
    2nd, 4th, ... are not kept, so backward recomputes some of them (never an odd one, never one
    outside a block), saving fewer bytes than 'selective' for more FLOPs; the result is the same
    bits as remat=None."""
    op, args = _gpt("op")
    sel, _ = _gpt("selective")
    gm = op.graphs["rematerialize"]
    mms = {"aten.mm.default", "aten.addmm.default"}
    by_block: dict[str, list[str]] = {}
    for n in op.graphs["traced"].graph.nodes:
        if str(n.target) in mms and n.meta.get(PHASE) is Phase.FORWARD:
            by_block.setdefault(unit_path(n.meta.get(MODULE, "")), []).append(n.name)
    second = {name for names in by_block.values() for name in names[1::2]}
    redone = {n.meta[REMAT] for n in gm.graph.nodes if REMAT in n.meta and str(n.target) in mms}
    assert redone and redone <= second, (redone, second)
    s_op, s_sel = summarize(gm), summarize(sel.graphs["rematerialize"])
    assert s_op.saved_bytes < s_sel.saved_bytes and s_op.recompute_flops > s_sel.recompute_flops == 0
    ref, ref_args = _gpt(None)
    for i in range(2):
        assert torch.equal(op(*args), ref(*ref_args)), f"loss of call {i + 2}"
    for (name, p), q in zip(args[0].named_parameters(), ref_args[0].parameters()):
        assert torch.equal(p, q), name


def test_budget_is_kept() -> None:
    """A float is torch's activation_memory_budget between "full" (0) and "selective" (1): it saves
    at most ``floor + b * (top - floor)`` bytes, along the whole curve (no step where a budget
    below 1 gives "selective"); a smaller budget never saves more or recomputes fewer FLOPs.

    The predicted peak is not asserted monotone: the budget bounds saved bytes, not the peak, and
    what the last block recomputes is back in memory at the start of backward. On this model 0.6
    recomputes blocks 0 and 1 only (peak 5,095,340 B) while 0.3 and "full" recompute block 2 too
    (5,224,876 B), on torch 2.13 and 2.15 alike (docs/remat.md)."""
    floor = summarize(_gpt("full")[0].graphs["rematerialize"]).saved_bytes
    top = summarize(_gpt("selective")[0].graphs["rematerialize"]).saved_bytes
    assert floor < top
    last = None
    for b in (0.9, 0.6, 0.3, 0.1):
        s = summarize(_gpt(b)[0].graphs["rematerialize"])
        assert s.saved_bytes <= floor + b * (top - floor), (b, s, floor, top)
        if last is not None:
            assert s.saved_bytes <= last.saved_bytes and s.recompute_flops >= last.recompute_flops
        last = s
    assert last is not None and last.recompute_flops > 0


def test_node_flops_counts_cpu_flash_attention() -> None:
    """The knapsack prices a CPU flash attention by its QK^T and PV FLOPs on every torch version.
    torch's flop_registry has its formula from 2.15 on only; counted as 0 before, an attention
    output was free to recompute and a budget chose other blocks on 2.13 than on 2.15."""
    b, h, s, d = 2, 4, 16, 8
    g = fx.Graph()
    qkv = [g.placeholder(name) for name in "qkv"]
    for p in qkv:
        p.meta["val"] = torch.empty(b, h, s, d)
    att = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, tuple(qkv))
    att.meta["val"] = (torch.empty(b, h, s, d), torch.empty(b, h, s))
    assert node_flops(att) == 2 * (2 * b * h * s * s * d)


def _measured_peak(step, args) -> int:
    mt = MemTracker()
    mt.track_external(*args)
    with mt:
        for _ in range(2):
            step(*args)
            mt.reset_mod_stats()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("remat", [None, *POLICIES])
def test_predicted_peak_matches_memtracker(remat) -> None:
    """The report's predicted peak within 5% of MemTracker's measured one, for each policy, on a
    step whose peak is mostly activations; and each policy lowers the peak."""
    step, args = _gpt(remat, batch=16)
    rep = step.report()
    measured = _measured_peak(step, args)
    print(f"\nremat={remat}: predicted {rep.peak_memory_bytes} B, measured {measured} B")
    assert abs(rep.peak_memory_bytes - measured) <= 0.05 * measured
    if remat is not None:
        none_peak = _gpt(None, batch=16)[0].report().peak_memory_bytes
        assert rep.peak_memory_bytes < none_peak


def test_fully_shard_recompute_reads_backward_gather(fake2) -> None:
    """fully_shard (reshard_after_forward) at 2 ranks: with remat='full' the recomputed matmuls
    read parameters gathered in backward (not kept from forward), and after bucketing the step
    gathers each unit once per phase, as without remat."""
    counts = {}
    for remat in (None, "full"):
        step, _ = _gpt(remat, spmd.DataParallel("fully_shard"), batch=2)
        part = step.graphs["partitioned"]
        matmuls = [n for n in part.graph.nodes if REMAT in n.meta and str(n.target) == "aten.addmm.default"]
        assert bool(matmuls) == (remat is not None)
        for n in matmuls:
            waits = [a for a in n.all_input_nodes if C.is_wait(a)] + [
                b for a in n.all_input_nodes for b in a.all_input_nodes if C.is_wait(b)
            ]
            assert waits and all(w.meta[PHASE] is Phase.BACKWARD for w in waits), n.name
        final = step.graphs["final"]
        counts[remat] = sum(C.kind_of(c) is C.Kind.ALL_GATHER for c in C.collectives(final.graph))
    assert counts["full"] == counts[None]


def test_random_and_mutated_values_are_not_recomputed() -> None:
    """Dropout's mask is saved, not drawn again; a value written in place before backward reads
    it is saved; and the result is the same as without remat."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            h = F.dropout(self.fc1(x), 0.5, training=True)
            a = torch.tanh(h)  # backward reads a; recomputing it would read the written h
            h.add_(1)
            return self.fc2(a).sum() + h.sum()

    results = {}
    for remat in (None, "full"):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = spmd.compile(remat=remat)(loss_step)
        torch.manual_seed(1)
        loss = compiled(model, opt, torch.randn(4, 16))
        results[remat] = (loss, [p.detach().clone() for p in model.parameters()])
        if remat is not None:
            copies = [n for n in compiled.graphs["rematerialize"].graph.nodes if REMAT in n.meta]
            kinds = {str(n.target) for n in copies}
            assert copies and not any("dropout" in k or "bernoulli" in k for k in kinds), kinds
            assert "aten.tanh.default" not in kinds, kinds
    assert torch.equal(results[None][0], results["full"][0])
    for a, b in zip(results[None][1], results["full"][1]):
        assert torch.equal(a, b)


def test_accumulation_recomputes_within_its_micro_batch() -> None:
    """Two forward/backward micro-batches in one step: each copy belongs to its original's
    micro-batch and runs in that micro-batch's backward; same bits as without remat."""
    from passes.meta import MICROBATCH

    def accum(model, opt, x, y):
        for i in range(2):
            logits = model(x[i::2])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i::2].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    outs = {}
    for remat in (None, "selective"):
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, d_model=32, n_layers=2, n_heads=4, seq=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        idx = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
        compiled = spmd.compile(remat=remat)(accum)
        compiled(model, opt, idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        outs[remat] = [p.detach().clone() for p in model.parameters()]
        if remat is not None:
            gm = compiled.graphs["rematerialize"]
            copies = [n for n in gm.graph.nodes if REMAT in n.meta]
            assert {c.meta[MICROBATCH] for c in copies} == {0, 1}
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            for c in copies:
                assert all(u.meta[MICROBATCH] == c.meta[MICROBATCH] for u in c.users)
                mb = c.meta[MICROBATCH]
                fwd = {
                    m: [
                        order[n]
                        for n in gm.graph.nodes
                        if n.meta.get(PHASE) is Phase.FORWARD and n.meta.get(MICROBATCH) == m
                    ]
                    for m in (mb, mb + 1)
                }
                assert max(fwd[mb]) < order[c] < min(fwd[mb + 1], default=len(order))
    for a, b in zip(outs[None], outs["selective"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", ["some", 0.0, 1.5, -0.5, True, [0.5]])
def test_bad_policy_raises_config_error(bad) -> None:
    with pytest.raises(spmd.ConfigError, match="remat="):
        spmd.compile(remat=bad)


def test_no_remat_is_not_a_stage() -> None:
    step, _ = _gpt(None, batch=1)
    assert "rematerialize" not in step.graphs
    assert copy.copy(step.report()).remat is None


def test_composes_with_user_checkpoint(gloo1) -> None:
    """A model under Hugging Face gradient checkpointing (torch.utils.checkpoint): the ops the
    checkpoint recomputes inside backward are left where they are (never copied again), and
    every policy gives the bits of remat=None."""
    ref, ref_out, _ = _run("hf_qwen2_grad_checkpointing", "replicate", None)
    for policy in POLICIES:
        model, out, compiled = _run("hf_qwen2_grad_checkpointing", "replicate", policy)
        traced = compiled.graphs["traced"]
        order = {n.name: i for i, n in enumerate(traced.graph.nodes)}
        bw_start = min(i for i, n in enumerate(traced.graph.nodes) if n.meta.get(PHASE) is Phase.BACKWARD)
        recomputed = any(REMAT in n.meta for n in compiled.graphs["rematerialize"].graph.nodes)
        # "selective": the checkpoint already recomputes each block's cheap ops, and the loss
        # head after the blocks is kept (as torchtitan's), so nothing is left to recompute.
        assert recomputed == (policy != "selective"), policy
        for n in compiled.graphs["rematerialize"].graph.nodes:
            if REMAT in n.meta:
                assert order[n.meta[REMAT]] < bw_start, (
                    f"{n.name} recomputes {n.meta[REMAT]}, run in backward"
                )
        for (loss, grads), (rloss, rgrads) in zip(out, ref_out):
            assert torch.equal(loss, rloss)
            assert all(torch.equal(a, b) for a, b in zip(grads, rgrads) if a is not None)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(_full(p), _full(q))


_MATMULS = ("aten.mm.", "aten.addmm.", "aten.bmm.")


class _OneBlock(nn.Module):
    """One block (unit ``blocks.0``: linear, GELU, linear) and a head: the smallest step in which
    remat='full' recomputes a matmul (inductor compiles it in a few kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[0](x))


def test_inductor_keeps_the_recompute(tmp_path, monkeypatch) -> None:
    """backend='inductor' with remat='full', three steps: the loss and the parameters match the
    eager backend without remat within inductor's tolerance (``test_lowering.TOL``: fusion
    changes float rounding; eager with remat is bit for bit with eager without,
    ``test_policies_bit_for_bit``), and inductor's code calls a matmul for each one of the
    graph, the recomputed one included: more than the graph without remat has (merging a
    recompute back into its forward original would bring it back to that count)."""
    from tests.unit.test_lowering import TOL

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    runs = {}
    for remat, backend in ((None, "eager"), ("full", "inductor")):
        torch.manual_seed(0)
        model = _OneBlock()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        step = spmd.compile(remat=remat, backend=backend)(train_step)
        g = torch.Generator().manual_seed(0)
        losses = [step(model, opt, torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))]
        losses += [step(model, opt, torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))]
        losses += [step(model, opt, torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))]
        runs[remat] = (step, model, losses)
    (eager, ref, ref_losses), (ind, model, losses) = runs[None], runs["full"]
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, **TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=lambda m, name=name: f"{name}: {m}")

    def graph_matmuls(step) -> int:
        return sum(str(n.target).startswith(_MATMULS) for n in step.graphs["final"].graph.nodes)

    code_matmuls = len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", ind.lowered_code))
    assert any(REMAT in n.meta for n in ind.graphs["final"].graph.nodes)
    assert code_matmuls == graph_matmuls(ind) > graph_matmuls(eager), (
        code_matmuls,
        graph_matmuls(ind),
        graph_matmuls(eager),
    )
