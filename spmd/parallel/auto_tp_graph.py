"""The graph analysis behind :mod:`spmd.parallel.auto_tp`: parameter matmuls, the dataflow from
each one's output, and the candidate regions it forms (column -> row pairs, vocabulary-parallel
heads and embeddings). Reads the traced step's forward only; see auto_tp's module docstring for
what each candidate is and why it is recognised from the graph rather than from module names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from passes.meta import PHASE, ROLE, STATE_NAME, Phase, Role

aten = torch.ops.aten

# Ops a value passes through on its way from a matmul's weight placeholder to the matmul.
_WEIGHT_PATH = {
    aten.t.default: True,  # transposes
    aten.transpose.int: True,
    aten.permute.default: True,
    aten.view.default: False,
    aten._unsafe_view.default: False,
    aten.alias.default: False,
    aten.detach.default: False,
    aten._to_copy.default: False,  # mixed precision's compute cast
    aten.clone.default: False,
}
# Where a value leaves the region: the feature dimension a column split divides is mixed.
_STOPS = {
    aten.mean.dim,
    aten.mean.default,
    aten.sum.dim_IntList,
    aten.sum.default,
    aten.var.correction,
    aten.var_mean.correction,
    aten.amax.default,
    aten.native_layer_norm.default,
    aten.layer_norm.default,
    aten.linalg_vector_norm.default,
}
_LOSS = {aten._log_softmax.default, aten.log_softmax.int, aten.nll_loss_forward.default}


@dataclasses.dataclass(frozen=True)
class _Mat:
    """A parameter matmul: the node, its weight parameter and activation operand."""

    node: fx.Node
    param: str
    act: fx.Node
    col: int  # the parameter dimension of the matmul's output features (column split)
    row: int  # the dimension of its input features (row split)
    bias: str | None


@dataclasses.dataclass
class Region:
    """One candidate split: ``col`` parameters split on output features, ``row`` on input
    features (vocabulary for an embedding / head: dim 0)."""

    kind: str  # "pair", "head" or "embedding"
    col: dict[str, int]  # param fqn -> its split dimension
    row: dict[str, int]
    flow: set[fx.Node]  # forward nodes between the producers and the consumers
    producers: list[fx.Node]  # the column-split matmuls (or the embedding)
    consumers: list[fx.Node] = dataclasses.field(default_factory=list)  # the row-split matmuls
    bias: dict[str, int] = dataclasses.field(default_factory=dict)  # column biases: Shard(0)
    # Fused column parameters (and their biases) whose output is split into k equal parts (a fused
    # qkv, gate/up): fqn -> k; they split strided (each rank its share of every part).
    strided: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def statistics(self) -> list[fx.Node]:
        """The flow's statistics over all of a producer's features (:func:`whole_statistic`):
        each one all-reduced over tp in forward and in backward."""
        widths = {
            p.meta["val"].shape[-1] for p in self.producers if isinstance(p.meta.get("val"), torch.Tensor)
        }
        return [n for n in self.flow if any(whole_statistic(n, f) for f in widths)]

    @property
    def mats(self) -> list[fx.Node]:
        return [*self.producers, *self.consumers]

    def params(self) -> dict[str, int]:
        return {**self.col, **self.row, **self.bias}

    def signature(self, shape_of: Callable[[str], tuple[int, ...]]) -> tuple[Any, ...]:
        ps = sorted(
            (k, shape_of(p), d)
            for k, group in (("col", self.col), ("row", self.row), ("bias", self.bias))
            for p, d in group.items()
        )
        ops = sorted(str(n.target) for n in self.flow)
        return (self.kind, tuple(ps), tuple(ops), tuple(sorted(self.strided.values())))


def _placeholder_param(n: fx.Node) -> str | None:
    if n.op == "placeholder" and n.meta.get(ROLE) is Role.PARAM:
        return str(n.meta.get(STATE_NAME))
    return None


def _weight(n: Any) -> tuple[str, bool] | None:
    """(parameter fqn, whether it is used transposed) if ``n`` is a parameter seen through
    views, casts and transposes."""
    flips = False
    while isinstance(n, fx.Node):
        if (p := _placeholder_param(n)) is not None:
            return p, flips
        if n.op != "call_function" or n.target not in _WEIGHT_PATH:
            return None
        if _WEIGHT_PATH[n.target]:
            flips = not flips
        n = n.args[0]
    return None


def _param_matmuls(gm: fx.GraphModule, shapes: dict[str, tuple[int, ...]]) -> dict[fx.Node, _Mat]:
    out: dict[fx.Node, _Mat] = {}
    for n in gm.graph.nodes:
        if n.meta.get(PHASE) is not Phase.FORWARD or n.op != "call_function":
            continue
        if n.target is aten.mm.default:
            act, w, bias = n.args[0], n.args[1], None
        elif n.target is aten.addmm.default:
            act, w, bias = n.args[1], n.args[2], _weight(n.args[0])
        elif n.target is aten._grouped_mm.default:
            act, w, bias = n.args[0], n.args[1], None
        else:
            continue
        found = _weight(w)
        if found is None or _weight(act) is not None or len(shapes[found[0]]) != _weight_ndim(n):
            continue
        p, flipped = found
        # mm(x, W^T): W is (out, in), nn.Linear's layout; mm(x, W): (in, out), GPT-2's Conv1D.
        # Experts (grouped_mm) the same behind their expert dimension: (E, out, in) or (E, in, out).
        col, row = (0, 1) if flipped else (1, 0)
        if _weight_ndim(n) == 3:
            col, row = col + 1, row + 1
        b = bias[0] if bias is not None and not bias[1] and len(shapes[bias[0]]) == 1 else None
        out[n] = _Mat(n, p, act, col, row, b)
    return out


def _weight_ndim(mm: fx.Node) -> int:
    """The dimensions of a parameter matmul's weight: 3 for experts multiplied by
    ``aten._grouped_mm`` (tokens ``[S, K]`` by experts ``[E, K, N]``), else 2."""
    if mm.target is aten._grouped_mm.default:
        x = mm.args[0].meta.get("val") if isinstance(mm.args[0], fx.Node) else None
        return 3 if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    return 2


def _flow(
    mat: fx.Node, mats: dict[fx.Node, _Mat], statistics: bool = False
) -> tuple[set[fx.Node], set[fx.Node], bool, bool]:
    """(flow nodes, consumer matmuls, reaches the loss, stopped) from ``mat``'s output;
    ``statistics``: go on through statistics over all its features (:func:`whole_statistic`)."""
    flow: set[fx.Node] = set()
    consumers: set[fx.Node] = set()
    loss = stopped = False
    out = mat.meta.get("val")
    features = out.shape[-1] if isinstance(out, torch.Tensor) and out.dim() else 0
    todo = [mat]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                stopped = True
                continue
            if u.meta.get(PHASE) is not Phase.FORWARD:
                continue  # saved for backward
            if u in mats and mats[u].act is n:
                consumers.add(u)
            elif u in mats or (
                u.target in _STOPS
                and not _within_groups(u, features)
                and not (statistics and whole_statistic(u, features))
            ):
                stopped = True
            elif u.target in _LOSS:
                loss = True
            elif u not in flow:
                flow.add(u)
                todo.append(u)
    return flow, consumers, loss, stopped


def _within_groups(n: fx.Node, features: int) -> bool:
    """Whether reduction or norm ``n`` mixes only within groups of a matmul's ``features``: it
    reduces the last dimension alone, and that dimension is a proper divisor of ``features``
    (the output viewed as heads x head_dim, normalised per head: Qwen3's and Gemma 3's q/k
    norms). A column split into whole heads leaves each group on one rank; whether the split
    does is DTensor's to say (:mod:`spmd.parallel.auto_tp_check` runs the flow). A norm over
    all the features (OLMo 2's q/k norms) still stops the flow."""
    x = n.args[0] if n.args else None
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(xv, torch.Tensor) or xv.dim() == 0:
        return False
    last = xv.shape[-1]
    if n.target in (aten.native_layer_norm.default, aten.layer_norm.default):
        shape = n.args[1] if len(n.args) > 1 else None
        dims: Any = [-1] if isinstance(shape, (list, tuple)) and len(shape) == 1 else None
    else:
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if n.target is aten.linalg_vector_norm.default:
            dims = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or not isinstance(dims[0], int):
        return False
    return dims[0] % xv.dim() == xv.dim() - 1 and 1 < last < features and features % last == 0


# Views that keep a matmul output's last dimension on the way to its split into parts.
_KEEP_LAST = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
              aten.alias.default, aten.clone.default}  # fmt: skip


def fused_parts(mat: fx.Node) -> int:
    """Into how many equal parts the matmul's output is split on its features before anything
    else reads it (a fused qkv split into q, k and v; a fused gate/up chunked in two): the
    features over the greatest common divisor of the parts' boundaries; 1 if it is not split,
    or something else reads it whole."""
    out = mat.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return 1
    features = out.shape[-1]
    cuts: list[int] = []
    todo = [mat]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.meta.get(PHASE) is not Phase.FORWARD:
                continue
            uv = u.meta.get("val")
            if (
                u.target in _KEEP_LAST
                and isinstance(uv, torch.Tensor)
                and uv.dim()
                and uv.shape[-1] == features
            ):
                todo.append(u)
                continue
            got = _feature_cuts(u, n, features)
            if got is None:
                return 1
            cuts += got
    g = features
    for c in cuts:
        g = math.gcd(g, c)
    return features // g if cuts and 0 < g < features else 1


def _feature_cuts(u: fx.Node, x: fx.Node, features: int) -> list[int] | None:
    """The boundaries a split or slice of ``x`` on its last dimension cuts at; None for any other use."""
    xv = x.meta.get("val")
    if not isinstance(xv, torch.Tensor) or u.args[0] is not x:
        return None
    nd = xv.dim()
    args: list[Any] = list(u.args[1:5])
    if u.target in (aten.split.Tensor, aten.split_with_sizes.default):
        size, dim = args[0], (args[1] if len(args) > 1 else 0)
        if not isinstance(dim, int) or dim % nd != nd - 1:
            return None
        sizes = list(size) if isinstance(size, list | tuple) else [size] * -(-features // size)
        return [min(sum(sizes[: i + 1]), features) for i in range(len(sizes))]
    if u.target is aten.slice.Tensor:
        dim, start, end, step = args + [0, None, None, 1][len(args) :]
        if not isinstance(dim, int) or dim % nd != nd - 1 or step != 1:
            return None
        start = 0 if start is None else min(max(start + features if start < 0 else start, 0), features)
        end = features if end is None else min(max(end + features if end < 0 else end, 0), features)
        return [start, end]
    return None


# Reductions whose output, over a column split's features, is a sum of per-rank partial sums.
_STATISTICS = {aten.mean.dim, aten.sum.dim_IntList}


def whole_statistic(n: fx.Node, features: int) -> bool:
    """Whether ``n`` is a statistic over all of a matmul's ``features``: a mean or sum over the
    last dimension alone, keeping it (``[..., 1]``), of a value as wide as the features (OLMo 2's
    q/k RMSNorm over the whole projection, before the view into heads). Under a column split
    each rank sums its features and an all-reduce of the small ``[tokens, 1]`` result completes
    it: the flow goes on through it, and the DTensor check accepts that all-reduce
    (:mod:`spmd.parallel.auto_tp_check`), priced as two collectives (forward and backward)."""
    if n.target not in _STATISTICS or len(n.args) < 2:
        return False
    x, dims = n.args[0], n.args[1]
    xv, out = (x.meta.get("val") if isinstance(x, fx.Node) else None), n.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(out, torch.Tensor) or xv.dim() == 0:
        return False
    if not isinstance(dims, list | tuple) or len(dims) != 1 or not isinstance(dims[0], int):
        return False
    if dims[0] % xv.dim() != xv.dim() - 1:
        return False
    return xv.shape[-1] == features > 1 and out.dim() == xv.dim() and out.shape[-1] == 1


def _from_batch(ids: Any) -> bool:
    """Whether a lookup's indices come from the step's inputs (token ids), not from a range or a
    buffer (positions, token types: a table indexed by every rank alike gains nothing split)."""
    todo, seen = [ids], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.meta.get(ROLE) is Role.INPUT:
                return True
            continue
        todo += n.all_input_nodes
    return False


def find_regions(gm: fx.GraphModule, shapes: dict[str, tuple[int, ...]]) -> list[Region]:
    """The candidate regions of a traced step (see the module docstring), in graph order."""
    mats = _param_matmuls(gm, shapes)
    flows = {m: _flow(m, mats) for m in mats}
    # A matmul stopped by a norm over all its features (OLMo 2's q/k norms) is a column candidate
    # through it, unless it is a row candidate already (a row output's norm is the residual
    # stream's: its flow stops there, as before), or it would feed a column candidate (DeepSeek's
    # q_a_proj -> norm -> q_b_proj: a low-rank pair, not a Megatron one).
    cols = {m for m, (_, cons, loss, stop) in flows.items() if cons and not loss and not stop}
    rows = {c for m in cols for c in flows[m][1]}
    for m, (_, _, _, stop) in list(flows.items()):
        if stop and m not in rows:
            again = _flow(m, mats, statistics=True)
            if again[1] and not again[2] and not again[3] and not again[1] & cols:
                flows[m] = again
    # Union producers that reach a common consumer; a producer that is also a consumer of a
    # region (row and column at once) cannot be split both ways.
    parent: dict[fx.Node, fx.Node] = {}

    def find(x: fx.Node) -> fx.Node:
        while parent.setdefault(x, x) is not x:
            x = parent[x]
        return x

    pairs = [m for m, (_, cons, loss, stop) in flows.items() if cons and not loss and not stop]
    for m in pairs:
        for c in flows[m][1]:
            parent[find(c)] = find(m)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for m in pairs:
        groups.setdefault(find(m), []).append(m)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions: list[Region] = []
    for members in groups.values():
        consumers = set().union(*(flows[m][1] for m in members))
        if consumers & set(members):
            continue  # a chain (row into column): not one Megatron pair
        r = Region(
            "pair",
            {},
            {},
            set(),
            sorted(members, key=order.__getitem__),
            sorted(consumers, key=order.__getitem__),
        )
        for m in members:
            r.col[mats[m].param] = mats[m].col
            if (b := mats[m].bias) is not None:
                r.bias[b] = 0
            if (k := fused_parts(m)) > 1:
                r.strided[mats[m].param] = k
                if b is not None:
                    r.strided[b] = k
            r.flow |= flows[m][0]
        for c in consumers:
            r.row[mats[c].param] = mats[c].row
        regions.append(r)
    for m, (flow, cons, loss, stop) in flows.items():
        if loss and not cons and not stop:
            r = Region("head", {mats[m].param: mats[m].col}, {}, flow, [m])
            if (b := mats[m].bias) is not None:
                r.bias[b] = 0
            regions.append(r)
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and n.target is aten.embedding.default
            and n.meta.get(PHASE) is Phase.FORWARD
            and _from_batch(n.args[1])
        ):
            w = _weight(n.args[0])
            if w is not None and not w[1] and len(shapes[w[0]]) == 2:
                regions.append(Region("embedding", {}, {w[0]: 0}, set(), [n]))
    regions.sort(key=lambda r: order[r.mats[0]])
    return regions


def nbytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def act_of(n: fx.Node) -> Any:
    """A parameter matmul's activation operand (``mm``'s first, ``addmm``'s second argument; the
    tokens of an expert matmul)."""
    return n.args[0 if n.target is aten._grouped_mm.default else -2]


def mm_flops(n: fx.Node) -> int:
    """FLOPs of a parameter matmul (an expert matmul: of all its experts' token groups together)."""
    a, out = act_of(n), n.meta.get("val")
    av = a.meta.get("val") if isinstance(a, fx.Node) else None
    if not isinstance(av, torch.Tensor) or not isinstance(out, torch.Tensor) or av.dim() != 2:
        return 0
    return 2 * av.shape[0] * av.shape[1] * out.shape[-1]
