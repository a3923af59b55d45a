"""The graph expansion behind :class:`spmd.parallel.expand.DTensorExpandMode`: run the
traced step once more under ``make_fx`` on DTensors that carry the declared placements,
so DTensor's own dispatcher records the local ops and the redistributions (functional
collectives) one rank runs; then finish the node metadata (roles, phases, modules,
placements) and let the gradients' collectives stand for their tags. The mode's module
docstring describes what the expansion decides itself, rather than DTensor.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx.experimental.proxy_tensor import make_fx

from passes import collectives as C
from passes import torch_compat
from passes.linear_cross_entropy import LINEAR_CROSS_ENTROPY
from passes.meta import (
    MODULE,
    PHASE,
    ROLE,
    Phase,
    Role,
)
from passes.ops import TAG_GRAD
from passes.remat import REMAT
from passes.torch_compat import pytree
from spmd.errors import ShardingPropagationError
from spmd.frontend.kernel_layouts import KernelLayoutFakeMode
from spmd.parallel import expand_rules, tp_loss
from spmd.parallel.expand_finish import (
    _CUSTOM,
    _SRC,
    EXPAND_PLACEMENTS,
    describe_placements,
    drop_dead_compute,
    finish,
)

__all__ = ["EXPAND_PLACEMENTS", "describe_placements", "expand_graph"]

if TYPE_CHECKING:
    pass

log = logging.getLogger("spmd")


class _Expander(fx.Interpreter):
    """Runs the traced graph on DTensors; records each node's output placements.

    Nodes of an Override stand-in that declared placements (``regions``: module fqn ->
    (input placements, output placements)) run on local tensors instead (``local_map``
    semantics): a DTensor flowing in is redistributed to the declared placements and
    unwrapped, a local tensor flowing out is wrapped with them.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        mesh: DeviceMesh,
        param_pl: dict[str, Any],
        regions: dict[str, Any],
        view: _LocalView,
        reduce_local: bool = True,
        boundaries: dict[str, Any] | None = None,
        replicate_unknown: bool = False,
        vocab_parallel_loss: bool = False,
    ):
        super().__init__(gm)
        self.vocab_parallel_loss = vocab_parallel_loss
        # Ops without a sharding strategy run replicated (tensor parallelism), instead of failing.
        self.replicate_unknown = replicate_unknown
        self._unknown: set[Any] = set()
        self.mesh = mesh
        self.view = view
        self.reduce_local = reduce_local
        # module fqn -> (placements its forward inputs take, placements its outputs take; None: any)
        self.boundaries = boundaries or {}
        self._bounded: dict[tuple[Any, ...], Any] = {}
        self.param_pl = param_pl
        # A parameter split strided (a fused projection): splits, slices and cats of such splits
        # are computed locally (expand_rules.strided_call); without one, DTensor runs them as ever.
        self.strided = any(expand_rules.splits_strided(pl) for pl in param_pl.values() if pl)
        self.regions = regions
        self.placements: dict[str, Any] = {}
        self.region_of: dict[fx.Node, str] = {}
        self._into: dict[tuple[fx.Node, Any], Any] = {}

    def _region(self, n: fx.Node) -> str | None:
        if not self.regions or n.op != "call_function" or n.target is TAG_GRAD:
            return None
        if n.meta.get(PHASE) is Phase.OPTIMIZER:
            return None
        mod = n.meta.get(MODULE, "")
        return next((f for f in self.regions if mod == f or mod.startswith(f + ".")), None)

    def run_node(self, n: fx.Node) -> Any:
        region = self._region(n)
        try:
            with torch_compat.interpreter_current_node(self, n):
                args = fx.node.map_arg(n.args, lambda a: self._fetch(a, n, region))
                kwargs = fx.node.map_arg(n.kwargs, lambda a: self._fetch(a, n, region))
                out = getattr(self, n.op)(n.target, args, kwargs)
        except ShardingPropagationError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure here is a propagation failure at n
            raise ShardingPropagationError(_explain(n, self.env, exc)) from exc
        if region is not None:
            self.region_of[n] = region
            self.placements[n.name] = f"local ({region})"
        else:
            self.placements[n.name] = self.view.outer(_placement_tree(out))
        return out

    def _fetch(self, a: fx.Node, consumer: fx.Node, region: str | None) -> Any:
        v = self.env[a]
        src_region = self.region_of.get(a)
        if region is not None and src_region is None:
            return self._into_region(a, v, region)
        if region is None and src_region is not None:
            return self._out_of_region(a, v, consumer, src_region)
        if self.boundaries and isinstance(v, DTensor):
            # Leaving a planned module, then entering another: each layout in turn, as eager
            # parallelize_module redistributes at the output of one module and the input of the next.
            for want in self._boundary_layouts(a, consumer):
                want = tuple(Shard(p.dim % v.ndim) if isinstance(p, Shard) else p for p in want)
                if tuple(v.placements) != want:
                    key = (a, tuple(v.placements), want)
                    if key not in self._bounded:
                        self._bounded[key] = v.redistribute(self.mesh, want)
                    v = self._bounded[key]
        return v

    def _boundary_layouts(self, a: fx.Node, consumer: fx.Node) -> list[tuple[Placement, ...]]:
        """The placements a value takes, in turn, where it crosses planned modules' boundaries.

        A forward value: leaving the innermost planned module that computes it (its output
        layout), then entering the innermost planned module that reads it (its input layout). A
        backward node reading a forward value reads what its forward module read (the value saved
        for backward is the redistributed one). A gradient entering a planned module's backward:
        its output-gradient layout. Parameters and state never cross: the plan places them."""
        src, dst = a.meta.get(MODULE, ""), consumer.meta.get(MODULE, "")

        def inside(mod: str, b: str) -> bool:
            return mod == b or mod.startswith(b + ".")

        def around(mod: str) -> list[str]:
            # the planned modules holding ``mod``, innermost first (its dotted prefixes that
            # are planned: a lookup per prefix, not a scan of every planned module)
            return [b for b in _prefixes(mod) if b in self.boundaries]

        out: list[tuple[Placement, ...]] = []
        if _phase(a) is Phase.BACKWARD and _phase(consumer) is Phase.BACKWARD:
            # A gradient entering a planned module's backward (the gradient of its output) takes
            # the layout eager's autograd gives it: the gradient of the output before the output
            # was redistributed (row-parallel: of a partial sum, so replicated).
            # Not where autograd sums the gradients of one input read by several modules: that
            # sum, tagged with one reader's module, reads that module's own input gradient too
            # (q_proj's input gradient plus k_proj's and v_proj's is no output gradient of q_proj).
            for b in around(dst):
                grad_pl = self.boundaries[b][2] if len(self.boundaries[b]) > 2 else None
                if grad_pl is not None and not inside(src, b):
                    return [] if _sums_own_gradient(consumer, b) else [grad_pl]
            return []
        if _phase(a) is not Phase.FORWARD or consumer.meta.get(PHASE) is Phase.OPTIMIZER:
            return []
        if a.op == "placeholder" and a.meta.get(ROLE) is not Role.INPUT:
            return []
        for b in around(src):
            out_pl = self.boundaries[b][1]
            if out_pl is not None and a.op != "placeholder" and not inside(dst, b):
                out.append(out_pl)
                break
        for b in around(dst):
            in_pl = self.boundaries[b][0]
            if in_pl is not None and (a.op == "placeholder" or not inside(src, b)):
                out.append(in_pl)
                break
        return out

    def _into_region(self, a: fx.Node, v: Any, region: str) -> Any:
        in_pl, out_pl = self.regions[region]
        # Forward values (the stand-in's inputs, saved for backward too) take the input
        # placements; backward values flowing in are gradients of its outputs.
        want = out_pl if _phase(a) is Phase.BACKWARD else in_pl
        own = a.op == "placeholder" and a.meta.get(ROLE) in (Role.PARAM, Role.BUFFER)
        key = (a, None if own else want)
        if key not in self._into:

            def conv(x: Any) -> Any:
                if not isinstance(x, DTensor):
                    return x
                if not own and tuple(x.placements) != tuple(want):
                    x = x.redistribute(self.mesh, want)
                return torch_compat.local_tensor(x)

            self._into[key] = pytree.tree_map(conv, v)
        return self._into[key]

    def _out_of_region(self, a: fx.Node, v: Any, consumer: fx.Node, region: str) -> Any:
        in_pl, out_pl = self.regions[region]
        if consumer.target is TAG_GRAD:
            # A parameter's gradient, computed on this rank's piece of the input: partial sums
            # over the mesh dimensions the input is sharded on and the parameter is not.
            own = self.param_pl.get(str(consumer.args[1])) or (Replicate(),) * self.mesh.ndim
            want = tuple(
                Partial() if isinstance(p, Replicate) and isinstance(i, Shard) else p
                for p, i in zip(own, in_pl)
            )
        else:
            want = in_pl if _phase(a) is Phase.BACKWARD else out_pl
        vals: Any = a.meta.get("val")

        def wrap(x: Any, like: Any) -> Any:
            return _wrap(x, self.mesh, want, like) if isinstance(x, torch.Tensor) else x

        if isinstance(v, list | tuple):
            return type(v)(wrap(x, like) for x, like in zip(v, vals))
        return wrap(v, vals)

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if target is TAG_GRAD:
            g, name = args
            want = self.param_pl.get(name)
            average = self._average_local_dims if self.reduce_local else (lambda x: x)
            if isinstance(g, DTensor):
                if want is not None and tuple(g.placements) != tuple(want):
                    g = g.redistribute(self.mesh, want)
                local = average(torch_compat.local_tensor(g))
                return _wrap(TAG_GRAD(local, name), self.mesh, g.placements, g)
            return TAG_GRAD(average(g), name)
        q_at = expand_rules.ATTENTION_Q.get(target)
        if q_at is not None and kwargs.get("attn_mask") is not None:
            kwargs = {**kwargs, "attn_mask": self._place_mask(args[q_at], kwargs["attn_mask"])}
        if self.vocab_parallel_loss and target is LINEAR_CROSS_ENTROPY and tp_loss.applies(self.mesh, args):
            return tp_loss.vocab_parallel_head(
                self.mesh, args, lambda t, pl, like: _wrap(t, self.mesh, pl, like)
            )
        if self.vocab_parallel_loss and target in _LOSS_OPS and _class_split(args):
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                return super().call_function(target, args, kwargs)
        if self.strided and target in expand_rules.STRIDED_OPS:
            out = expand_rules.strided_call(target, args, kwargs, _wrap_meta)
            if out is not None:
                return out
        if target in expand_rules.STRIDED_AS_SHARD:
            run = super().call_function
            out = None
            if self.strided:
                out = expand_rules.strided_as_shard(args, kwargs, _wrap_meta, lambda a, k: run(target, a, k))
            # Experts' matmuls have no module style to end their region: the row-parallel one's
            # partial output is all-reduced here (Megatron's all-reduce, as the region is priced),
            # not left to whatever layout DTensor's later strategies pick for it.
            return expand_rules.summed(run(target, args, kwargs) if out is None else out)
        if self.replicate_unknown and target in self._unknown:
            return self._replicated_call(target, args, kwargs)
        try:
            return super().call_function(target, args, kwargs)
        except NotImplementedError as exc:
            if not (self.replicate_unknown and "sharding strategy" in str(exc)):
                raise
            self._unknown.add(target)
            log.info("spmd: %s has no sharding strategy: computed on replicated inputs", target)
            return self._replicated_call(target, args, kwargs)

    def _replicated_call(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``target`` on replicated local tensors, its outputs replicated: correct for any op
        (each rank computes the whole value), at the price of gathering its sharded inputs."""
        rep = (Replicate(),) * self.mesh.ndim

        def to_local(x: Any) -> Any:
            if not isinstance(x, DTensor):
                return x
            if tuple(x.placements) != rep:
                x = x.redistribute(self.mesh, rep)
            return torch_compat.local_tensor(x)

        largs, lkwargs = pytree.tree_map(to_local, (args, kwargs))
        out = target(*largs, **lkwargs)
        return pytree.tree_map(
            lambda t: _wrap(t, self.mesh, rep, t) if isinstance(t, torch.Tensor) else t, out
        )

    def _average_local_dims(self, g: torch.Tensor) -> torch.Tensor:
        """Average a gradient over the mesh dimensions of local batch semantics, as DDP does.

        On those dimensions each rank computed the step on its own batch (DTensor saw the
        value as replicated); DDP's reducer multiplies the accumulated gradient by
        ``1 / world`` (a wrapped double scalar) and all-reduces the products (sum). The
        same order here keeps the result bit for bit DDP's for any degree, not only for
        powers of two (where dividing before or after the sum is the same).
        """
        for group in self.view.groups:
            size = group.size()
            if size == 1:
                continue
            g = torch.ops.aten.mul.Tensor(g, 1.0 / size)
            g = C._c10d.all_reduce.default(g, "sum", group.group_name)
            g = C.WAIT(g)
        return g

    def _place_mask(self, q: Any, mask: torch.Tensor) -> torch.Tensor:
        """An attention mask redistributed to follow q (DTensor never redistributes a keyword
        argument); a plain mask (built from factory ops) is replicated."""
        if not isinstance(q, DTensor):
            return mask
        if not isinstance(mask, DTensor):
            mask = _wrap(mask, self.mesh, (Replicate(),) * self.mesh.ndim, mask)
        want = expand_rules.attn_mask_placements(q.placements, q.shape, mask.shape)
        if tuple(mask.placements) != want:
            mask = mask.redistribute(self.mesh, want)
        return mask


class _LocalView:
    """The mesh DTensor expands on, given the mesh dimensions of local batch semantics.

    On a local dimension each rank's value is its own (its batch, as DDP), not a copy of the
    others': DTensor must never communicate over it. Were it told ``Replicate()`` there, it
    could pick a strategy that chunks the "replicated" value for free and all-gathers it later
    (a reduce-scatter over "tp" next to a chunk over "dp"), mixing ranks' batches. So where
    other dimensions remain, DTensor expands on the sub-mesh of those alone and the local
    dimensions are dropped from every placement (parameters and state are ``Replicate()``
    there by definition). Where every dimension is local (pure data parallelism) the full mesh
    stays, with ``Replicate()`` on it: every value is replicated, so no strategy redistributes.
    Recorded placements are given back on the full mesh, with ``Replicate()`` on local dimensions.
    """

    def __init__(self, mesh: DeviceMesh, local_dims: Sequence[int]):
        self.ndim = mesh.ndim
        self.local = tuple(sorted(local_dims))
        self.groups = [mesh.get_group(k) for k in self.local]
        self.keep = tuple(k for k in range(mesh.ndim) if k not in self.local)
        self.sub = bool(self.local) and bool(self.keep)
        self.mesh = _sub_mesh(mesh, self.local, self.keep) if self.sub else mesh

    def inner(self, pl: tuple[Placement, ...] | None) -> tuple[Placement, ...] | None:
        """Placements on the full mesh -> placements for the expansion."""
        if pl is None or not self.local:
            return pl
        if self.sub:
            return tuple(pl[k] for k in self.keep)
        return tuple(Replicate() if k in self.local else p for k, p in enumerate(pl))

    def outer(self, pl: Any) -> Any:
        """Placements recorded by the expansion -> placements on the full mesh."""
        if not self.sub or pl is None or isinstance(pl, str):
            return pl
        if isinstance(pl, list):
            return [self.outer(p) for p in pl]
        it = iter(pl)
        return tuple(Replicate() if k in self.local else next(it) for k in range(self.ndim))


@functools.lru_cache(maxsize=4096)
def _prefixes(mod: str) -> tuple[str, ...]:
    """``mod`` and its dotted prefixes, longest first: ``a.b.c`` -> (``a.b.c``, ``a.b``, ``a``)."""
    out = [mod]
    while "." in mod:
        mod = mod.rsplit(".", 1)[0]
        out.append(mod)
    return tuple(out)


def _phase(n: fx.Node) -> Any:
    """The phase whose layouts ``n`` takes at planned modules' boundaries: a forward node's copy
    that remat recomputes in backward (``REMAT``) is forward there, as the node it copies."""
    return Phase.FORWARD if REMAT in n.meta else n.meta.get(PHASE)


def _sums_own_gradient(consumer: fx.Node, module: str) -> bool:
    """Whether ``consumer`` (a backward node of ``module``) also reads a gradient ``module``'s
    own backward computed: then it accumulates gradients, it does not start the backward."""
    for i in consumer.all_input_nodes:
        mod = i.meta.get(MODULE, "")
        if _phase(i) is Phase.BACKWARD and (mod == module or mod.startswith(module + ".")):
            return True
    return False


def _sub_mesh(mesh: DeviceMesh, local: Sequence[int], keep: Sequence[int]) -> DeviceMesh:
    """The mesh of this rank's ``keep`` dimensions (its coordinate fixed on ``local``)."""
    names = mesh.mesh_dim_names
    if names is not None:
        return mesh[tuple(names[k] for k in keep)] if len(keep) > 1 else mesh[names[keep[0]]]
    coord = mesh.get_coordinate()
    assert coord is not None
    ranks = mesh.mesh[tuple(coord[k] if k in local else slice(None) for k in range(mesh.ndim))]
    groups = [mesh.get_group(k) for k in keep]
    # Named, so that it never equals (DeviceMesh compares ranks and names, not groups) another
    # unnamed mesh over the same ranks whose cached DTensor decisions would then be reused.
    names = tuple(f"spmd_expand_dim{k}" for k in keep)
    return DeviceMesh.from_group(
        groups if len(groups) > 1 else groups[0], mesh.device_type, ranks, mesh_dim_names=names
    )


def _wrap(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], like: torch.Tensor
) -> DTensor:
    """A DTensor over ``local`` with the global shape of ``like``; records no op (``from_local``
    would record a view)."""
    from passes.torch_compat import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(like.shape, like.stride(), like.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def _wrap_meta(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
) -> DTensor:
    """:func:`_wrap` given the global shape, stride and dtype instead of a tensor of them."""
    from passes.torch_compat import DTensorSpec, TensorMeta

    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), tuple(stride), dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def _placement_tree(x: Any) -> Any:
    if isinstance(x, DTensor):
        return tuple(x.placements)
    if isinstance(x, list | tuple):
        return [_placement_tree(y) for y in x]
    return None


def _explain(n: fx.Node, env: dict[fx.Node, Any], exc: BaseException) -> str:
    ins = []
    for a in n.all_input_nodes:
        v = env.get(a)
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        pl = describe_placements(_placement_tree(v)) if isinstance(v, DTensor) else "plain tensor"
        ins.append(f"{a.name}{list(shape) if shape is not None else ''} {pl}")
    module = n.meta.get(MODULE) or "<root>"
    line = _user_line(n.meta.get("stack_trace") or "")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "unevenly sharded" in str(exc):
        first += (
            " (a dimension split over the tensor-parallel ranks is not a multiple of their number, e.g. "
            "fewer key/value heads than tp ranks: use a tp size that divides it, or leave that "
            "projection out of the plan so it replicates)"
        )
    return (
        f"spmd.DTensorExpandMode: DTensor cannot propagate the declared placements through op {n.target} "
        f"(node {n.name}) in module {module!r}{line}; its inputs are {'; '.join(ins) or 'none'}. "
        f"DTensor said: {first}. Declare placements this op accepts (param_placements / "
        "input_placements: e.g. Replicate() for the parameters this op reads, or shard a dimension the "
        "op keeps), or register a strategy for the op (torch.distributed.tensor.experimental."
        "register_sharding)."
    )


def _user_line(stack: str) -> str:
    """`` at file:line (code)`` of the innermost user frame of an fx stack trace."""
    lines = [ln.strip() for ln in stack.strip().splitlines()]
    best = ""
    for i, ln in enumerate(lines):
        if ln.startswith('File "') and "/torch/" not in ln and "/spmd/" not in ln:
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File") else ""
            best = f" at {ln.removeprefix('File ')}" + (f" ({code})" if code else "")
    return best


def expand_graph(
    gm: fx.GraphModule,
    mesh: DeviceMesh,
    reals: list[torch.Tensor],
    in_specs: list[tuple[Placement, ...] | None],
    param_pl: dict[str, Any],
    regions: dict[str, Any] | None = None,
    local_dims: Sequence[int] = (),
    *,
    reduce_local: bool = True,
    boundaries: dict[str, Any] | None = None,
    replicate_unknown: bool = False,
    vocab_parallel_loss: bool = False,
) -> fx.GraphModule:
    """The graph one rank runs: ``gm`` (global semantics) expanded on ``mesh``.

    ``reals`` are the local tensors fed to the placeholders (their shapes and dtypes are
    used, not their values); ``in_specs`` their placements (None: a plain, replicated tensor).
    ``regions``: Override stand-ins that run on local tensors (see :class:`_Expander`).
    ``local_dims``: mesh dimensions of local batch semantics (DDP's): each rank's input there
    is its own batch, DTensor never communicates over them (see :class:`_LocalView`), and
    every gradient is averaged over them at its tag, unless ``reduce_local`` is False: then
    every gradient keeps its tag, unreduced over the local dimensions, for a data-parallel
    partitioner to reduce (FSDP x TP, :mod:`spmd.parallel.tensor_parallel`). ``boundaries``:
    module fqn -> (input placements, output placements, output-gradient placements): a forward
    value is redistributed to the first where it enters that module, to the second where it
    leaves it, and a gradient entering the module's backward to the third (a tensor-parallel
    plan's layouts; None: as DTensor propagates), given on the mesh DTensor
    expands on (the sub-mesh without local dimensions). ``replicate_unknown``: an op DTensor
    has no sharding strategy for runs on replicated inputs (gathered first) instead of failing.
    ``vocab_parallel_loss``: a log-softmax and cross-entropy over 2-D logits split on their class
    dimension run split (torch's ``loss_parallel``), instead of gathering the logits first.
    ``in_specs``, ``param_pl`` and
    ``regions`` are given on the full mesh.
    """
    expand_rules.register()
    old_nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(reals) == len(in_specs)
    saved_custom = {}
    for n in gm.graph.nodes:
        saved_custom[n] = n.meta.get(_CUSTOM)
        n.meta[_CUSTOM] = {**(n.meta.get(_CUSTOM) or {}), _SRC: n.name}
    view = _LocalView(mesh, local_dims)
    _check_replicated_on_local(view, param_pl)
    inner_specs = [view.inner(pl) for pl in in_specs]
    inner_regions = {fqn: tuple(view.inner(x) for x in pls) for fqn, pls in (regions or {}).items()}
    inner_params = {name: view.inner(pl) for name, pl in param_pl.items()}
    expander = _Expander(
        gm,
        view.mesh,
        inner_params,
        inner_regions,
        view,
        reduce_local,
        boundaries,
        replicate_unknown,
        vocab_parallel_loss,
    )

    def run(*locals_: torch.Tensor) -> list[Any]:
        ins: list[Any] = []
        for t, pl, ph in zip(locals_, inner_specs, placeholders):
            if pl is None:
                ins.append(t)
                continue
            ins.append(_wrap(t, view.mesh, pl, ph.meta["val"]))
        with implicit_replication():
            outs = expander.run(*ins)
        return [
            torch_compat.local_tensor(o) if isinstance(o, DTensor) else o for o in pytree.tree_leaves(outs)
        ]

    mode = KernelLayoutFakeMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(False)
            for t in reals
        ]
    try:
        with fx_traceback.preserve_node_meta(), torch.no_grad():
            new = make_fx(run, tracing_mode="fake", record_stack_traces=True)(*fakes)
    finally:
        for n, c in saved_custom.items():
            if c is None:
                n.meta.pop(_CUSTOM, None)
            else:
                n.meta[_CUSTOM] = c
    new = fx.GraphModule(new, new.graph, class_name="GraphModule")
    drop_dead_compute(new.graph)
    finish(new, old_nodes, placeholders, expander.placements, in_specs, strip_tags=reduce_local)
    return new


_LOSS_OPS = {
    torch.ops.aten._log_softmax.default,
    torch.ops.aten._log_softmax_backward_data.default,
    torch.ops.aten.nll_loss_forward.default,
    torch.ops.aten.nll_loss_backward.default,
}


def _class_split(args: tuple[Any, ...]) -> bool:
    """Whether a loss op's logits (or log-probabilities) are split on their class dimension (1)."""
    return any(
        isinstance(a, DTensor)
        and a.ndim == 2
        and any(isinstance(p, Shard) and p.dim % 2 == 1 for p in a.placements)
        for a in args
    )


def _check_replicated_on_local(view: _LocalView, param_pl: dict[str, Any]) -> None:
    for name, pl in param_pl.items():
        if pl is not None and any(not isinstance(pl[k], Replicate) for k in view.local):
            raise ShardingPropagationError(
                f"spmd.DTensorExpandMode: parameter {name!r} has placements {describe_placements(pl)} "
                f"but mesh dimensions {view.local} take local batch semantics, where every parameter "
                "is Replicate(). Use batch_semantics='global' or replicate it there."
            )
