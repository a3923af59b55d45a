"""spmd.Override: train a mixture-of-experts model whose routing cannot be traced.

    python examples/override_moe.py                                       # world size 1
    torchrun --standalone --nproc_per_node=2 examples/override_moe.py     # 2 ranks, replicate
    python examples/override_moe.py --smoke                               # a few steps (CI)

MoE routes each token to its top-1 expert the eager way: `nonzero` picks each expert's tokens, a
data-dependent shape, so compiling the step raises spmd.UntraceableOpError naming that line (shown on a
copy). The fix: an spmd.Override whose replacement(fqn, module) returns DenseMoE on the very same router and
experts, which runs every expert on every token with one-hot gates: the same outputs and gradients (checked
first, up to summation order) at n_experts times the expert compute.
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gpt import encode_text

import spmd
from spmd.models import train_step  # next-token cross entropy, backward, optimizer step, zero_grad

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)  # optimizer steps
p.add_argument("--smoke", action="store_true")  # a few steps (CI)
args = p.parse_args()
steps = 6 if args.smoke else args.steps
d_model, d_hidden = 32, 64  # embedding width, hidden width of each expert's MLP
n_experts = 4  # experts in the MoE layer; each token uses one
block, batch = 32, 16  # characters per sequence, sequences per rank per step
lr = 1e-2  # AdamW learning rate
data_chars = 200_000  # characters of stdlib source to learn from (see examples/gpt.py)
rtol = 1e-5  # dense vs routed: same math, but sums over different token counts (atol: rtol * max|x|)


class MoE(nn.Module):
    """Top-1 routed experts, as eager code usually writes them: each expert sees only its tokens."""

    def __init__(self, d: int, n: int, hidden: int):
        super().__init__()
        self.router = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2)
        weight, choice = self.router(flat).softmax(-1).max(-1)  # gate weight and chosen expert, per token
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)  # the tokens routed to e: a data-dependent shape
            out = out.index_add(0, idx, weight[idx, None] * expert(flat[idx]))
        return out.view_as(x)


class DenseMoE(nn.Module):
    """The same function with static shapes: every expert on every token, weighted by one-hot gates."""

    def __init__(self, moe: MoE):
        super().__init__()
        self.router, self.experts = moe.router, moe.experts  # shared modules: the original's parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2)
        weight, choice = self.router(flat).softmax(-1).max(-1)
        gates = F.one_hot(choice, len(self.experts)).to(flat.dtype) * weight[:, None]  # (tokens, experts)
        ys = torch.stack([expert(flat) for expert in self.experts], dim=1)  # (tokens, experts, d)
        return (gates[..., None] * ys).sum(1).view_as(x)


class DenseExperts(spmd.Override):  # asked about every submodule, by name, before the first trace
    def replacement(self, fqn: str, orig_submodule: nn.Module) -> nn.Module:
        return DenseMoE(orig_submodule) if isinstance(orig_submodule, MoE) else orig_submodule


class Net(nn.Module):
    """Predict the next character from the current one, through a residual MoE layer."""

    def __init__(self, vocab: int):
        super().__init__()
        self.tok, self.ln = nn.Embedding(vocab, d_model), nn.LayerNorm(d_model)
        self.moe, self.head = MoE(d_model, n_experts, d_hidden), nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        return self.head(x + self.moe(self.ln(x)))


def dense_vs_routed(moe: MoE, x: torch.Tensor) -> float:
    """Asserts DenseMoE's output and gradients match the routed MoE's on x; returns the largest difference
    relative to the largest entry of its tensor (another summation order moves small entries by more)."""
    params, res = list(moe.parameters()), []
    for m in (moe, DenseMoE(moe)):
        grads = torch.autograd.grad((y := m(x)).square().mean(), params, allow_unused=True)  # unused: None
        res.append([y] + [torch.zeros_like(q) if g is None else g for g, q in zip(grads, params)])
    scales = [b.abs().max().item() for b in res[0]]
    for a, b, s in zip(*res, scales):
        assert torch.allclose(a, b, rtol=rtol, atol=rtol * s), f"DenseMoE != routed MoE {a.shape}"
    return max((a - b).abs().max().item() / max(s, 1e-30) for a, b, s in zip(*res, scales))


def main() -> None:
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    say = print if rank == 0 else (lambda *a, **k: None)
    chars, data = encode_text(data_chars)
    gen = torch.Generator().manual_seed(1234 + rank)  # a different batch stream per rank

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
        xy = torch.stack([data[i : i + block + 1] for i in ix])
        return xy[:, :-1], xy[:, 1:]

    torch.manual_seed(0)  # same initial weights on every rank
    model = Net(len(chars))
    diff = dense_vs_routed(model.moe, model.ln(model.tok(get_batch()[0])).detach())
    say(f"check: DenseMoE == routed MoE, output and gradients: allclose, max |diff| / max|x| {diff:.1e}")

    try:  # 1. Without an Override the routed MoE cannot be compiled (shown on a copy).
        twin = copy.deepcopy(model)
        spmd.compile()(train_step)(twin, torch.optim.AdamW(twin.parameters(), fused=True), *get_batch())
        raise SystemExit("expected the routed MoE to be untraceable")
    except (spmd.UntraceableOpError, spmd.DataDependentControlFlowError) as e:
        say(f"without an Override: {type(e).__name__}: {str(e)[:150]}...")

    # 2. With it, `moe` becomes DenseMoE before tracing and the whole step compiles into one graph.
    routed, optim = model.moe, torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    step = spmd.compile(module_override=[DenseExperts()], parallel_mode=spmd.DataParallel())(train_step)
    losses = []
    for i in range(1, steps + 1):
        losses.append(step(model, optim, *get_batch()).item())  # this rank's loss
        if i == 1 or i % max(steps // 6, 1) == 0:
            say(f"step {i}: loss {losses[-1]:.3f}")
    assert type(model.moe) is DenseMoE and model.moe.experts is routed.experts  # the real weights trained
    say(f"final: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps; {step.num_graphs} graph(s)")
    if distributed:
        dist.barrier()  # leave together (see train_gpt.py)


if __name__ == "__main__":
    try:
        main()
    finally:  # every exit path destroys the group: a gloo group alive at exit can abort the rank
        if dist.is_initialized():
            dist.destroy_process_group()
