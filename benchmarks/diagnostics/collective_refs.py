"""Does an issued functional collective keep its buffers alive until its wait, on gloo?

For each ``_c10d_functional`` collective the spmd graphs use, on 2 gloo ranks: rank 1
joins late (so rank 0's collective is surely still in flight), rank 0 issues the
collective on a fresh input, drops every Python reference to the input (what the eager
runtime's generated code does after a value's last use), churns the heap, then waits and
checks the result. It also prints the input storage's reference count right after the
issue: above the 1 that the Python tensor holds means the process group's work object
holds the buffer, so dropping the Python reference does not free it.

    PYTHONPATH=. .venv/bin/python benchmarks/diagnostics/collective_refs.py
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.launcher import run_ranks

F = torch.ops._c10d_functional
N = 1 << 12  # elements per input: small enough for glibc's tcache bins at the small end too


def _refs(t: torch.Tensor) -> int:
    """References to ``t``'s buffer from C++: to its TensorImpl plus (views) to its storage."""
    return t._use_count() + torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _ops(
    group: str, w: int
) -> dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[torch.Tensor], torch.Tensor]]]:
    """name -> (issue(x), what the waited result must equal given the rank-0 input x)."""
    return {
        "all_reduce": (lambda x: F.all_reduce(x, "sum", group), lambda x: x + 1),
        "all_reduce_": (lambda x: F.all_reduce_(x, "sum", group), lambda x: x + 1),
        "all_gather_into_tensor": (
            lambda x: F.all_gather_into_tensor(x, w, group),
            lambda x: torch.cat([x, torch.ones_like(x)]),
        ),
        "reduce_scatter_tensor": (
            lambda x: F.reduce_scatter_tensor(x, "sum", w, group),
            lambda x: (x + 1)[: x.numel() // w],
        ),
        "all_to_all_single": (
            lambda x: F.all_to_all_single(x, [x.numel() // w] * w, [x.numel() // w] * w, group),
            lambda x: torch.cat([x[: x.numel() // w], torch.ones(x.numel() // w)]),
        ),
        "all_reduce_coalesced_": (lambda x: F.all_reduce_coalesced_([x], "sum", group)[0], lambda x: x + 1),
        "broadcast": (lambda x: F.broadcast(x, 0, group), lambda x: x),
        "all_reduce_coalesced": (lambda x: F.all_reduce_coalesced([x], "sum", group)[0], lambda x: x + 1),
        "all_gather_into_tensor_coalesced": (
            lambda x: F.all_gather_into_tensor_coalesced([x], w, group)[0],
            lambda x: torch.cat([x, torch.ones_like(x)]),
        ),
        "reduce_scatter_tensor_coalesced": (
            lambda x: F.reduce_scatter_tensor_coalesced([x], "sum", w, group)[0],
            lambda x: (x + 1)[: x.numel() // w],
        ),
    }


def body(rank: int, world: int, late_s: float) -> dict[str, tuple[int, bool]]:
    """Per rank: for each collective, (references it added to rank 0's input storage, result right)."""
    group = dist.group.WORLD.group_name
    out: dict[str, tuple[int, bool]] = {}
    for name, (issue, expect) in _ops(group, world).items():
        dist.barrier()
        if rank == 1:
            time.sleep(late_s)
            res = issue(torch.ones(N))
            F.wait_tensor(res)
            continue
        x = torch.randn(N, generator=torch.Generator().manual_seed(0))
        want = expect(x.clone())
        before = _refs(x)
        res = issue(x)
        # references to x's storage the issued collective added (the result counts once if it is x's)
        refs = (
            _refs(x)
            - before
            - (1 if res is not x and res.untyped_storage().data_ptr() == x.data_ptr() else 0)
        )
        del x  # the eager runtime's `x = None` after x's last use
        gc.collect()
        junk = [torch.full((N,), float(i)) for i in range(64)]  # reuse freed memory, if any was freed
        del junk
        got = F.wait_tensor(res)
        out[name] = (refs, torch.equal(got, want))
    return out


def probe(late_s: float = 0.5) -> dict[str, tuple[int, bool]]:
    """Rank 0's findings: collective name -> (references it held to the input, result right)."""
    return run_ranks(body, 2, late_s, timeout=300)[0]


def main() -> int:
    late_s = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    r0 = probe(late_s)
    bad = 0
    for name, (refs, ok) in r0.items():
        print(f"{name:36s} references to the input held: {refs}  result right: {ok}")
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
