"""Train spmd's built-in GPT with FSDP x tensor parallelism on 4 CPU processes (2 x 2 mesh).

    torchrun --standalone --nproc_per_node=4 examples/train_gpt_tp.py          # fully_shard x TP 2
    torchrun --standalone --nproc_per_node=4 examples/train_gpt_tp.py --tp 4   # TP over all 4 ranks
    torchrun --standalone --nproc_per_node=4 examples/train_gpt_tp.py --plan   # a hand-written plan
    torchrun --standalone --nproc_per_node=4 examples/train_gpt_tp.py --smoke  # a few steps (CI)

Each pair of consecutive ranks is one tensor-parallel group: they split the blocks' weights and
read the same batch. By default spmd chooses the placements from the traced step (column ->
row pairs, the vocabulary-parallel embedding; printed after the first step, with the plan that
reproduces them); --plan uses Megatron's layout written by hand (spmd.parallel.tp_plans.gpt()).
The data dimension (the groups) shards each weight piece again, FSDP-style, and reads different
batches. The report printed after the first step lists the collectives of each mesh dimension.
"""

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import load_text

import spmd
from spmd.models import GPT, GPTConfig
from spmd.parallel import tp_plans

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)  # optimizer steps
p.add_argument("--tp", type=int, default=2)  # ranks per tensor-parallel group
p.add_argument("--style", default="fully_shard", choices=["fully_shard", "replicate"])  # the data dimension
p.add_argument("--plan", action="store_true")  # the hand-written plan instead of spmd's choice
p.add_argument("--smoke", action="store_true")  # a few steps of a tiny model (CI)
args = p.parse_args()
steps = 4 if args.smoke else args.steps
d_model = 32 if args.smoke else 128  # embedding width (a multiple of --tp)
n_layers = 1 if args.smoke else 3  # transformer blocks
n_heads = 4  # attention heads (a multiple of --tp)
block = 64  # context length in characters
batch = 8 if args.smoke else 16  # sequences per data rank per step
lr = 3e-3  # AdamW learning rate (cosine-decayed to lr/10)
data_chars = 200_000 if args.smoke else 1_000_000  # characters of stdlib source


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp = rank // args.tp, world // args.tp  # the default mesh: tp groups of consecutive ranks
    text = load_text(data_chars)
    chars = sorted(set(text))
    lut = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([lut[c] for c in text], dtype=torch.long)
    vocab = -(-len(chars) // args.tp) * args.tp  # the vocabulary-parallel embedding splits evenly

    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(GPTConfig(vocab=vocab, seq=block, d_model=d_model, n_layers=n_layers, n_heads=n_heads))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    gen = torch.Generator().manual_seed(1234 + dp_rank)  # one batch stream per data rank

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
        x = torch.stack([data[i : i + block] for i in ix])
        return x, torch.stack([data[i + 1 : i + block + 1] for i in ix])

    plan = tp_plans.gpt() if args.plan else None  # None: spmd chooses the placements
    mode = spmd.DataParallel(args.style, tp_size=args.tp, tp_plan=plan)

    @spmd.compile(parallel_mode=mode)
    def train_step(model, optim, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # one norm over both mesh dimensions
        optim.step()
        optim.zero_grad()
        return loss

    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        mesh = f"{dp} data ranks x {args.tp} tensor-parallel ranks ({args.style})"
        print(f"{n_params / 1e6:.2f}M params; {mesh}")
    t0, tokens, first = time.perf_counter(), 0, None
    for step in range(1, steps + 1):
        for g in optim.param_groups:
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        loss = train_step(model, optim, *get_batch()).item()
        first = loss if first is None else first
        tokens += batch * block * dp
        if step == 1:
            t0, tokens = time.perf_counter(), 0  # don't count the compile in throughput
            if rank == 0:
                print(train_step.report())
                if not args.plan:  # the choice as a plan: pass it as tp_plan= to freeze it
                    print("chosen plan:", {k: type(v).__name__ for k, v in spmd.tp_plan_of(model).items()})
        if rank == 0 and (step % 20 == 0 or step == steps):
            tps = tokens / max(time.perf_counter() - t0, 1e-9)
            print(f"step {step}: loss {loss:.3f}, {tps:,.0f} tok/s")
    if rank == 0:
        w = model.blocks[0].fc.weight
        print(
            f"loss {first:.3f} -> {loss:.3f}; blocks.0.fc.weight {tuple(w.shape)} is {w.placements}, "
            f"local {tuple(w.to_local().shape)}"
        )


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():  # a gloo group alive at exit can abort the rank (docs/troubleshooting.md)
            dist.destroy_process_group()
