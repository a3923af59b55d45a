"""Lower the final graph with inductor (``spmd.compile(..., backend="inductor")``).

The whole final graph -- compute, the functional collectives the partitioner and the
passes placed, their waits, and the optimizer update -- goes to inductor as one graph
(:func:`torch._inductor.compile_fx.compile_fx`, which functionalizes it with
AOTAutograd and lowers the ``_c10d_functional`` ops itself). Three things keep the
result equal to the eager graph in what matters:

* **State is updated in place.** The final graph mutates parameters, buffers and
  optimizer state in place. Functionalization turns an ATen fused optimizer op
  (``_fused_adamw_`` ...) into its out-of-place twin plus a ``copy_`` back: a
  param-sized temporary and copy per state tensor per step. Before lowering, each
  such op is swapped for an opaque custom op with the same schema (its mutable
  arguments declared), which AOTAutograd wraps in ``auto_functionalized`` and
  inductor's reinplacing pass turns back into the in-place call on the real tensors.
  Other input mutations (``_foreach_add_`` on step counters, BatchNorm statistics)
  become ``copy_`` epilogues that inductor writes straight into the inputs.
* **Collectives keep their order.** inductor's comm reordering and bucketing are
  switched off, and after compiling, the order of collectives in inductor's generated
  code is parsed and compared with the final graph's (:func:`check_collective_order`).
  Every rank checked that graph's order against the others
  (:mod:`spmd.parallel.agreement`), so equal order here means ranks still agree;
  a difference raises :class:`spmd.errors.LoweringError` instead of a hang.
* **Random ops draw from the eager generator** (``fallback_random``), so dropout
  masks match the eager backend.

Speed: each float32 CPU matmul shape calls whichever of ATen's ``mm`` (MKL's sgemm) and oneDNN's
matmul measured faster on this machine (``inductor_gemm="auto"``, the default;
:mod:`spmd.backend.gemm_policy`):
oneDNN won 1.5-3x on an AMD EPYC with AVX-512 and lost on most shapes on one with AVX2 only;
matmuls are ~75% of the bench GPT's step. ``inductor_optimizer="inline"``
lets inductor fuse the Adam/AdamW update itself instead of calling ATen's fused kernel (no
measurable gain on the bench GPT: the optimizer is ~1% of its step).

Numerics: inductor fuses and reorders floating-point math, so results differ from the
eager backend by rounding (about 1e-6 relative per step on the test models), not bit
for bit. Use ``backend="eager"`` (the default) for DDP bit-for-bit parity.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import torch
import torch.fx as fx

from passes import collectives as C
from passes.torch_compat import INDUCTOR_OUTPUT_OTHER_CHECKS, INDUCTOR_OUTPUT_SIZE_CHECKS, OpOverload
from spmd.backend.compile_once import Role, compile_once_per_host, graph_key, sharing_safe
from spmd.backend.inductor_rewrites import for_inductor
from spmd.errors import LoweringError, check_choice

log = logging.getLogger("spmd")

BACKENDS = ("eager", "inductor")
# How inductor gets the fused optimizers: "opaque" calls ATen's fused kernel in place;
# "inline" writes out its math so inductor fuses it into one kernel per tensor.
OPTIMIZER_LOWERINGS = ("opaque", "inline")
# Which library the float32 CPU matmuls of the lowered graph call: "auto" (the default: per shape,
# whichever measured faster on this machine, spmd.backend.gemm_policy), "onednn" (oneDNN's matmul for every
# large one, spmd.backend.inductor_rewrites) or "aten" (``mm``/``addmm``: MKL's sgemm in x86 builds).
GEMMS = ("auto", "onednn", "aten")
# inductor settings for the whole-step graph. Our passes already placed collectives,
# prefetches and waits; inductor must not move or bucket them (a reorder that differs
# across ranks hangs, and one that matches still undoes our schedule).
_INDUCTOR_CONFIG: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "fallback_random": True,
}


@dataclasses.dataclass
class Lowered:
    """A compiled final graph: ``fn(*flat_inputs) -> outputs``, like calling the GraphModule."""

    fn: Callable[..., Any]
    backend: str
    code: str  # inductor's generated Python ("" for eager)
    lower_s: float  # seconds spent compiling (0 for eager), waiting for a shared compile included
    collective_order: list[Issued]  # as the code issues them (see code_order)
    role: str = "alone"  # shared compile (spmd.backend.compile_once): "alone", "leader" or "follower"
    wait_s: float = 0.0  # seconds a follower waited for its leader's compile (part of lower_s)


def check_backend(backend: Any) -> str:
    return check_choice(
        "backend",
        backend,
        BACKENDS,
        "'eager' runs the final graph op by op, 'inductor' compiles it",
    )


def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    backend: str,
    *,
    inductor_config: dict[str, Any] | None = None,
    optimizer: str = "opaque",
    gemm: str = "auto",
    share: bool = False,
) -> Lowered:
    """Compile ``gm`` (a final spmd graph) for ``backend``.

    Args:
        gm: the final graph; it is not modified (inductor gets a copy).
        example_inputs: the real (local) tensors its placeholders take; not modified.
        backend: ``"eager"`` (returns ``gm`` itself) or ``"inductor"``.
        inductor_config: extra ``torch._inductor.config`` settings, applied over ours.
        optimizer: ``"opaque"`` or ``"inline"`` (see
            :func:`spmd.backend.inductor_rewrites.for_inductor`).
        gemm: ``"auto"``, ``"onednn"`` or ``"aten"`` (see
            :func:`spmd.backend.inductor_rewrites.onednn_nodes`); ``"auto"`` runs two collectives
            on the default group (every rank lowers at once).
        share: where it is safe, compile once per host for every rank with the same graph
            and let the others load it from inductor's caches (:mod:`spmd.backend.compile_once`).

    Raises:
        LoweringError: inductor failed (here, or on the rank that compiled this graph for the
            host), or its code issues collectives in another order.
    """
    backend = check_backend(backend)
    if backend == "eager":
        return Lowered(gm, "eager", "", 0.0, graph_order(gm))
    from passes.torch_compat import GraphLowering, compile_fx
    from passes.torch_compat import inductor_config as inductor_config_module

    _refuse_restored_rng(gm)
    t0 = time.perf_counter()
    lowered_gm = for_inductor(
        gm,
        inline_optimizer=check_optimizer_lowering(optimizer) == "inline",
        gemm=check_gemm(gemm),
    )
    codes: list[str] = []
    settings = {**_INDUCTOR_CONFIG, **(inductor_config or {})}

    def run_inductor() -> Callable[..., Any]:
        try:
            fakes, context = _fake(example_inputs)
            # no_grad: parameters require grad, and under grad mode AOTAutograd would build
            # a joint forward/backward graph around a step that already contains its backward.
            with (
                context,
                torch.no_grad(),
                inductor_config_module.patch(settings),
                mock.patch.object(GraphLowering, "save_output_code", codes.append),
            ):
                fn = compile_fx(lowered_gm, fakes)
            assert callable(fn), f"compile_fx returned {type(fn).__name__}"
        except Exception as exc:
            raise LoweringError(
                f"spmd: inductor could not compile the final graph ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). Run with backend='eager', "
                "or dump the graph (dump_dir=...) and report the failing op."
            ) from exc
        return fn

    role, wait_s = Role.ALONE, 0.0
    if share and sharing_safe(settings):
        key = graph_key(lowered_gm, example_inputs, (sorted(settings.items()), optimizer, gemm))
        fn, role, wait_s = compile_once_per_host(key, run_inductor)
    else:
        fn = run_inductor()
    lower_s = time.perf_counter() - t0
    code = codes[-1] if codes else ""
    if not code and C.collectives(gm.graph):
        raise LoweringError(
            "spmd: inductor compiled the final graph but its generated code could not be read, so the "
            "order of its collectives cannot be checked against the graph's. Use backend='eager', or "
            "clear inductor's cache (TORCHINDUCTOR_CACHE_DIR) if it came from a damaged cache entry."
        )
    order = check_collective_order(gm, code, example_inputs)
    log.info(
        "spmd: inductor compiled the final graph in %.2f s (%d collectives; %s%s)",
        lower_s,
        len(order),
        role.value,
        f", {wait_s:.2f} s waiting for the leader" if role is Role.FOLLOWER else "",
    )
    return Lowered(fn, "inductor", code, lower_s, order, role.value, wait_s)


def check_optimizer_lowering(optimizer: Any) -> str:
    return check_choice(
        "inductor_optimizer",
        optimizer,
        OPTIMIZER_LOWERINGS,
        "'opaque' calls ATen's fused optimizer kernel, 'inline' lets inductor fuse the update itself",
    )


def check_gemm(gemm: Any) -> str:
    return check_choice(
        "inductor_gemm",
        gemm,
        GEMMS,
        "'auto' times both libraries per matmul shape on this machine and keeps the faster, 'aten' calls "
        "torch's mm/addmm, 'onednn' calls oneDNN's matmul for float32 CPU matmuls",
    )


def _fake(example_inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """Static-shaped fake copies of the inputs under a fake mode with a ShapeEnv, entered as the
    tracing context: inductor's FX graph cache bypasses a compile without one ("No shape env")."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from passes.torch_compat import FakeTensorMode, TracingContext, tracing

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes: list[torch.Tensor] = [mode.from_tensor(t, static_shapes=True) for t in example_inputs]
    return fakes, tracing(TracingContext(mode))


# ----------------------------------------------------------------------------- collective order

# inductor emits the functional op, or its in-place/out variant: all_reduce_, ..._out.
_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.\w+\((.*)\)")
# With cpp_wrapper=True the code is C++: ops with a C shim are called through it (sizes not shown).
_CPP_CALL = re.compile(r"aoti_torch_[a-z]+__c10d_functional_(\w+)\((.*)\)")
_ALLOC = re.compile(r"(buf\w+) = empty_strided\w*\(\(([^)]*)\)")
_REUSE = re.compile(r"(buf\w+) = (buf\w+); del \2\s+# reuse")
# The check of a call's output that shows its size (which function: passes.torch_compat), and the
# other checks inductor writes between that call and the next statement.
_ASSERT = re.compile(rf"(?:{'|'.join(INDUCTOR_OUTPUT_SIZE_CHECKS)})\((\w+), \(([^)]*)\)")
_OTHER_CHECK = re.compile(rf"(?:{'|'.join(INDUCTOR_OUTPUT_OTHER_CHECKS)})\(")
_GETITEM = re.compile(r"(buf\w+) = (buf\w+)\[\d+\]$")
_RESULT = re.compile(r"(buf\w+) = ")
_REINTERPRET = re.compile(r"reinterpret_tensor\((\w+), \(([^)]*)\)")
_NAMES: dict[str, tuple[C.Kind, bool]] = {
    "all_reduce": (C.Kind.ALL_REDUCE, False),
    "all_reduce_coalesced": (C.Kind.ALL_REDUCE, True),
    "all_gather_into_tensor": (C.Kind.ALL_GATHER, False),
    "all_gather_into_tensor_coalesced": (C.Kind.ALL_GATHER, True),
    "reduce_scatter_tensor": (C.Kind.REDUCE_SCATTER, False),
    "reduce_scatter_tensor_coalesced": (C.Kind.REDUCE_SCATTER, True),
    "broadcast": (C.Kind.BROADCAST, False),
    "all_to_all_single": (C.Kind.ALL_TO_ALL, False),
}

# (kind, coalesced, group, element counts of the outputs); counts None where the code
# does not show them (then only kind and group are compared).
Issued = tuple[str, bool, str, tuple[int, ...] | None]


def _numel(shape: str) -> int:
    return math.prod(int(d) for d in shape.replace(" ", "").split(",") if d)


def graph_order(gm: fx.GraphModule) -> list[Issued]:
    """The final graph's collectives, in order, as :func:`code_order` reads them from code."""
    out: list[Issued] = []
    for n in C.collectives(gm.graph):
        val = n.meta.get("val")
        vals = val if isinstance(val, list | tuple) else [val]
        numels = tuple(v.numel() for v in vals if isinstance(v, torch.Tensor))
        out.append((C.kind_of(n).value, C.is_coalesced(n), C.group_of(n), numels or None))
    return out


def code_order(code: str, example_inputs: Sequence[torch.Tensor] = ()) -> list[Issued]:
    """The collectives inductor's generated Python issues, in order.

    Output sizes come from inductor's check of the output after the call (``assert_size_stride``,
    or ``assert_tensor_metadata`` from torch 2.14 on: ``passes.torch_compat``), or, for the
    in-place ``all_reduce_``, from the buffer's allocation (``argN_1`` is input ``N``).
    """
    lines = [ln.strip() for ln in code.splitlines()]
    numel: dict[str, int | None] = {f"arg{i}_1": t.numel() for i, t in enumerate(example_inputs)}
    out: list[Issued] = []
    for i, line in enumerate(lines):
        if m := _ALLOC.match(line):
            numel[m.group(1)] = _numel(m.group(2))
            continue
        if m := _REUSE.match(line):
            numel[m.group(1)] = numel.get(m.group(2))
            continue
        m = _CALL.search(line) or _CPP_CALL.search(line)
        if m is None:
            continue
        name = m.group(1).removesuffix("_out").removesuffix("_")
        if name not in _NAMES:
            continue  # wait_tensor
        kind, coalesced = _NAMES[name]
        args = m.group(2)
        strings = re.findall(r"'([^']*)'|\"([^\"]*)\"", args)
        group = next((a or b for a, b in reversed(strings)), "")
        sizes: list[int] = []
        # The call's result and its items (a coalesced call's outputs): only their checks count.
        mine = {res.group(1)} if (res := _RESULT.match(line)) else set()
        for follow in lines[i + 1 :]:
            if a := _ASSERT.match(follow):
                if a.group(1) in mine:
                    sizes.append(_numel(a.group(2)))
            elif (item := _GETITEM.match(follow)) and item.group(2) in mine:
                mine.add(item.group(1))
            elif not _OTHER_CHECK.match(follow):
                break
        out_buf = re.search(r"\bout=(\w+)", args)  # an _out variant writes its out= buffer
        if not sizes and out_buf and (size := numel.get(out_buf.group(1))) is not None:
            sizes = [size]
        if not sizes and name == "all_reduce":  # in place: the output is the input
            first = args.split(",", 1)[0].strip("[ ")
            r = _REINTERPRET.match(args)
            size = _numel(r.group(2)) if r else numel.get(first)
            sizes = [size] if size is not None else []
        out.append((kind.value, coalesced, group, tuple(sizes) if sizes else None))
    return out


def _same(a: Issued, b: Issued) -> bool:
    return a[:3] == b[:3] and (a[3] is None or b[3] is None or a[3] == b[3])


def check_collective_order(
    gm: fx.GraphModule, code: str, example_inputs: Sequence[torch.Tensor] = ()
) -> list[Issued]:
    """Raise :class:`LoweringError` unless ``code`` issues ``gm``'s collectives in ``gm``'s order
    (same kinds, groups and sizes)."""
    want, got = graph_order(gm), code_order(code, example_inputs)
    if len(want) == len(got) and all(_same(a, b) for a, b in zip(want, got)):
        return got
    i = next((i for i, (a, b) in enumerate(zip(want, got)) if not _same(a, b)), min(len(want), len(got)))

    def show(seq: list[Issued]) -> str:
        if i >= len(seq):
            return "nothing (its sequence ended)"
        kind, coalesced, group, numels = seq[i]
        size = f" of {'+'.join(map(str, numels))} elements" if numels else ""
        return f"{kind}{' (coalesced)' if coalesced else ''}{size} on group {group!r}"

    raise LoweringError(
        f"spmd: inductor's code issues the collectives in a different order than the final graph "
        f"({len(got)} in the code, {len(want)} in the graph; first difference at collective #{i}: "
        f"the graph issues {show(want)}, the code {show(got)}). The ranks agreed on the graph's order, "
        "so running this code could hang or mix up buffers. Keep inductor's comm reordering and "
        "bucketing off (do not pass reorder_for_compute_comm_overlap / bucket_* settings), or use "
        "backend='eager'."
    )


def _refuse_restored_rng(gm: fx.GraphModule) -> None:
    """Raise :class:`LoweringError` if the step restores the generator's state and draws random
    numbers (activation checkpointing around dropout, ``torch.random.fork_rng``).

    The eager backend runs ``spmd::set_rng_state`` where the trace put it, so recomputed dropout
    draws the forward's mask. Inductor sees no dependency between that op and the random ops
    (their generator is global state) and schedules them freely: measured, the recomputation's
    ``bernoulli_`` ran before the restore, so backward used another mask than forward -- wrong
    gradients, silently. Until the ops carry an ordering token, such a step stays eager."""
    from passes.ops import RNG_STATE_OPS

    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    restores = [n for n in nodes if n.target in RNG_STATE_OPS]
    draws = [
        n
        for n in nodes
        if isinstance(n.target, OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
    ]
    if restores and draws:
        ops = sorted({str(n.target.overloadpacket.__name__) for n in draws})
        raise LoweringError(
            "spmd: backend='inductor' cannot compile this step: it saves and restores the random "
            f"generator's state (activation checkpointing or torch.random.fork_rng) around random ops "
            f"({', '.join(ops[:4])}), and inductor would reorder them, so recomputed dropout would draw "
            "another mask than the forward did. Use backend='eager' for this model, or drop the "
            "checkpointing of the modules that use dropout."
        )
