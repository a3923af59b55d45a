"""Llama 3.1 8B at torchtitan's Table 1 setting: predicted tokens/s per GPU and peak, per profile.

    PYTHONPATH=$PWD python benchmarks/plan_validation/plan_llama8b.py [--remat op] [--layers 32]
        [--profiles h100-hbm2e-500w,h100-hbm2e-500w@sxm,h100-80gb,h100-80gb-roofline]

The setting (torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1; formerly
``benchmarks/results/performance.md``): 8 H100 (96 GB HBM2e at 2.4 TB/s, 500 W), local batch 2, sequence 8192,
FSDP, bf16 parameters with fp32 gradient reduction, selective ("op") activation checkpointing:
``remat="op"``, torchtitan's policy itself (the default here; with another ``--remat`` the
matmuls torchtitan's policy would recompute beside ours are priced apart and added). The
step is the one ``python -m spmd.plan --preset llama3.1-8b ...`` builds (Hugging Face
``LlamaForCausalLM`` under FakeTensorMode), lowered once with ``spmd.simulate``'s machinery
(fully_shard, resharding after forward, prefetch 1, ``min_unit_mb=1``, the given remat), and its
final graph priced on each profile (``passes.cost_model``): one JSON line per profile, with the
compute time and FLOPs by op class (torch's count; ``tflops_run`` counts a causal attention's
unmasked share, what the kernel runs), the matmuls torchtitan's checkpointing recomputes beside
ours (:func:`torchtitan_sac_recompute`) and the tokens/s with them added. ``NAME@sxm`` is
profile NAME with the H100 SXM's datasheet peak FLOP/s (torchtitan's GPU lies between the NVL
figure ``h100-hbm2e-500w`` takes and the SXM's). About a minute on an idle 2-core machine (the
lowering; each pricing is seconds).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch
import torch.nn.functional as F

import spmd
from passes import collectives as C
from passes.cost_model import (
    DeviceProfile,
    _is_free,
    causal_share,
    compute_time,
    estimate_step_time,
    op_class,
)
from passes.meta import Phase, module_of, phase_of
from passes.prefetch import unit_path
from spmd import models
from spmd.plan import _group_info
from spmd.profiles import PROFILES, get_profile
from spmd.simulate import fake_copy, fake_world, fresh_copy

TORCHTITAN = {"tokens_per_s_eager": 5762, "tokens_per_s_compiled": 6667, "peak_GiB_eager": 82.4}


def torchtitan_sac_recompute(gm: torch.fx.GraphModule, prof: DeviceProfile) -> tuple[float, float]:
    """(seconds, FLOPs) of the matmuls torchtitan's selective "op" checkpointing recomputes and
    ``remat="selective"`` does not: its policy (``torchtitan/parallelisms/parallelize_llama.py``,
    ``_custom_policy`` at the Table 1 commit 9dec370) saves the outputs of ``aten.mm`` and SDPA
    "except every second mm" of each block's forward (a per-block counter), so backward runs the
    2nd, 4th and 6th forward mm of every block again (k_proj, o_proj, up_proj: the call order of
    both Llamas). Priced here on the same nodes of the final graph, in program order."""
    count: dict[str, int] = collections.defaultdict(int)
    secs = flops = 0.0
    for n in gm.graph.nodes:
        if n.target is not torch.ops.aten.mm.default or phase_of(n) is not Phase.FORWARD:
            continue
        block = unit_path(module_of(n))
        count[block] += 1
        if count[block] % 2 == 0:
            t, f = compute_time(n, prof)
            secs += t
            flops += f
    return secs, flops


def torchtitan_step(
    model: torch.nn.Module, optim: torch.optim.Optimizer, idx: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """torchtitan's Llama training step at the Table 1 commit (``train.py``): cross-entropy on the
    logits cast to fp32, gradient clipping to norm 1.0 (``training.max_norm``), AdamW."""
    logits = model(input_ids=idx, use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optim.step()
    optim.zero_grad()
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--remat",
        default="op",
        help="op (torchtitan's 'op' policy), none, selective, full or a budget",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--profiles", default="h100-hbm2e-500w,h100-hbm2e-500w@sxm,h100-80gb,h100-80gb-roofline")
    p.add_argument(
        "--step",
        default="torchtitan",
        choices=["torchtitan", "spmd"],
        help="torchtitan: its loss (fp32 logits), clipping and foreach AdamW, the whole logits "
        "(chunked_loss=False); spmd: `python -m spmd.plan --preset`'s step (fused AdamW, no "
        "clipping, chunked loss head)",
    )
    args = p.parse_args()
    margs = argparse.ArgumentParser()
    models.add_model_arguments(margs)
    setting = ["--preset", "llama3.1-8b", "--batch", "2", "--seq", "8192", "--mixed-precision", "bf16"]
    ns = margs.parse_args(setting)
    fn, (model, optim, idx, targets), mp = models.build_from_args(ns)
    if args.layers != 32:  # a shorter stack for a quick look (the prediction is then not the 8B's)
        cfg = {**models.PRESETS["llama3.1-8b"], "num_hidden_layers": args.layers}
        model, optim, idx, targets = models.build_hf(cfg, batch=2, seq=8192, fake=True)
    remat = None if args.remat == "none" else args.remat
    if remat not in (None, "selective", "op", "full"):
        remat = float(remat)
    dp = spmd.DataParallel(
        "fully_shard",
        mixed_precision=mp,
        reshard_after_forward=True,
        forward_prefetch=1,
        backward_prefetch=1,
        min_unit_mb=1,
    )
    if args.step == "torchtitan":
        fn = torchtitan_step
        # torchtitan's AdamW (build_optimizers): foreach, as optimizer.fused is off in its config.
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    chunked = "auto" if args.step == "spmd" else False
    step = spmd.compile(parallel_mode=dp, remat=remat, chunked_loss=chunked)(fn)
    names = args.profiles.split(",")
    accelerator = {get_profile(n.partition("@")[0]).accelerator for n in names}
    if len(accelerator) != 1:
        p.error("--profiles: one lowering serves every profile; give all GPU or all CPU profiles")
    t0 = time.perf_counter()
    sim = fresh_copy(step)
    sim._target_accelerator = accelerator.pop()  # the chunked head's chunks as on the profiles' device
    fargs, fkw = fake_copy((model, optim, idx, targets), {})
    tokens = idx.numel()
    with fake_world(args.world_size):
        sim.lower(*fargs, **fkw)
        rep = sim.report()
        gm = sim.graphs["final"]
        lower_s = time.perf_counter() - t0
        for name in names:
            base, _, peak = name.partition("@")
            prof = get_profile(base)
            if peak == "sxm":
                prof = get_profile(base, peak_flops=PROFILES["h100-80gb"].peak_flops)
            info = _group_info(prof.gpus_per_node)
            cost = estimate_step_time(gm, prof, info)
            by_class: dict[str, float] = collections.defaultdict(float)
            flops_by_class: dict[str, float] = collections.defaultdict(float)
            run = 0.0
            for n in gm.graph.nodes:
                if n.op == "call_function" and not (C.is_collective(n) or C.is_wait(n) or _is_free(n)):
                    t, f = compute_time(n, prof)
                    by_class[op_class(n)] += t
                    flops_by_class[op_class(n)] += f
                    run += f * causal_share(n) if op_class(n) == "attention" else f
            tps = tokens / cost.step_s
            # remat="op" is torchtitan's policy: its recompute is in the graph already.
            sac_s, sac_flops = torchtitan_sac_recompute(gm, prof) if remat != "op" else (0.0, 0.0)
            # Added to the compute stream's critical path: the step is compute-bound (the
            # collectives hide but for the exposed time printed).
            tps_sac = tokens / (cost.step_s + sac_s)
            print(
                json.dumps(
                    {
                        "profile": name,
                        "remat": args.remat,
                        "step": args.step,
                        "layers": args.layers,
                        "tokens_per_s_per_gpu": round(tps),
                        "vs_torchtitan_eager": round(tps / TORCHTITAN["tokens_per_s_eager"] - 1, 3),
                        "step_s": round(cost.step_s, 4),
                        "compute_s": round(cost.compute_s, 4),
                        "compute_s_by_class": {k: round(v, 4) for k, v in sorted(by_class.items())},
                        "comm_s": round(cost.comm_s, 4),
                        "exposed_comm_s": round(cost.exposed_comm_s, 4),
                        "tflops_counted": round(cost.flops / 1e12, 1),
                        "tflops_by_class": {k: round(v / 1e12, 1) for k, v in sorted(flops_by_class.items())},
                        "tflops_run": round(run / 1e12, 1),
                        "peak_GiB": round(rep.peak_memory_bytes / 2**30, 2),
                        "loss_heads": rep.loss_heads,
                        "torchtitan_sac_recompute_s": round(sac_s, 4),
                        "torchtitan_sac_recompute_tflops": round(sac_flops / 1e12, 1),
                        "tokens_per_s_with_torchtitan_sac": round(tps_sac),
                        "vs_torchtitan_eager_with_sac": round(
                            tps_sac / TORCHTITAN["tokens_per_s_eager"] - 1, 3
                        ),
                        "lower_s": round(lower_s, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
