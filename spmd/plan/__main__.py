"""Plan a run: search data-parallel configurations of a model's train step and print them, fastest first.

    python -m spmd.plan --preset llama3.1-8b --world-size 8 --batch 2 --seq 8192 --mixed-precision bf16 \
        --device h100-80gb --memory-per-rank 80GiB
    python -m spmd.plan --hf-config config.json --world-size 1024 --device h100-80gb --batch 2 --seq 8192
    python -m spmd.plan --model gpt2-small --world-size 2 --device cpu-local --json

The model is built under FakeTensorMode (no weights, no download); see spmd.models and spmd.plan.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import spmd
from spmd import models
from spmd.plan import REFINE, NamedPlan, plan

# Hugging Face model types with Llama's module names (spmd.parallel.tp_plans.llama), and the plan
# the command line searches tensor parallelism with for them (Mixtral: experts replicated over tp).
# Every other model (the built-in GPT, GPT-2, BERT-like causal LMs...) gets automatic placements.
_LLAMA_FAMILY = {
    "llama": "tp_plans.llama(sequence_parallel=True)",
    "mistral": "tp_plans.llama(sequence_parallel=True)",
    "qwen2": "tp_plans.llama(sequence_parallel=True)",
    "qwen3": "tp_plans.llama(sequence_parallel=True)",
    "mixtral": "tp_plans.llama(mlp=False, sequence_parallel=True)",
}
# --tp-plan's hand plans (Mixtral keeps its experts replicated with either)
_HAND_PLANS = {"llama": "tp_plans.llama()", "llama-sp": "tp_plans.llama(sequence_parallel=True)"}


def default_tp_plan(args: Any) -> NamedPlan | str:
    """The plan the ``--tp`` search uses: ``--tp-plan`` when given (``auto``, ``llama``,
    ``llama-sp``); else torchtitan's Llama plan for a Llama-family ``--preset``/``--hf-config``
    and ``"auto"`` (automatic placements) for any other model."""
    choice = getattr(args, "tp_plan", None)
    source = args.hf_config or args.preset
    model_type = models.hf_config(source).model_type if source is not None else None
    if choice == "auto" or (choice is None and model_type not in _LLAMA_FAMILY):
        return "auto"
    if choice is None:
        expr = _LLAMA_FAMILY[str(model_type)]
    else:
        expr = _HAND_PLANS[choice]
        if model_type == "mixtral":
            expr = expr.replace("llama(", "llama(mlp=False" + (", " if "sequence" in expr else ""))
    from spmd.parallel import tp_plans

    return NamedPlan(eval(expr, {"tp_plans": tp_plans}), expr)  # noqa: S307 - our own literal


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _bools(s: str) -> list[bool]:
    words = {"true": True, "false": False, "1": True, "0": False}
    return [words[x.strip().lower()] for x in s.split(",") if x]


def _remats(s: str) -> list[Any]:
    """``none,selective,full,0.5`` -> ``[None, "selective", "full", 0.5]``."""
    out: list[Any] = []
    for x in (x.strip() for x in s.split(",") if x.strip()):
        if x.lower() == "none":
            out.append(None)
        elif x in ("selective", "op", "full"):
            out.append(x)
        else:
            out.append(float(x))
    return out


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spmd.plan", description=__doc__.split("\n\n")[0])
    models.add_model_arguments(p)
    p.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    p.add_argument("--device", default="h100-80gb", help="h100-80gb, a100-80gb, cpu-local or a profile json")
    p.add_argument("--memory-per-rank", default=None, help="budget per rank, e.g. 80GiB or 80GB")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: the device's)")
    p.add_argument(
        "--efficiency", type=float, default=None, help="fraction of peak FLOP/s reached (default 1)"
    )
    p.add_argument("--styles", default="replicate,fully_shard,hybrid_shard", help="comma-separated styles")
    p.add_argument("--prefetch", type=_ints, default=[0, 1, 2], help="prefetch depths, e.g. 0,1,2")
    p.add_argument("--min-unit-mb", type=_floats, default=[1.0, 64.0], help="min_unit_mb values, e.g. 1,64")
    p.add_argument(
        "--reshard",
        type=_bools,
        default=[True, False],
        help="fully_shard reshard_after_forward values: true,false",
    )
    p.add_argument(
        "--remat",
        type=_remats,
        default=None,
        help="remat policies of the sharded styles: none,selective,op,full or budgets like 0.5 "
        "(default: none,selective,full)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="lower every configuration on the full model (default: a model of identical blocks is "
        "searched on copies with 3 and 6 blocks and extrapolated; see --confirm)",
    )
    p.add_argument(
        "--refine",
        type=int,
        default=REFINE,
        help=f"search the pass options (prefetch, unit size) of this many of the best partitionings "
        f"of each tp size (default {REFINE}; 0: every configuration)",
    )
    p.add_argument(
        "--confirm",
        choices=["auto", "yes", "no"],
        default="auto",
        help="lower the best folded row on the full model: auto (for models of at most 32 blocks), yes, no",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=min(4, _cores()),
        help="processes to search in (default: the cores here, at most 4)",
    )
    p.add_argument(
        "--tp",
        type=_ints,
        default=None,
        help="tensor-parallel sizes searched (default 1,2,4,8, within --gpus-per-node); 1 for none",
    )
    p.add_argument(
        "--tp-plan",
        choices=["auto", *_HAND_PLANS],
        default=None,
        help="the placements of the --tp search: auto (chosen from the graph), llama or llama-sp "
        "(tp_plans.llama(), with sequence parallelism). Default: llama-sp for a Llama-family "
        "--preset/--hf-config (Llama, Mistral, Qwen2/3; Mixtral with its experts replicated), "
        "auto for any other model",
    )
    p.add_argument("--tokens-per-step", type=int, default=None, help="tokens per rank per step")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="log spmd's progress to stderr")
    args = p.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    fn, (model, optim, idx, targets), mp = models.build_from_args(args)
    step = spmd.compile()(fn)
    result = plan(
        step,
        model,
        optim,
        idx,
        targets,
        world_size=args.world_size,
        device=args.device,
        memory_per_rank=args.memory_per_rank,
        tokens_per_step=args.tokens_per_step,
        gpus_per_node=args.gpus_per_node,
        mixed_precision=mp,
        styles=[s for s in args.styles.split(",") if s],
        prefetch=args.prefetch,
        min_unit_mb=args.min_unit_mb,
        reshard=args.reshard,
        remat=args.remat,
        tp_plan=default_tp_plan(args),
        tp=args.tp,
        efficiency=args.efficiency,
        exact=args.exact,
        refine=args.refine or None,
        confirm={"auto": None, "yes": True, "no": False}[args.confirm],
        jobs=args.jobs,
    )
    print(result.to_json() if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
