"""Train a small character-level GPT on the Python standard library's own source, with spmd.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py            # = make demo (fully_shard)
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --style replicate
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --backend inductor  # fused kernels
    torchrun --standalone --nproc_per_node=8 examples/train_gpt.py --device cuda --mixed-precision bf16
    python examples/train_gpt.py --smoke                                      # world size 1, a few steps
    python examples/sample.py                                                 # generate from the checkpoint

The whole train step (forward, backward, fused AdamW) is compiled into one graph per rank, every stage
written to spmd_dump/; each rank draws its own batches, as with DDP. GPUs: docs/gpu-quickstart.md.
"""

import argparse
import logging
import math
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from gpt import GPT, encode_text, init_device

import spmd

# ----------------------------------------------------------------------------- settings
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=400)  # optimizer steps
p.add_argument("--style", default="fully_shard", choices=["fully_shard", "replicate"])  # DataParallel style
p.add_argument("--backend", default="eager", choices=["eager", "inductor"])  # how the final graph runs
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])  # cuda: NCCL, one GPU per rank
p.add_argument("--mixed-precision", default="none", choices=["none", "bf16"])  # bf16 compute, fp32 reduce
p.add_argument("--peak-tflops", type=float)  # the device's peak (e.g. 989 for an H100's bf16): prints MFU
p.add_argument("--log-level", default="WARNING")  # of the `spmd` logger: INFO says what it writes, compiles
p.add_argument("--smoke", action="store_true")  # a few steps of a tiny model (CI)
args = p.parse_args()
steps = 4 if args.smoke else args.steps
d_model = 32 if args.smoke else 128  # embedding width
n_layer = 1 if args.smoke else 3  # transformer blocks
n_head = 4  # attention heads
block = 64  # context length in characters
batch = 8 if args.smoke else 32  # sequences per rank per step
lr = 3e-3  # AdamW learning rate (cosine-decayed to lr/10)
eval_every = 2 if args.smoke else 100  # steps between validation losses
eval_batches = 2 if args.smoke else 8  # batches per validation loss (per rank)
data_chars = 200_000 if args.smoke else 2_000_000  # characters of stdlib source (90% train, 10% val)
dump_dir = "spmd_dump"  # every graph stage, per rank, as readable Python
ckpt_dir = "checkpoints/smoke" if args.smoke else "checkpoints"  # read by examples/sample.py --ckpt


def main() -> None:
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("spmd").setLevel(args.log_level)
    device, group = init_device(args.device)  # cuda: set_device(LOCAL_RANK), NCCL; cpu: gloo
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # launched by torchrun
    if distributed:
        dist.init_process_group(**group)  # on gloo, spmd makes its own one-thread groups for its collectives
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    chars, data = encode_text(data_chars)
    train_data, val_data = data.tensor_split([int(0.9 * len(data))])  # 90% train, 10% validation

    torch.manual_seed(0)  # same initial weights on every rank
    model = GPT(len(chars), d_model, n_layer, n_head, block).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    gen = torch.Generator().manual_seed(1234 + rank)  # a different batch stream per rank

    def get_batch(split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(split) - block - 1, (batch,), generator=gen)
        xy = torch.stack([split[i : i + block + 1] for i in ix]).to(device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]  # inputs, next-character targets

    bf16 = spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mode = spmd.DataParallel(args.style, mixed_precision=bf16 if args.mixed_precision == "bf16" else None)

    @spmd.compile(parallel_mode=mode, dump_dir=dump_dir, backend=args.backend)
    def train_step(model, optim, x, y):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    @spmd.compile(parallel_mode=mode, dump_dir=dump_dir, backend=args.backend)
    def eval_step(model, x, y):  # forward only, on the same (sharded) state as train_step
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def val_loss(step_fn) -> float:
        total = sum(step_fn(model, *get_batch(val_data)).detach() for _ in range(eval_batches))
        if distributed:
            dist.all_reduce(total)
        return total.item() / (eval_batches * world)

    if rank == 0:
        print(f"vocab {len(chars)}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
              f"world {world}, {args.style}/{args.backend}, {device.type}")
    # Step 0 runs eagerly (__wrapped__): train_step's first call distributes model *and* optimizer state.
    with torch.no_grad():
        first_val = val_loss(eval_step.__wrapped__)
    if rank == 0:
        print(f"step 0: val loss {first_val:.3f}")
    t0, tokens, flops = time.perf_counter(), 0, 0
    for step in range(1, steps + 1):
        for g in optim.param_groups:  # fused AdamW's lr is a graph input: a new value does not retrace
            g["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        loss = train_step(model, optim, *get_batch(train_data))
        tokens += batch * block * world
        if step == 1:
            t0, tokens = time.perf_counter(), 0  # don't count the compile in throughput
            report = train_step.report()  # its FLOPs (per rank) give MFU; its peak is the predicted memory
            flops, mem = report.step_flops, report.peak_memory_bytes
            if rank == 0:
                print(report)
        if rank == 0:  # loss.item() waits for the step, so the times are the device's
            loss_v, dt = loss.item(), max(time.perf_counter() - t0, 1e-9)
            mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else mem  # GPU: measured
            peak = (args.peak_tflops or 0) * 1e12  # the device's dense peak, FLOP/s
            mfu = f" MFU {flops * (step - 1) / dt / peak:.1%}" if peak else ""  # model FLOPs / peak
            bar = "#" * (30 * step // steps)
            print(f"\r[{bar:<30}] {step}/{steps} loss {loss_v:.3f} {tokens / dt:,.0f} tok/s "
                  f"mem {mem / 2**20:,.0f} MiB{mfu}", end="", flush=True)
        if step % eval_every == 0 or step == steps:
            v = val_loss(eval_step)
            if rank == 0:
                print(f"\nstep {step}: val loss {v:.3f}")
    if rank == 0:
        print(f"val loss {first_val:.3f} -> {v:.3f}; {train_step.num_graphs} train graph(s); see {dump_dir}/")

    os.makedirs(ckpt_dir, exist_ok=True)
    if distributed:  # DTensor state (sharded or replicated) -> DCP writes each rank's piece
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")  # overwriting is intended
        dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=ckpt_dir)
    else:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, f"{ckpt_dir}/model.pt")
    if rank == 0:
        meta = dict(chars=chars, d_model=d_model, n_layer=n_layer, n_head=n_head, block=block)
        torch.save(meta, f"{ckpt_dir}/meta.pt")  # what sample.py needs to rebuild the model
        print(f"checkpoint saved to {ckpt_dir}/")
    if distributed:  # leave together, so no rank tears the group down while rank 0 writes meta.pt
        dist.barrier()


if __name__ == "__main__":
    try:
        main()
    finally:  # every exit path destroys the group: a gloo group alive at exit can abort the rank
        if dist.is_initialized():
            dist.destroy_process_group()
