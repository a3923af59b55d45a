"""Mixed precision against FSDP2 ``fully_shard(mp_policy=MixedPrecisionPolicy(...))`` on 2 gloo
ranks, with different data per rank: every step's loss and the final parameters bit for bit.

FSDP2 is applied as its users do (``fully_shard`` on each block, then the root) with the same
policy. Why bit for bit is reachable: both cast each fp32 shard to ``param_dtype`` and gather
it (a cast is elementwise, so where it happens does not change a bit), compute forward and
backward with the same ATen kernels in ``param_dtype``, reduce with the same gloo
collective in the reduce dtype (``avg``; at W=2 the halving is exact), cast the reduced
shard back to fp32 and step the same fp32 optimizer.

One caveat, measured and kept out of these models: CPU fused optimizer kernels
(``fused=True`` Adam/AdamW) round an element differently in their SIMD loop (fused
multiply-add) than in their scalar tail. spmd feeds them shards placed where the full
tensor's elements sit, so it matches DDP (see ``sharded_optim.align_fused_optimizer``); FSDP2 runs them
on the bare shard, whose own length decides the split. Where a shard's length or offset
is not a multiple of the SIMD width (8 floats with AVX2, 16 with AVX-512), the two can
differ by one rounding: 7.5e-9 in a 12-element bias of the "nested" model after 5 AdamW
steps here, and bit for bit once that alignment is switched off. The fused-optimizer cases
below use TinyGPT, whose shards are all multiples of 16 elements; the others use foreach
SGD, which rounds every element alike.
"""

from __future__ import annotations

import pytest

from tests.dist import workers_mixed_precision as workers
from tests.dist.launcher import run_ranks

BF16_PARAMS_FP32_REDUCE = [
    dict(model="tinygpt", optim="sgd_momentum_foreach", style="fully_shard", param="bf16", reduce="fp32"),
    dict(model="tinygpt", optim="adamw_fused", style="fully_shard", param="bf16", reduce="fp32", eval=True),
    dict(
        model="tinygpt", optim="adamw_fused", style="fully_shard", param="bf16", reduce="fp32", reshard=False
    ),
    # replicate: fp32 replicated master weights, the cast in the graph, all-reduce in fp32.
    dict(model="tinygpt", optim="sgd_momentum_foreach", style="replicate", param="bf16", reduce="fp32"),
]
LOW_PRECISION_REDUCE_AND_INPUTS = [
    # reduce_dtype None: gradients reduced in param_dtype (bf16), cast to fp32 for the optimizer.
    dict(model="tinygpt", optim="adamw_fused", style="fully_shard", param="bf16", reduce=None),
    # fp32 compute, bf16 reduce-scatter of padded (uneven) shards.
    dict(model="uneven", optim="sgd_momentum_foreach", style="fully_shard", param=None, reduce="bf16"),
    # float inputs cast to bf16 at the root and at every unit, as FSDP2 at each fully_shard-ed module.
    dict(model="mlp", optim="sgd_momentum_foreach", style="fully_shard", param="bf16", reduce="fp32"),
]


# Llama: rotary cos/sin computed in fp32 at the root and passed to every layer. FSDP2 (each
# layer fully_shard-ed, then the root) casts them to bf16 at every layer; so does spmd by
# default (every communication unit). Casting at the root only leaves them fp32 (the rotary
# products promote to fp32) and differs: the control shows the test sees it.
PER_MODULE_INPUT_CASTS = [
    dict(model="llama", optim="adamw_fused", style="fully_shard", param="bf16", reduce="fp32"),
    # FSDP2 output_dtype at each fully_shard-ed Linear (spmd: the modules listed, and the root).
    dict(
        model="mlp",
        optim="sgd_momentum_foreach",
        style="fully_shard",
        param="bf16",
        reduce="fp32",
        output="fp32",
        cast_at=["net.0", "net.2"],
    ),
    dict(
        model="llama",
        optim="adamw_fused",
        style="fully_shard",
        param="bf16",
        reduce="fp32",
        cast_at=[],
        differs=True,
    ),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "cases",
    [BF16_PARAMS_FP32_REDUCE, LOW_PRECISION_REDUCE_AND_INPUTS, PER_MODULE_INPUT_CASTS],
    ids=["bf16_params_fp32_reduce", "low_precision_reduce_and_inputs", "per_module_input_casts"],
)
def test_bitwise_parity_with_fsdp2(cases: list[dict]) -> None:
    """Per-step losses (bf16, as FSDP2's), final full parameters and an eval step's output
    equal FSDP2's bit for bit."""
    results = run_ranks(workers.against_fsdp2, 2, cases, 4, timeout=540)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)
