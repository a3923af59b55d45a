"""Marker ops the tracer plants in the graph.

``spmd::tag_grad(grad, param_name)`` wraps every parameter gradient at the moment
autograd produces it. It marks which node is the gradient of which parameter and
where backward hands over to the optimizer. A partitioner replaces it with a
gradient reduction; :func:`passes.cleanup.strip_grad_tags` removes the ones left.

It is an op (not a Python hook) so that it survives tracing as a node; it must
return a fresh tensor because custom ops may not alias their inputs, so an
unstripped tag costs a copy.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("spmd::tag_grad", mutates_args=())
def tag_grad(grad: torch.Tensor, param_name: str) -> torch.Tensor:
    return grad.clone()


@tag_grad.register_fake
def _(grad: torch.Tensor, param_name: str) -> torch.Tensor:
    return torch.empty_like(grad)


TAG_GRAD = torch.ops.spmd.tag_grad.default


# The CPU generator's state as graph ops. Activation checkpointing saves the generator's state
# in forward and restores it around the recomputation in backward (`torch.utils.checkpoint`,
# `torch.random.fork_rng`), so recomputed dropout draws the forward's mask and the stream goes
# on as if nothing was recomputed. Those calls do not dispatch, so a trace would drop them and
# the recomputation would draw fresh numbers; the tracer routes them through these ops instead.


@torch.library.custom_op("spmd::get_rng_state", mutates_args=())
def get_rng_state() -> torch.Tensor:
    return torch.default_generator.get_state()


@get_rng_state.register_fake
def _() -> torch.Tensor:
    return torch.empty(torch.default_generator.get_state().numel(), dtype=torch.uint8)


@torch.library.custom_op("spmd::set_rng_state", mutates_args=())
def set_rng_state(state: torch.Tensor) -> None:
    torch.default_generator.set_state(state)


@set_rng_state.register_fake
def _(state: torch.Tensor) -> None:
    return None


GET_RNG_STATE = torch.ops.spmd.get_rng_state.default
SET_RNG_STATE = torch.ops.spmd.set_rng_state.default
# No output, all effect: keep it through dead-code elimination.
torch.fx.node.has_side_effect(SET_RNG_STATE)
