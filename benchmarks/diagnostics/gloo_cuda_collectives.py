"""Which of torch's gloo collectives survive CUDA tensors: torch's own calls only, no spmd.

    for c in all_reduce broadcast all_gather_into_tensor all_to_all_single reduce_scatter_tensor \\
             fc_all_reduce fc_all_gather fc_all_to_all; do
        torchrun --standalone --nproc_per_node=2 benchmarks/diagnostics/gloo_cuda_collectives.py $c
    done

Two ranks on one GPU (NCCL refuses two ranks on one device; gloo moves CUDA tensors through
host memory). Measured on an H100 with torch 2.11.0+cu130 (the lent GPU machine's build; no
2.13 CUDA build could be carried there), 2026-11-25: every call returns on both ranks except
``fc_all_gather`` (``torch.distributed._functional_collectives.all_gather_tensor``), which kills
both ranks with SIGSEGV -- the crash spmd's fully_shard step met at 2 gloo ranks on CUDA tensors.
The eager ``all_gather_into_tensor`` with the same tensors works. See benchmarks/results/crashes.md.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc


def main(which: str) -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    x = torch.arange(8, dtype=torch.float32, device="cuda") + rank
    group = dist.group.WORLD
    if which == "all_reduce":
        dist.all_reduce(x)
        r = x
    elif which == "broadcast":
        dist.broadcast(x, 0)
        r = x
    elif which == "all_gather_into_tensor":
        r = torch.empty(16, device="cuda")
        dist.all_gather_into_tensor(r, x)
    elif which == "all_to_all_single":
        r = torch.empty(8, device="cuda")
        dist.all_to_all_single(r, x)
    elif which == "reduce_scatter_tensor":
        r = torch.empty(4, device="cuda")
        dist.reduce_scatter_tensor(r, x)
    elif which == "fc_all_reduce":
        r = fc.wait_tensor(fc.all_reduce(x, "sum", group))
    elif which == "fc_all_gather":
        r = fc.wait_tensor(fc.all_gather_tensor(x, 0, group))
    elif which == "fc_all_to_all":
        r = fc.wait_tensor(fc.all_to_all_single(x, None, None, group))
    else:
        raise SystemExit(f"unknown collective {which!r}")
    torch.cuda.synchronize()
    print(which, rank, "ok", r.tolist()[:4], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks import rank_main

    rank_main.run(main, sys.argv[1])
