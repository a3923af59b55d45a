"""The bug valgrind_hunt.sh looks for, made on purpose: does memcheck see it? (issue 23)

Two torchrun workers. Rank 0 issues an ``all_reduce`` (async, on gloo), gives gloo's thread
time to start it (it takes the buffer's address and waits for the peer), then frees the input's
buffer before the wait (its storage resized to 0: what an eager runtime that freed an in-flight
collective's input would do); rank 1 joins late, so rank 0's gloo thread writes the sum into the
freed block. Under ``benchmarks/diagnostics/valgrind_hunt.sh control`` each rank runs
under memcheck: rank 0's log must show an invalid read or write in gloo on a block freed by the
resize. Without valgrind the write lands in freed heap memory (a heap corruption that glibc may or
may not notice later), so this is a check of the hunt's tooling, not something to run natively.

    benchmarks/diagnostics/valgrind_hunt.sh control
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

LATE_S = 30.0  # rank 1's delay: under valgrind, far longer than rank 0's issue, start and free take
START_S = 10.0  # rank 0's pause between the issue and the free, for gloo's thread to start the op
N = 1 << 12  # elements: a heap block of 16 KiB


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(LATE_S)
    x = torch.full((N,), float(rank))
    work = dist.all_reduce(x, async_op=True)
    if rank == 0:
        time.sleep(START_S)
        x.untyped_storage().resize_(0)  # the in-flight input's buffer, freed
    work.wait()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done")


if __name__ == "__main__":
    from benchmarks import rank_main  # PYTHONPATH=. (valgrind_hunt.sh sets it)

    rank_main.run(main)
