"""The cost-based decision behind :func:`spmd.parallel.auto_tp.choose`: shard a class or replicate it.

Once the candidate classes are found and checked by DTensor (:mod:`spmd.parallel.auto_tp`), each
clean class has two alternatives, replicate or shard, and the residual stream between the sharded
regions a third choice, sequence parallelism on or off. Each is priced per rank on a
:class:`~passes.cost_model.DeviceProfile`, against replicating:

- **time saved**: the class's matmul FLOPs (forward, and the two backward matmuls of each) that
  the split takes off every rank, at the profile's matmul rate (its measured ``"matmul"`` curve
  for fp32 where it has one, else peak FLOP/s of the dtype x the matmul efficiency);
- **time added**: the collectives the split adds on the tp group, by
  :func:`passes.cost_model.collective_time` on the profile's links (within a node while tp fits
  in one), plus the launch and host time :func:`~passes.cost_model.estimate_step_time` charges
  each collective and its wait. Tensor parallelism's collectives sit on the critical path (the
  next op needs their result), so none is counted as hidden;
- **memory saved**: ``1 - 1/tp`` of the parameters, gradients and optimizer state, and of the
  activations on the region's flow.

**The rule** (:func:`decide`). A class is sharded when the split saves time (time saved >= time
added); else when it saves memory and its net time cost is at most :data:`THRESHOLD` (5%) of the
step's predicted time on one device (:func:`step_time`, the traced step on the profile): a tp
degree asks for the model to be split, and a split that saves memory for a small share of the
step is what it asks for. Otherwise the class is replicated ("nothing pays"): a small matmul pair
on a slow link, whose all-reduces cost more than the whole step gains. The step's memory is not
known to the choice (no budget reaches it), so it never trades more time for memory than that.
Classes are priced independently (their prices add: a class's collectives and FLOPs do not depend
on another's choice), so deciding each on its own is the exact optimum of this rule; no integer
program is needed. Deterministic: the same graph and profile give the same choice on every rank.

**Which profile.** The caller's (``spmd.plan`` and ``spmd.simulate`` lower for a device profile:
the api hands it to the choice), else :func:`local_profile`: the built-in profile of the local GPU
(by its name: H100, A100), or this machine's calibrated ``cpu-local`` on the CPU. Without one (an
uncalibrated CPU, another GPU) there are no times to compare and every clean class is sharded, as
the tp degree asks; the reason then says so.

Cost of the decision: one pass of the cost model over the traced step (:func:`step_time`) and a
few arithmetic per class.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from passes.cost_model import (
    DeviceProfile,
    GroupInfo,
    collective_time,
    estimate_step_time,
    interpolate,
)

# A split that only saves memory may cost at most this share of the step's predicted time (per
# class). A judgement, not a measurement: torchtitan's Table 4 settings (70B, tp 8) pay a few
# per cent of their step for TP's exposed all-reduces (async TP wins back 5%: 829 -> 876 tok/s),
# so 5% admits the splits tp is used for at scale and refuses the ones that only add latency.
THRESHOLD = 0.05

_GPU_PROFILES = (("H100", "h100-80gb"), ("H200", "h200-141gb"), ("A100", "a100-80gb"))


def local_profile() -> DeviceProfile | None:
    """The profile of the device this process runs on: the built-in one of the local GPU by its
    name (``"H100"`` -> ``h100-80gb``, ``"H200"`` -> ``h200-141gb``, ``"A100"`` -> ``a100-80gb``),
    this machine's calibrated ``cpu-local`` (``python -m spmd.calibrate``) without a GPU; None when
    there is neither."""
    from spmd.profiles import CPU_LOCAL, PROFILES, get_profile, profile_path

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((PROFILES[p] for key, p in _GPU_PROFILES if key in name), None)
    return get_profile(CPU_LOCAL) if profile_path().is_file() else None


def step_time(gm: fx.GraphModule, profile: DeviceProfile) -> float:
    """Predicted seconds of the traced step ``gm`` (single-device semantics: no collectives) on
    one device of ``profile``: what :data:`THRESHOLD` is a share of."""
    return estimate_step_time(gm, profile, lambda g: GroupInfo(1, False), top=0).step_s


def _dtype_key(n: fx.Node) -> str:
    v = n.meta.get("val")
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}.get(
        v.dtype if isinstance(v, torch.Tensor) else torch.float32, "fp32"
    )


def _matmul_s(flops: float, dtype: str, profile: DeviceProfile) -> float:
    """Seconds of one matmul of ``flops`` on ``profile``, as the cost model prices one
    (:func:`passes.cost_model.compute_time`: the measured curve for fp32, else the roofline's
    FLOP/s at the matmul efficiency; the fixed per-call cost cancels in a difference)."""
    curve = profile.op_curves.get("matmul") if dtype == "fp32" else None
    if curve:
        return interpolate(curve, flops)
    peak = profile.peak_flops.get(dtype) or profile.peak_flops["fp32"]
    return flops / (peak * profile.op_efficiency.get("matmul", profile.compute_efficiency))


def compute_saved_s(mats: Iterable[fx.Node], tp: int, profile: DeviceProfile) -> float:
    """Seconds of matmul time a split over ``tp`` ranks takes off each rank: each matmul and its
    two backward matmuls (input and weight gradients, the same FLOPs) run on ``1/tp`` of it."""
    from spmd.parallel.auto_tp_graph import mm_flops

    out = 0.0
    for m in mats:
        f, dt = float(mm_flops(m)), _dtype_key(m)
        if f:
            out += 3 * (_matmul_s(f, dt, profile) - _matmul_s(f / tp, dt, profile))
    return out


def comm_s(comms: Iterable[tuple[str, int]], tp: int, profile: DeviceProfile) -> float:
    """Seconds ``comms`` ((kind, bytes) each) take on a tp group of ``tp`` ranks on ``profile``:
    :func:`~passes.cost_model.collective_time` plus the launch of the collective and of its wait
    and the host's share, as :func:`~passes.cost_model.estimate_step_time` charges them."""
    group = GroupInfo(tp, tp > profile.gpus_per_node)
    each = 2 * profile.op_overhead_s + profile.collective_host_s
    return sum(collective_time(k, b, group, profile) + each for k, b in comms)


def decide(
    saved_s: float, added_s: float, saved_bytes: int, step_s: float, threshold: float = THRESHOLD
) -> bool:
    """Shard (True) or replicate, by the rule in the module docstring."""
    if added_s <= saved_s:
        return True
    return saved_bytes > 0 and added_s - saved_s <= threshold * step_s


def ms(s: float) -> str:
    """Seconds as the reason prints them."""
    if abs(s) >= 1.0:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if abs(s) >= 1e-7:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e9:.1f} ns"


def collectives(comms: list[tuple[str, int]]) -> str:
    """``comms`` in words: "2 all-reduces, 1 all-gather"."""
    counts: dict[str, int] = {}
    for k, _ in comms:
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{n} {k.replace('_', '-')}{'s' if n != 1 else ''}" for k, n in counts.items())


def reason(
    sharded: bool,
    saved_bytes: int,
    activation_bytes: int,
    comms: list[tuple[str, int]],
    saved_s: float,
    added_s: float,
    step_s: float,
    profile: DeviceProfile,
) -> str:
    """The reason a report line gives: what the split saves and adds per rank on ``profile``,
    and the rule's clause that decided it ("sharded: saves 1.20 ms of matmuls and 340.0 MiB of
    state and 12.0 MiB of activations per rank, adds 2 all-reduces (8.0 MiB) 0.30 ms on
    h100-80gb: saves 0.90 ms a step")."""
    from spmd.parallel.auto_tp import _size

    why = clause(sharded, added_s - saved_s, step_s, saved_bytes + activation_bytes > 0)
    adds = f"{collectives(comms)} ({_size(sum(b for _, b in comms))})" if comms else "no collective"
    return (
        f"saves {ms(saved_s)} of matmuls and {_size(saved_bytes)} of state and "
        f"{_size(activation_bytes)} of activations per rank, adds {adds} {ms(added_s)} on "
        f"{profile.name}: {why}"
    )


def clause(sharded: bool, net_s: float, step_s: float, saves_memory: bool) -> str:
    """Why the rule decided so, given the split's net time cost ``net_s`` (negative: it saves)."""
    if net_s <= 0:
        return f"saves {ms(-net_s)} a step"
    if sharded:
        return f"costs {ms(net_s)} a step, within {THRESHOLD:.0%} of the step's {ms(step_s)}, for the memory"
    if saves_memory:
        return f"costs {ms(net_s)} a step, more than {THRESHOLD:.0%} of the step's {ms(step_s)}"
    return f"costs {ms(net_s)} a step and saves no memory"
