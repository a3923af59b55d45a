"""The options of ``spmd.compile`` (``**options``): what each one means, and the checks of
those whose value alone can be wrong. :mod:`spmd.api` rejects a name not listed here;
:mod:`spmd.plan` reads the list to know which axes it can search."""

from __future__ import annotations

from typing import Any

from spmd.errors import ConfigError
from spmd.parallel import DataParallel, ParallelMode

OPTIONS: dict[str, str] = {
    "dump_dir": "directory to write every graph stage and the report to (env SPMD_DUMP_DIR)",
    "cache_size_limit": "most graphs kept for one compiled step before raising CacheLimitError (8)",
    "disabled_passes": "names of pipeline passes to skip",
    "check_invariants": "run the graph invariant checker after every pass (env SPMD_DEBUG=1)",
    "backend": "'eager' (default: the final graph runs op by op) or 'inductor' (compiled; "
    "see spmd.backend.lowering)",
    "cross_step_prefetch": "issue the first all-gather of the next step at the end of this one and carry "
    "it between calls (fully_shard, eager backend; env SPMD_CROSS_STEP_PREFETCH=1; see spmd.backend.carry)",
    "inductor_optimizer": "'opaque' (default: ATen's fused optimizer kernel, called in place) or 'inline' "
    "(its math, fused by inductor); backend='inductor' only",
    "inductor_gemm": "'auto' (default: per float32 CPU matmul shape, whichever of torch's mm/addmm and "
    "oneDNN's matmul measured faster here, cached; see spmd.backend.gemm_policy), 'onednn' (oneDNN's "
    "matmul for large ones) or 'aten' (torch's mm/addmm: MKL's sgemm in x86 builds); backend='inductor' only",
    "inductor_fallback": "'measure' (default: the first calls time inductor's code against the eager "
    "backend's graph of the same step, alternating, and keep the faster; the same choice on every rank; "
    "see spmd.backend.step_aside) or 'never' (always inductor's code); backend='inductor' only",
    "inductor_config": "dict of torch._inductor.config settings for backend='inductor' (applied over spmd's)",
    "chunked_loss": "the loss head (output projection + cross-entropy, forward and backward) as one node "
    "that runs over chunks of tokens, so the [tokens, vocab] logits never exist: 'auto' (default: when "
    "one logits buffer is >= 1 GiB), True (whenever recognised), False (never) or an int (tokens per "
    "chunk); data-parallel modes only; see docs/loss-head.md",
    "remat": "None (default: save what autograd saves), 'selective' (recompute cheap ops in backward; "
    "not the loss head), 'op' (torchtitan's selective_ac_option='op': 'selective' and every second "
    "matmul of a block), 'full' (recompute each block from its input) or a float in (0, 1) (a memory "
    "budget, torch's activation_memory_budget: saved bytes from those of 'full' near 0 to 'selective' "
    "near 1; 1.0 is None); see passes.remat and docs/remat.md",
    "share_compile": "backend='inductor': ranks of a host with the same graph compile it once and load it "
    "from inductor's caches (default False: no gain measured with 2 ranks on 2 cores; True or env "
    "SPMD_SHARE_COMPILE=1 turns it on where safe; see spmd.backend.compile_once)",
}


def check_chunked_loss(value: Any, parallel_mode: ParallelMode | None) -> bool | int | str:
    """The ``chunked_loss`` option, validated."""
    ok = value == "auto" or isinstance(value, bool) or (type(value) is int and value > 0)
    if not ok:
        raise ConfigError(
            f"spmd.compile: chunked_loss={value!r}; use 'auto' (chunk a big loss head), True (chunk "
            "any recognised head), False (never) or a positive int (tokens per chunk)."
        )
    forced = value != "auto" and value is not False
    if forced and parallel_mode is not None and not isinstance(parallel_mode, DataParallel):
        raise ConfigError(
            f"spmd.compile: chunked_loss={value!r} needs a DataParallel mode (the chunked head is a "
            f"custom op that {type(parallel_mode).__name__} cannot shard); drop chunked_loss or use "
            "spmd.DataParallel."
        )
    return value  # type: ignore[no-any-return]
