"""spmd on a CUDA GPU: parity with DDP/FSDP2, mixed precision, CPU offload, the inductor backend,
and predicted vs measured step time and peak memory. Not part of the suite (CI has no GPU).

    # bit-for-bit sweep (tests/sweep_models.py) against DDP and FSDP2, NCCL, one GPU:
    torchrun --standalone --nproc_per_node=1 benchmarks/bench/cuda_check.py parity --pg nccl
    # the same at 2 ranks sharing one GPU (NCCL refuses two ranks on one device; gloo moves CUDA tensors):
    torchrun --standalone --nproc_per_node=2 benchmarks/bench/cuda_check.py parity --pg gloo
    # an HF Llama with the 8B's shapes and fewer layers: measured vs the cost model (h100-80gb)
    torchrun --standalone --nproc_per_node=1 benchmarks/bench/cuda_check.py llama --layers 2 --seq 8192

Each mode prints one JSON line per case and writes them to ``--out``. ``parity``: per case the
largest loss and parameter differences from DDP (and FSDP2 where its semantics agree), with
``torch.use_deterministic_algorithms`` on (cuBLAS's workspace fixed), so a difference is spmd's,
not a racing kernel's. ``llama``: the compiled step (fully_shard, bf16 parameters, fp32 reduce,
the given remat) timed with CUDA events, its peak from ``torch.cuda.max_memory_allocated``,
against ``report().peak_memory_bytes`` and ``passes.cost_model.estimate_step_time`` on the
``h100-80gb`` profile; FSDP2 with the same mixed precision on the same model beside it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
import zlib
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import spmd  # noqa: E402
from tests.dist.workers_sweep import _full, _step_of  # noqa: E402 (the CPU sweep's own helpers)

CHEAP_OPT = "sgd_momentum_foreach"


def _setup(pg: str) -> tuple[int, int, torch.device, str]:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not torch.cuda.is_available():  # a smoke run of this script on a CPU machine
        dev = torch.device("cpu")
        pg = "gloo"
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        kw = {"device_id": dev} if pg == "nccl" else {}
        dist.init_process_group(pg, rank=rank, world_size=world, **kw)
    return rank, world, dev, pg


def _emit(rec: dict[str, Any], out: str | None, rank: int) -> None:
    if rank != 0:
        return
    line = json.dumps(rec, default=str)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def _maxdiff(a: Any, b: Any) -> float:
    la = [t for t in torch.utils._pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    lb = [t for t in torch.utils._pytree.tree_leaves(b) if isinstance(t, torch.Tensor)]
    if len(la) != len(lb):
        return float("inf")
    return max(((x.double() - y.double()).abs().max().item() if x.numel() else 0.0) for x, y in zip(la, lb))


def _param_diff(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    worst = 0.0
    for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        a, b = _full(p).detach(), _full(q).detach().to(_full(p).device)
        worst = max(worst, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
    return worst


def _cuda(b: tuple[Any, ...], dev: torch.device) -> tuple[Any, ...]:
    return tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in b)


def parity_case(
    name: str, style: str, backend: str, opt_name: str, dev: torch.device, pg: str, steps: int, **dp: Any
) -> dict[str, Any]:
    """One model compiled by spmd against DDP (and FSDP2 where it applies) on CUDA."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests import models as shared
    from tests import sweep_models as S

    rank = dist.get_rank()
    case = S.build(name)
    model = case.model.to(dev)
    rec: dict[str, Any] = {"mode": "parity", "pg": pg, "world": dist.get_world_size(), "model": name,
                           "style": style, "backend": backend, "optimizer": opt_name}  # fmt: skip
    rec.update({k: str(v) for k, v in dp.items()})
    t0 = time.perf_counter()
    try:
        ids = [dev.index] if dev.type == "cuda" else None
        ddp = DDP(copy.deepcopy(model), device_ids=ids, find_unused_parameters=case.unused_params)
        fsdp2 = None
        if style == "fully_shard" and case.fsdp2 and pg == "nccl" and "offload_policy" not in dp:
            fsdp2 = fully_shard(copy.deepcopy(model))
        opt = shared.make_optimizer(opt_name, model)
        ref_opt = shared.make_optimizer(opt_name, ddp.module)
        f2_opt = shared.make_optimizer(opt_name, fsdp2) if fsdp2 is not None else None
        fn = _step_of(case.loss)
        styles = case.module_styles if style != "replicate" else None
        mode = spmd.DataParallel(style, module_styles=styles, **dp)
        step = spmd.compile(parallel_mode=mode, backend=backend, check_invariants=True)(fn)
        g = torch.Generator().manual_seed(100 + rank)
        loss_ddp = loss_f2 = 0.0
        for i in range(steps):
            b = _cuda(case.batch(g), dev)
            torch.manual_seed(100 + i)
            out = step(model, opt, *b)
            torch.manual_seed(100 + i)
            loss_ddp = max(loss_ddp, _maxdiff(out, fn(ddp, ref_opt, *b)))
            if fsdp2 is not None:
                torch.manual_seed(100 + i)
                loss_f2 = max(loss_f2, _maxdiff(out, fn(fsdp2, f2_opt, *b)))
        _sync()
        rec.update(loss_diff_ddp=loss_ddp, param_diff_ddp=_param_diff(model, ddp.module))
        if fsdp2 is not None:
            rec.update(loss_diff_fsdp2=loss_f2, param_diff_fsdp2=_param_diff(model, fsdp2))
            rec["fsdp2_vs_ddp"] = _param_diff(fsdp2, ddp.module)  # is a difference FSDP2's own?
        rec["bitwise"] = all(v == 0.0 for k, v in rec.items() if k.endswith(("diff_ddp", "diff_fsdp2")))
        rec["kept"] = step.report().kept if backend == "inductor" else None
    except Exception as e:  # noqa: BLE001 - a failure is a finding, reported per case
        rec.update(error=f"{type(e).__name__}: {str(e)[:800]}", tb=traceback.format_exc()[-1500:])
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def mixed_precision_case(dev: torch.device, pg: str, steps: int, attn: str) -> dict[str, Any]:
    """A tiny HF Llama, bf16 parameters / fp32 reduce: spmd fully_shard against FSDP2's mp_policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tests import sweep_models as S

    rec: dict[str, Any] = {"mode": "mixed_precision", "pg": pg, "world": dist.get_world_size(), "attn": attn}
    t0 = time.perf_counter()
    try:
        tf = S._transformers()
        torch.manual_seed(0)
        cfg = tf.LlamaConfig(
            vocab_size=S.V, max_position_embeddings=32, **{**S._LLAMA_LIKE, "attn_implementation": attn}
        )
        model = tf.LlamaForCausalLM(cfg).to(dev)
        ref = copy.deepcopy(model)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in ref.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(ref, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)

        def fn(m, o, x, y):  # noqa: ANN001, ANN202
            logits = m(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            o.step()
            o.zero_grad()
            return loss

        smp = spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        step = spmd.compile(parallel_mode=spmd.DataParallel("fully_shard", mixed_precision=smp))(fn)
        g = torch.Generator().manual_seed(7 + dist.get_rank())
        worst = 0.0
        for _ in range(steps):
            x = torch.randint(1, S.V, (S.B, S.T), generator=g).to(dev)
            worst = max(
                worst, _maxdiff(step(model, opt, x, x.roll(-1, 1)), fn(ref, ref_opt, x, x.roll(-1, 1)))
            )
        calls = S.sdpa_calls(step.graphs["traced"])
        rec.update(loss_diff_fsdp2=worst, param_diff_fsdp2=_param_diff(model, ref),
                   sdpa_is_causal=[c.get("is_causal") for c in calls],
                   sdpa_has_mask=[c.get("attn_mask") is not None for c in calls])  # fmt: skip
        rec["bitwise"] = worst == 0.0 and rec["param_diff_fsdp2"] == 0.0
    except Exception as e:  # noqa: BLE001
        rec.update(error=f"{type(e).__name__}: {str(e)[:800]}", tb=traceback.format_exc()[-1500:])
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def parity(args: argparse.Namespace) -> None:
    from tests import sweep_models as S

    rank, world, dev, args.pg = _setup(args.pg)
    torch.use_deterministic_algorithms(True, warn_only=True)
    names = args.models.split(",") if args.models else list(S.MODELS)
    for name in names:
        if name == "embedding_max_norm":  # refused on purpose (the sweep checks the refusal)
            continue
        for style in args.styles.split(","):
            for backend in args.backends.split(","):
                opt = CHEAP_OPT if (zlib.crc32(name.encode()) + len(style)) % 2 else "adamw_fused"
                with torch.backends.cudnn.flags(enabled=not args.no_cudnn):  # both sides alike
                    rec = parity_case(name, style, backend, opt, dev, args.pg, args.steps)
                rec["cudnn"] = not args.no_cudnn
                _emit(rec, args.out, rank)
    if "offload" in args.extra:
        offload = spmd.CPUOffloadPolicy(pin_memory=True)
        for name in ("fsdp_mlp_stack", "hf_qwen2", "convnet_channels_last"):
            rec = parity_case(
                name, "fully_shard", "eager", CHEAP_OPT, dev, args.pg, args.steps, offload_policy=offload
            )
            _emit(rec, args.out, rank)
    if "mp" in args.extra:
        for attn in ("eager", "sdpa"):
            _emit(mixed_precision_case(dev, args.pg, args.steps, attn), args.out, rank)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ llama


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any, steps: int) -> list[float]:
    """Wall time of each call, the GPU drained before and after (a step ends with ``.item()``-free
    outputs, so the queue is drained here)."""
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _stepper(step: Any, model: Any, optim: Any, batch: list[torch.Tensor]) -> Any:
    """A call that runs one step, alternating the two batches."""
    it = iter(range(10**9))

    def run() -> None:
        i = next(it)
        step(model, optim, batch[i % 2], batch[(i + 1) % 2])

    return run


def _top_kernels(run: Any, top: int) -> list[tuple[str, float]]:
    """The ops with the most device time over two steps (torch.profiler), ms per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        run()
        _sync()
    rows = [(e.key, e.self_device_time_total / 2e3) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return [("TOTAL", round(total, 2))] + [(k[:60], round(v, 2)) for k, v in rows[:top]]


def llama(args: argparse.Namespace) -> None:
    """The 8B's shapes with ``--layers`` blocks on this GPU: measured vs predicted."""
    import statistics

    from transformers import AutoModelForCausalLM

    from passes.cost_model import estimate_step_time
    from spmd import models
    from spmd.plan import _group_info
    from spmd.profiles import get_profile

    rank, world, dev, args.pg = _setup(args.pg)
    shape = {**models.PRESETS["llama3.1-8b"], "num_hidden_layers": args.layers}
    if args.tiny:  # a smoke run of the script: a small model of the same family
        shape.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=512)  # fmt: skip
    cfg = models.hf_config(shape)
    tokens = args.batch * args.seq * world
    g = torch.Generator().manual_seed(rank)
    batch = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(dev) for _ in range(2)]
    prof = get_profile(args.profile)
    for system in args.systems.split(","):
        rec: dict[str, Any] = {"mode": "llama", "system": system, "layers": args.layers, "seq": args.seq,
                               "batch": args.batch, "world": world, "remat": args.remat}  # fmt: skip
        torch.manual_seed(0)
        model = optim = step = run = gm = r = None
        gc.collect()  # nothing of the previous system left: each peak is its own
        _peak_reset()
        try:
            with torch.device(dev):
                model = AutoModelForCausalLM.from_config(cfg)
            if system == "fsdp2":
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for layer in model.model.layers:
                    fully_shard(layer, mp_policy=mp)
                fully_shard(model, mp_policy=mp)
            optim = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
            step: Any = models.causal_lm_step
            if system.startswith("spmd"):
                smp = spmd.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                mode = spmd.DataParallel("fully_shard", mixed_precision=smp)
                backend = "inductor" if system == "spmd_inductor" else "eager"
                step = spmd.compile(
                    parallel_mode=mode, remat=args.remat, backend=backend, chunked_loss=args.chunked_loss,
                    **({"inductor_fallback": args.inductor_fallback} if backend == "inductor" else {}),
                )(models.causal_lm_step)  # fmt: skip
            run = _stepper(step, model, optim, batch)

            rec["first_step_s"] = round(_timed(run, 1)[0], 1)
            _timed(run, 2)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times = _timed(run, args.steps)
            med = statistics.median(times)
            rec.update(step_s=med, step_min_s=min(times), tokens_per_s_per_gpu=tokens / world / med)
            if dev.type == "cuda":
                rec.update(peak_GiB=torch.cuda.max_memory_allocated() / 2**30,
                           reserved_GiB=torch.cuda.max_memory_reserved() / 2**30)  # fmt: skip
            if args.top:
                rec["top_kernels_ms"] = _top_kernels(run, args.top)
            if system.startswith("spmd"):
                r = step.report()
                gm = step.graphs["final"]
                groups = _group_info(8)
                est = estimate_step_time(gm, prof, groups)
                rec.update(predicted_peak_GiB=r.peak_memory_bytes / 2**30, predicted_step_s=est.step_s,
                           predicted_compute_s=est.compute_s, predicted_exposed_comm_s=est.exposed_comm_s,
                           predicted_tokens_per_s=tokens / world / est.step_s, profile=prof.name,
                           slowest=est.slowest, kept=r.kept)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            rec.update(error=f"{type(e).__name__}: {str(e)[:800]}", tb=traceback.format_exc()[-2000:])
        _emit(rec, args.out, rank)
    dist.destroy_process_group()


def _gqa_flop_formulas() -> None:
    """torch < 2.13's SDPA FLOP formulas refuse grouped-query shapes (fewer key/value heads than
    query heads), which the CUDA kernels take with ``enable_gqa``; count them as 2.13 does, with
    the key/value heads broadcast to the query's."""
    from torch.utils import flop_counter as fc

    if getattr(fc.sdpa_flop_count, "__gqa__", False):
        return
    fwd, bwd = fc.sdpa_flop_count, fc.sdpa_backward_flop_count

    def widen(q: Any, *kv: Any) -> list[Any]:
        return [(s[0], q[1], *s[2:]) for s in kv]

    def sdpa_flop_count(q, k, v):  # noqa: ANN001, ANN202
        return fwd(q, *widen(q, k, v))

    def sdpa_backward_flop_count(g, q, k, v):  # noqa: ANN001, ANN202
        return bwd(g, q, *widen(q, k, v))

    sdpa_flop_count.__gqa__ = True  # type: ignore[attr-defined]
    fc.sdpa_flop_count, fc.sdpa_backward_flop_count = sdpa_flop_count, sdpa_backward_flop_count


def main() -> None:
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        _gqa_flop_formulas()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["parity", "llama"])
    p.add_argument("--pg", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", default="", help="parity: comma-separated tests/sweep_models.py names (all)")
    p.add_argument("--styles", default="replicate,fully_shard")
    p.add_argument("--backends", default="eager")
    p.add_argument("--no-cudnn", action="store_true", help="parity: run both sides without cuDNN")
    p.add_argument("--extra", default="offload,mp", help="parity: also offload and/or mp")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--remat", default="selective")
    p.add_argument("--profile", default="h100-80gb")
    p.add_argument("--inductor-fallback", default="measure", help="llama: spmd's inductor_fallback option")
    p.add_argument("--chunked-loss", default="auto", help="llama: spmd's chunked_loss option")
    p.add_argument("--top", type=int, default=0, help="llama: list the N ops with the most device time")
    p.add_argument("--tiny", action="store_true", help="llama: a small model (smoke run of the script)")
    p.add_argument("--systems", default="spmd,fsdp2,spmd_inductor")
    args = p.parse_args()
    if args.remat in ("none", "None"):
        args.remat = None
    cl = args.chunked_loss
    args.chunked_loss = int(cl) if cl.isdigit() else {"on": True, "off": False}.get(cl, cl)
    {"parity": parity, "llama": llama}[args.mode](args)


if __name__ == "__main__":
    from benchmarks import rank_main

    rank_main.run(main)
