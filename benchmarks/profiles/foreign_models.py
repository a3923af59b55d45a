"""Models we did not write at world size 1 and in simulation (the table of
benchmarks/results/foreign-models.md).

    OMP_NUM_THREADS=1 python benchmarks/profiles/foreign_models.py                 # the Hugging Face models
                                            # added to tests/sweep_models.py last (HF_MORE)
    OMP_NUM_THREADS=1 python benchmarks/profiles/foreign_models.py hf_gpt2 hf_opt  # some sweep models by name

For each model of ``tests/sweep_models.py``: (a) ``spmd.compile()`` of the sweep's train step
(forward, backward, fused AdamW, zero_grad) against the same eager step, 3 steps from the same
values and the same seed (dropout on where the config has it), bit for bit on the loss and on every
parameter after the steps, and the number of graphs compiled; (b) ``spmd.simulate`` of its
fully_shard step at world size 8 (the predicted peak per rank and the time). An spmd error is
printed as the model's result. The 2-rank comparison with DDP and FSDP2 is the sweep's:
``SPMD_SWEEP_FULL=1 SPMD_SWEEP_MODELS=hf_gpt2,... pytest tests/dist/test_sweep.py``.
"""

import copy
import logging
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import spmd  # noqa: E402
from tests import sweep_models as S  # noqa: E402

STEPS = 3  # steps compared with eager
WORLD = 8  # simulated world size


def _step_of(loss_of: Any) -> Any:
    def train_step(model, optim, *batch):
        loss = loss_of(model, *batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return train_step


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def against_eager(name: str) -> str:
    case = S.build(name)
    model, ref = case.model, copy.deepcopy(case.model)
    opt, ref_opt = _adamw(model), _adamw(ref)
    fn = _step_of(case.loss)
    step = spmd.compile()(fn)
    g = torch.Generator().manual_seed(1)
    for i in range(STEPS):
        batch = case.batch(g)
        torch.manual_seed(10 + i)
        try:
            loss = step(model, opt, *batch)
        except spmd.SpmdError as e:
            return f"{type(e).__name__}: {str(e)[:300]}"
        torch.manual_seed(10 + i)
        ref_loss = fn(ref, ref_opt, *batch)
        if not torch.equal(loss, ref_loss):
            return f"step {i}: loss {loss.item()!r} != eager's {ref_loss.item()!r}"
    differ = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]
    if differ:
        return f"after {STEPS} steps {len(differ)} parameters differ from eager's, first {differ[0]}"
    return f"bit for bit ({STEPS} steps, {step.num_graphs} graph)"


def simulated(name: str) -> str:
    case = S.build(name)
    step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard"))(_step_of(case.loss))
    t0 = time.perf_counter()
    try:
        report = spmd.simulate(
            step, case.model, _adamw(case.model), *case.batch(torch.Generator()), world_size=WORLD
        )
    except spmd.SpmdError as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    return f"peak {report.peak_memory_bytes / 2**20:.2f} MiB/rank, {time.perf_counter() - t0:.1f} s"


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    names = sys.argv[1:] or list(S.HF_MORE)
    print(f"| model | world size 1 vs eager | simulate, fully_shard, {WORLD} ranks |")
    print("|---|---|---|")
    for name in names:
        print(f"| {name} | {against_eager(name)} | {simulated(name)} |", flush=True)


if __name__ == "__main__":
    main()
