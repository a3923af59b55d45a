"""State dicts of tensor-parallel fused projections in a layout DCP can save.

Automatic tensor parallelism splits a fused projection (GPT-2's ``c_attn``, a ``qkv`` Linear, a
fused gate/up) by groups: ``_StridedShard(dim, split_factor=k)`` on the tensor-parallel mesh
dimension, each rank holding its share of every one of the ``k`` groups. Those rows are not one
contiguous block of the full tensor, and a DCP checkpoint describes each rank's piece as one
block (a chunk's offsets and sizes): ``dcp.save`` refused such a parameter ("overlapping chunks").
FSDP2's own ``_StridedShard`` (the data dimension's rows of a tensor-parallel piece, ``Shard`` of
the same dimension after it) is one block and saves as it is.

So where a module or optimizer has such parameters, ``state_dict()`` gives them, and their
optimizer state, gathered over that mesh dimension (``Replicate`` there; every other dimension as
it was): the checkpoint holds the full tensor in its own layout, loadable at another mesh or
without one. Loading puts them back: the module's ``load_state_dict`` redistributes an entry to
its parameter's placements before copying, the optimizer's after loading. Cost: the gathered
tensors exist while the state dict does (a fused projection's weight and its two AdamW states,
over the tensor-parallel group).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from passes.torch_compat import StridedShard as _StridedShard

_HOOKED = "_spmd_checkpoint_layout"


def _blocks(placements: tuple[Placement, ...]) -> list[Placement]:
    """``placements`` with every strided split that leaves a rank's piece out of one block
    (nothing after it on the mesh splits its tensor dimension) replaced by ``Replicate``."""
    out = list(placements)
    for i, pl in enumerate(placements):
        if isinstance(pl, _StridedShard):
            later = placements[i + 1 :]
            if not any(isinstance(q, Shard | _StridedShard) and q.dim == pl.dim for q in later):
                out[i] = Replicate()
    return out


def _needs(t: Any) -> bool:
    return isinstance(t, DTensor) and _blocks(tuple(t.placements)) != list(t.placements)


def _saveable(t: Any) -> Any:
    return t.redistribute(t.device_mesh, _blocks(tuple(t.placements))) if _needs(t) else t


def _as(t: Any, like: DTensor) -> Any:
    """``t`` (a loaded entry) on ``like``'s mesh and placements, if it is a DTensor that differs."""
    if isinstance(t, DTensor) and tuple(t.placements) != tuple(like.placements):
        return t.redistribute(like.device_mesh, like.placements)
    return t


def register(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Hook ``module`` and ``optimizer`` (each once) if any parameter needs the layout (see module doc).

    Called each time the step prepares its state: the parameters are scanned once per module (the
    names found are kept on it), and an optimizer first seen later (``distribute(model)`` first,
    the step's optimizer at its first call) is hooked then."""
    strided: set[str] | None = getattr(module, _HOOKED, None)
    if strided is None:
        strided = {n for n, p in module.named_parameters() if _needs(p)}
        setattr(module, _HOOKED, strided)
        if strided:
            _hook_module(module, strided)
    if strided and optimizer is not None and not getattr(optimizer, _HOOKED, False):
        setattr(optimizer, _HOOKED, True)
        _hook_optimizer(optimizer, {id(p) for n, p in module.named_parameters() if n in strided})


def _hook_module(module: nn.Module, strided: set[str]) -> None:
    params = dict(module.named_parameters())

    def save_module(mod: nn.Module, sd: dict[str, Any], prefix: str, _meta: Any) -> None:
        for name in strided:
            if prefix + name in sd:
                sd[prefix + name] = _saveable(sd[prefix + name])

    def load_module(mod: nn.Module, sd: dict[str, Any], prefix: str, *_: Any) -> None:
        for name in strided:
            if prefix + name in sd:
                sd[prefix + name] = _as(sd[prefix + name], params[name])  # type: ignore[arg-type]

    module.register_state_dict_post_hook(save_module)
    module.register_load_state_dict_pre_hook(load_module)


def _hook_optimizer(optimizer: torch.optim.Optimizer, ids: set[int]) -> None:
    def save_optim(_opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        # New per-parameter dicts: the state dict's are the optimizer's own (``optimizer.state[p]``).
        states = sd.get("state", {})
        for idx, state in list(states.items()):
            if any(_needs(v) for v in state.values()):
                states[idx] = {k: _saveable(v) for k, v in state.items()}
        return sd

    def load_optim(opt: torch.optim.Optimizer) -> None:
        for p, state in opt.state.items():
            if id(p) in ids:
                for k, v in state.items():
                    if isinstance(v, DTensor) and v.shape == p.shape:
                        state[k] = _as(v, p)  # type: ignore[arg-type]

    optimizer.register_state_dict_post_hook(save_optim)
    optimizer.register_load_state_dict_post_hook(load_optim)
