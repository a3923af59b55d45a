"""The call costs :mod:`spmd.calibrate` measures beside the curves: each view op's call, the fused
optimizer's curve, the fixed, per-tensor and padded-path costs of the ops that loop over their
tensors (the fully_shard copy-in/out and aligned optimizer, fused optimizers, foreach ops, cat,
split), and how much dearer a call is among other ops than repeated alone (the mixed-call factor).
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch

from passes import torch_compat
from spmd.calibrate.timing import _NUMELS, _best, _curve, _graph_of, _in_graph


def _view_cases() -> dict[str, tuple[Any, tuple[Any, ...]]]:
    aten = torch.ops.aten
    x = torch.randn(64, 256)
    return {
        "aten.t": (aten.t.default, (x,)),
        "aten.view": (aten.view.default, (x, [-1])),
        "aten._unsafe_view": (aten._unsafe_view.default, (x, [256, 64])),
        "aten.reshape": (aten.reshape.default, (x, [16, 1024])),
        "aten.detach": (aten.detach.default, (x,)),
        "aten.alias": (aten.alias.default, (x,)),
        "aten.as_strided": (aten.as_strided.default, (x, [32, 256], [256, 1], 0)),
        "aten.expand": (aten.expand.default, (x, [2, 64, 256])),
        "aten.slice": (aten.slice.Tensor, (x, 0, 0, 32)),
        "aten.select": (aten.select.int, (x, 0, 1)),
        "aten.permute": (aten.permute.default, (x, [1, 0])),
        "aten.transpose": (aten.transpose.int, (x, 0, 1)),
        "aten.unsqueeze": (aten.unsqueeze.default, (x, 0)),
        "aten.squeeze": (aten.squeeze.dim, (x.view(1, 64, 256), 0)),
        "aten.split_with_sizes": (aten.split_with_sizes.default, (x, [32, 32])),
        "aten.split": (aten.split.Tensor, (x, 32)),
    }


def measure_view_costs(repeats: int = 5) -> dict[str, list[list[float]]]:
    """Per view op: ``[[0, seconds]]`` (one point: a view moves no bytes), each call timed in a
    graph (:func:`_in_graph`). The cost model prices a view by its own point where measured
    (``passes.cost_model.free_time``), else by ``view_overhead_s`` (``aten.t`` chained)."""
    return {key: [[0.0, _in_graph(op, args, repeats)]] for key, (op, args) in _view_cases().items()}


def measure_optimizer_curve(repeats: int = 5) -> dict[str, list[list[float]]]:
    """``"optimizer"``: [[bytes, seconds], ...] of a fused AdamW step on one tensor of each of
    ``_NUMELS`` elements (its bandwidth: the per-tensor part is ``call_costs``). Bytes as the
    cost model counts them: the tensors read (parameter, gradient, both moments, step, lr) and
    the four lists written in place (``passes.cost_model.node_bytes``)."""
    pts = []
    lr = torch.tensor(1e-3)
    for numel in _NUMELS:
        p, g, m, v = (torch.randn(numel) for _ in range(4))
        m.zero_()
        v.zero_()
        step = [torch.zeros(())]

        def call(p=p, g=g, m=m, v=v, step=step) -> None:  # noqa: ANN001 - bound per size
            torch_compat.fused_adamw_(
                [p], [g], [m], [v], [], step, lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8,
                amsgrad=False, maximize=False,
            )  # fmt: skip

        pts.append(((8 * numel + 2) * 4, _best(call, repeats)))
    return {"optimizer": _curve(pts)}


_CALL_N = 32  # tensors per list in the many-tensor measurement of a call cost


def _list_op_cases(n: int, ragged: bool) -> dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """One call of each op whose cost is a loop over its tensors, with ``n`` tensors per list of
    a few elements (their bytes negligible), padded (``ragged``) or not: key -> (op, args, kwargs).
    Shapes as a fully_shard step has them: shards of a few dozen elements, 2 ranks."""
    from passes import flat_ops, fused_align

    numel = 33 if ragged else 32  # a shard; the aligned optimizer pads it to 48 (pre 3, post 12)
    lr = torch.tensor(1e-3)
    p, g, m, v = ([torch.randn(numel) for _ in range(n)] for _ in range(4))
    for t in m + v:
        t.zero_()
    steps = [torch.zeros(()) for _ in range(n)]
    adamw = dict(lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    kernel = torch.ops.aten._fused_adamw_.tensor_lr
    values = dict(self=p, grads=g, exp_avgs=m, exp_avg_sqs=v, max_exp_avg_sqs=[], state_steps=steps, **adamw)
    pad = (3, 12) if ragged else (0, 0)
    aligned_args, aligned_kw = fused_align.wrap_args(kernel, values, [pad[0]] * n, [pad[1]] * n, [0] * n)
    chunk = 40 if ragged else 32  # copy-in: a shard shorter than its chunk is padded
    full = 2 * chunk - (7 if ragged else 0)  # copy-out: a parameter not filling its 2 chunks
    cases: dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]] = {
        "spmd.aligned_fused_optimizer_": (fused_align.ALIGNED_FUSED, aligned_args, aligned_kw),
        "spmd.all_gather_copy_in": (flat_ops.COPY_IN, ([t[:32] for t in p], [chunk] * n, torch.float32), {}),
        "spmd.all_gather_copy_out": (
            flat_ops.COPY_OUT,
            (torch.randn(2 * chunk * n), 2, [chunk] * n, [full] * n, [1] * n),
            {},
        ),
    }
    if not ragged:
        cases["aten._fused_adamw_"] = (kernel, (p, g, m, v, [], steps), adamw)
        cases["aten._foreach_add_"] = (torch.ops.aten._foreach_add_.Scalar, (steps, 1), {})
        # Views, one per output: a flat gradient buffer split back into its parameters, q/k/v.
        rows = torch.randn(n, 8)
        cases["aten.split_with_sizes"] = (torch.ops.aten.split_with_sizes.default, (rows, [1] * n), {})
        cases["aten.unbind"] = (torch.ops.aten.unbind.int, (rows,), {})
        # Copies of a list into one buffer: a bucket's flat gradients, a unit's reduce-scatter input.
        cases["aten.cat"] = (torch.ops.aten.cat.default, (g,), {})
        cases["aten._chunk_cat"] = (torch.ops.aten._chunk_cat.default, (g, 0, 2), {})
        cases["aten.stack"] = (torch.ops.aten.stack.default, (g,), {})
    return cases


def measure_call_costs(repeats: int = 5) -> dict[str, dict[str, float]]:
    """``call_costs`` of the profile: per op whose time is a Python or dispatch loop over its
    tensors (the flat-buffer ops and the aligned fused optimizer of a fully_shard step, a fused
    optimizer, a foreach op, which on CPU dispatches once per tensor), its fixed ``call`` and
    ``per_tensor`` seconds (by ``passes.cost_model.call_tensors``), from calls on 1 and
    ``_CALL_N`` tensors per list; for the ops with a padded path, the ``ragged_call`` and
    ``per_ragged`` extra of all pieces padded (``passes.cost_model.ragged_pieces``)."""
    from passes.cost_model import call_tensors, ragged_pieces

    def timed(n: int, ragged: bool) -> dict[str, tuple[float, int, int]]:
        out = {}
        for key, (op, args, kw) in _list_op_cases(n, ragged).items():
            res = op(*args, **kw)
            t = _best(functools.partial(op, *args, **kw), repeats)
            out[key] = (t, call_tensors((args, kw), res), ragged_pieces(op, args))
        return out

    one, many = timed(1, False), timed(_CALL_N, False)
    one_r, many_r = timed(1, True), timed(_CALL_N, True)
    costs: dict[str, dict[str, float]] = {}
    for key, (t1, n1, _) in one.items():
        tn, nn, _ = many[key]
        per = max((tn - t1) / max(nn - n1, 1), 0.0)
        c = {"call": max(t1 - per * n1, 0.0), "per_tensor": per}
        if key in one_r:
            (r1, m1, g1), (rn, mn, gn) = one_r[key], many_r[key]
            # What the padded pieces add beyond the same calls unpadded (the tensor counts can
            # differ: a padded copy-out is still one output per parameter).
            per_r = max(((rn - per * mn) - (r1 - per * m1)) / max(gn - g1, 1), 0.0)
            c["per_ragged"] = per_r
            c["ragged_call"] = max(r1 - per * m1 - per_r * g1 - c["call"], 0.0)
        costs[key] = c
    return costs


def _mixed_calls(rows: int, cols: int) -> list[tuple[Any, tuple[Any, ...]]]:
    """Nine ops of different kinds (a step's mix: views, a copy, a reduction, elementwise, a norm,
    an activation, a matmul) on ``rows x cols`` operands."""
    aten = torch.ops.aten
    x, w, b = torch.randn(rows, cols), torch.randn(cols), torch.randn(cols)
    return [
        (aten.t.default, (x,)),
        (aten.clone.default, (x,)),
        (aten.sum.dim_IntList, (x, [0], True)),
        (aten.add.Tensor, (x, x)),
        (aten.native_layer_norm.default, (x, [cols], w, b, 1e-5)),
        (aten.gelu.default, (x,)),
        (aten.mm.default, (x, x.t())),
        (aten.detach.default, (x,)),
        (aten.view.default, (x, [-1])),
    ]


def _mixed_and_alone(
    calls: list[tuple[Any, tuple[Any, ...]]], k: int, repeats: int, rounds: int
) -> tuple[float, float, float]:
    """(median ratio, mixed seconds, alone seconds) per round of ``calls``: a graph of ``k`` rounds
    of the calls in turn (each call on its own inputs) against the sum of each call in a graph of
    ``k`` of its own kind; alternated, medians over ``rounds`` (each pair sees the same share of a
    busy machine)."""
    singles = [functools.partial(run, *flat) for run, flat in (_graph_of([c], k) for c in calls)]
    run, flat = _graph_of(calls, k)
    mixed = functools.partial(run, *flat)
    ratios, mixes, alones = [], [], []
    for _ in range(rounds):
        alone = sum(_best(f, repeats) for f in singles) / k
        m = _best(mixed, repeats) / k
        ratios.append(m / alone)
        mixes.append(m)
        alones.append(alone)
    return statistics.median(ratios), statistics.median(mixes), statistics.median(alones)


def measure_mixed_call_factor(repeats: int = 3, k: int = 40, rounds: int = 5) -> float:
    """``mixed_call_factor``: a graph of ``k`` rounds of nine tiny ops of different kinds
    (:func:`_mixed_calls` on 4 x 8 operands), each call on its own inputs, against the sum of the
    same ops each in a graph of ``k`` of its own kind. The ops are tiny, so their time is their
    fixed (per-call) part; measured here 1.7x (2026-11-25)."""
    ratio, _, _ = _mixed_and_alone(_mixed_calls(4, 8), k, repeats, rounds)
    return max(ratio, 1.0)


# Operand shapes of the mixed-call curve: calls of a few microseconds (their fixed part) to about
# half a millisecond on average (a 512^3 matmul among the nine).
_MIXED_SHAPES = ((4, 8), (32, 64), (64, 256), (256, 256), (512, 512))


def measure_mixed_call_curve(repeats: int = 3, rounds: int = 3) -> list[list[float]]:
    """``mixed_call_curve``: [[seconds a call takes alone, seconds more it takes in a mix], ...],
    from the nine ops of :func:`_mixed_calls` at each of ``_MIXED_SHAPES`` (the mean call of the
    nine): what a whole call pays for running after ops of other kinds, as a step runs it (its
    code and the host's predictors cold for it), where ``mixed_call_factor`` scales only a
    call's fixed part. Measured here (2026-11-25, one core, the other busy): 4-5 us more for calls
    of 5 us, 9 us for 17 us, 13 us for 90 us, about 50 us for 0.5 ms. Made non-decreasing (a
    longer call does not refill less); the model holds the last point's extra above it."""
    pts = []
    for rows, cols in _MIXED_SHAPES:
        calls = _mixed_calls(rows, cols)
        k = 40 if rows * cols <= 2**14 else 8
        _, mixed, alone = _mixed_and_alone(calls, k, repeats, rounds)
        pts.append([alone / len(calls), max(mixed - alone, 0.0) / len(calls)])
    pts.sort()
    for i in range(1, len(pts)):
        pts[i][1] = max(pts[i][1], pts[i - 1][1])
    return pts
