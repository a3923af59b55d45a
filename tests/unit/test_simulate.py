"""spmd.simulate: rank 0's report at any world size, on one process, from fake copies of the state.

The model is tests.dist.workers_report.Stack sized so that three of its four parameters have a
row count every simulated world size divides (1/N scaling is exact) and one has 3 rows (padded
to N rows once N > 3). Expected bytes come from workers_report.expected (the padding formula).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import spmd
from spmd import models
from spmd.simulate.__main__ import main
from tests.dist.workers_report import Stack, expected, stack_batch

D, H, C = 1024, 2048, 3
SIZES = [2, 8, 64, 1024]


def _problem():
    torch.manual_seed(0)
    model = Stack(D, H, C)  # parameters: ln.weight (1024,), ln.bias (1024,), fc1 (2048, 1024), fc2 (3, 2048)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return model, opt, *stack_batch(D, C, 0)


def _step(style: str, reshard: bool = True, **knobs):
    return spmd.compile(parallel_mode=spmd.DataParallel(style, reshard_after_forward=reshard, **knobs))(
        models.train_step
    )


@pytest.fixture(scope="module")
def fully_shard_reports() -> dict[int, tuple[spmd.StepReport, float]]:
    model, opt, x, y = _problem()
    step = _step("fully_shard", min_unit_mb=0)  # a unit per module: fc2 is the last one
    out = {}
    for n in SIZES:
        t0 = time.perf_counter()
        rep = spmd.simulate(step, model, opt, x, y, world_size=n)
        out[n] = (rep, time.perf_counter() - t0)
    print("\nsimulate(fully_shard) seconds by world size:", {n: round(s, 2) for n, (_, s) in out.items()})
    return out


def test_fully_shard_bytes_follow_the_formula(fully_shard_reports) -> None:
    shapes = [tuple(p.shape) for p in Stack(D, H, C).parameters()]
    for n, (rep, _) in fully_shard_reports.items():
        exp = expected(shapes, n)
        assert rep.world_size == n and rep.parallel_style == "fully_shard"
        assert rep.param_bytes == rep.grad_bytes == exp["local"], n
        assert rep.optim_state_bytes == 2 * exp["local"] + 4 * len(shapes)
        assert set(rep.collectives) == {"all_gather", "reduce_scatter"}
        # Gathered in forward and again in backward, but for fc2: the unit forward needs last
        # stays gathered into backward (passes.last_unit).
        last = expected(shapes[-1:], n)["padded"]
        assert rep.collectives["all_gather"].bytes == 2 * exp["padded"] - last, n
        assert rep.collectives["reduce_scatter"].bytes == exp["padded"], n


def test_fully_shard_params_per_rank_scale_as_one_over_n(fully_shard_reports) -> None:
    even = (D + D + H * D) * 4  # the parameters whose rows divide by every N
    for n, (rep, _) in fully_shard_reports.items():
        fc2_rows = -(-C // n)  # rank 0 holds ceil(3 / N) rows of fc2
        assert rep.param_bytes == even // n + fc2_rows * H * 4


def test_replicate_all_reduce_moves_the_gradients() -> None:
    model, opt, x, y = _problem()
    full = sum(p.numel() * 4 for p in model.parameters())
    step = _step("replicate")
    for n in (2, 1024):
        rep = spmd.simulate(step, model, opt, x, y, world_size=n)
        assert rep.world_size == n
        assert set(rep.collectives) == {"all_reduce"}
        assert rep.collectives["all_reduce"].bytes == full
        assert rep.param_bytes == rep.grad_bytes == full


def test_no_reshard_gathers_once() -> None:
    model, opt, x, y = _problem()
    shapes = [tuple(p.shape) for p in model.parameters()]
    rep = spmd.simulate(_step("fully_shard", reshard=False), model, opt, x, y, world_size=64)
    assert rep.collectives["all_gather"].bytes == expected(shapes, 64)["padded"]
    assert "reshard_after_forward=False" in rep.parallel_style


def test_caller_state_and_step_are_untouched() -> None:
    model, opt, x, y = _problem()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = _step("fully_shard")
    spmd.simulate(step, model, opt, x, y, world_size=8)
    assert not dist.is_initialized()
    assert step.num_graphs == 0
    for n, p in model.named_parameters():
        assert type(p) is torch.nn.Parameter and not isinstance(p.data, DTensor)
        assert torch.equal(p, before[n]), n
    assert opt.state == {} or all(not isinstance(v, DTensor) for s in opt.state.values() for v in s.values())
    # the step still compiles and runs for real afterwards, at world size 1
    step(model, opt, x, y)
    assert step.report().world_size == 1


def test_errors() -> None:
    model, opt, x, y = _problem()
    with pytest.raises(spmd.ConfigError, match="decorated"):
        spmd.simulate(models.train_step, model, opt, x, y, world_size=2)
    with pytest.raises(spmd.ConfigError, match="world_size"):
        spmd.simulate(_step("replicate"), model, opt, x, y, world_size=0)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(spmd.SpmdError, match="already initialised"):
            spmd.simulate(_step("replicate"), model, opt, x, y, world_size=2)
    finally:
        dist.destroy_process_group()


def _step_named_like_simulate(model, optim, x, y, world_size=1, device="cpu"):
    """A step with keyword arguments named like simulate's own; ``world_size`` divides the loss
    (a Python value: the graph has one more op when it is not 1)."""
    loss = F.cross_entropy(model(x), y)
    if world_size != 1:
        loss = loss / world_size
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_step_keywords_named_like_simulates_own() -> None:
    """step_kwargs= carries the step's keyword arguments named like simulate's (and plan's) own;
    a call that gives such a keyword to a step taking it, without step_kwargs, is refused (it
    cannot tell whose it is); positional arguments never clash."""
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = stack_batch(5, 3, 0)
    step = spmd.compile()(_step_named_like_simulate)
    plain = spmd.simulate(step, model, opt, x, y, world_size=8, step_kwargs={})
    scaled = spmd.simulate(step, model, opt, x, y, world_size=8, step_kwargs={"world_size": 4})
    assert plain.world_size == scaled.world_size == 8  # simulate's own world_size
    assert scaled.num_nodes > plain.num_nodes  # the step got its own: the division (and its backward)
    assert spmd.simulate(step, model, opt, x, y, 4, world_size=8).num_nodes == scaled.num_nodes
    with pytest.raises(spmd.ConfigError, match=r"takes an argument named 'world_size'.*step_kwargs="):
        spmd.simulate(step, model, opt, x, y, world_size=8)
    with pytest.raises(spmd.ConfigError, match=r"both in step_kwargs= and as keywords \(\['extra'\]\)"):
        spmd.simulate(step, model, opt, x, y, world_size=8, step_kwargs={}, extra=1)
    with pytest.raises(spmd.ConfigError, match=r"takes an argument named 'world_size'.*step_kwargs="):
        spmd.plan(step, model, opt, x, y, world_size=8)
    p = spmd.plan(step, model, opt, x, y, world_size=8, styles=("replicate",), step_kwargs={"device": "cpu"})
    assert len(p.rows) == 1
    # a step without such names takes its keywords as before
    kw = spmd.simulate(_step("replicate"), model, opt, x, targets=y, world_size=8)
    assert kw.world_size == 8


def test_cli_tiny(capsys) -> None:
    assert main(["--model", "tiny", "--world-size", "4", "--style", "fully_shard", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["world_size"] == 4 and rep["parallel_style"] == "fully_shard"
    assert rep["collectives"]["all_gather"]["count"] > 0 and rep["peak_memory_bytes"] > 0


def test_graph_size_does_not_grow_with_world_size() -> None:
    """At 1,024 ranks almost every shard is ragged (tiny GPT: d_model 32); the pads, slices and
    optimizer alignment that ragged shards need live inside the flat-buffer ops, so the final
    graph has about as many nodes as at 2 ranks, where every shard is even. (Not exactly: the
    padded bytes make ``min_unit_bytes`` close units at other points, and each unit costs six
    nodes: copy-in, gather, wait, copy-out; pack, reduce-scatter, wait. Measured 499 vs 511;
    before the flat buffers 943 vs 1,279.)"""
    counts = {}
    for w in (2, 1024):
        model, optim, idx, targets = models.build("tiny", batch=1, seq=None, fake=True)
        # Every unit resharded: the last unit (which stays gathered into backward, passes.last_unit)
        # closes at a different block at each world size, and its backward gathers take their views along.
        step = spmd.compile(
            parallel_mode=spmd.DataParallel("fully_shard"), disabled_passes=["keep_last_unit_gathered"]
        )(models.train_step)
        counts[w] = spmd.simulate(step, model, optim, idx, targets, world_size=w).num_nodes
    assert abs(counts[1024] - counts[2]) <= 24, counts


def test_cli_remat(capsys) -> None:
    """--remat reaches the simulated step: less activation saved, the recompute reported."""
    reps = {}
    for remat in ("none", "full"):
        assert main(["--model", "tiny", "--world-size", "2", "--batch", "4", "--remat", remat, "--json"]) == 0
        reps[remat] = json.loads(capsys.readouterr().out)
    assert reps["full"]["remat"] == "full" and reps["none"]["remat"] is None
    assert reps["full"]["activation_saved_bytes"] < reps["none"]["activation_saved_bytes"]
    assert reps["full"]["recompute_flops"] > 0 and reps["none"]["recompute_flops"] == 0
    assert reps["full"]["peak_memory_bytes"] < reps["none"]["peak_memory_bytes"]


def _wide_vocab_lm(tokens: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A fake GPT whose vocabulary is 32x its width, so Liger's rule gives a CPU chunks of
    ``tokens / 32`` rows (fewer than an accelerator's floor); one sequence of ``tokens``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = models.GPTConfig(vocab=1024, seq=tokens, d_model=32, n_layers=1, n_heads=4)
    with FakeTensorMode():
        model = models.GPT(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    idx = torch.zeros(1, tokens, dtype=torch.long)
    return model, optim, idx, idx.clone()


def test_a_gpu_profile_lowers_the_loss_head_as_on_the_gpu() -> None:
    """The step traces on the CPU; with ``device=`` a GPU profile the chunked loss head takes the
    accelerator's chunks (at least ACCELERATOR_MIN_ROWS rows, one chunk when fewer tokens), and a
    CPU profile the CPU's (Liger's rule, 128-row floor), as without ``device=``."""
    import dataclasses

    from passes.linear_cross_entropy import ACCELERATOR_MIN_ROWS, default_chunk
    from spmd.profiles import get_profile

    cpu = dataclasses.replace(get_profile("h100-80gb"), name="h100-marked-cpu", device_type="cpu")
    step = spmd.compile(parallel_mode=spmd.DataParallel("replicate"), chunked_loss=True)(models.train_step)

    def chunks(tokens: int, device: object) -> list[str]:
        rep = spmd.simulate(step, *_wide_vocab_lm(tokens), world_size=2, device=device)
        return rep.loss_heads

    def words(tokens: int, rows: int) -> list[str]:
        n = -(-tokens // rows)
        return [f"loss head: {tokens} tokens x vocab 1024, {n} chunk(s) of {min(rows, tokens)}"]

    many, few = 4 * ACCELERATOR_MIN_ROWS, ACCELERATOR_MIN_ROWS // 2
    cpu_rows = default_chunk(many, 1024, 32)
    assert cpu_rows < ACCELERATOR_MIN_ROWS  # the two rules differ here
    assert chunks(many, "h100-80gb") == words(many, ACCELERATOR_MIN_ROWS)
    assert chunks(few, "a100-80gb") == words(few, few)  # one chunk: fewer tokens than the floor
    assert chunks(many, cpu) == words(many, cpu_rows)


def test_hf_model_without_transformers_says_which_extra_to_install(monkeypatch):
    """--hf-config and the presets need `transformers` (the `hf` extra): without it, a ConfigError
    that names the extra, not a bare ImportError from inside spmd."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(spmd.ConfigError, match=r"pip install -e '\.\[hf\]'"):
        models.build_hf("llama3.1-8b", batch=1, seq=16)
