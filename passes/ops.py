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

import operator
from typing import Any

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


# The same for an accelerator's generator (``torch.cuda.get_rng_state``/``set_rng_state``: the
# seed and Philox offset that CUDA's dropout draws from), which checkpointing saves and restores
# per device of the checkpointed inputs (``torch.utils.checkpoint.get_device_states``).


def _device_module(device: torch.device) -> Any:
    return torch.get_device_module(device.type)


@torch.library.custom_op("spmd::get_device_rng_state", mutates_args=())
def get_device_rng_state(device: torch.device) -> torch.Tensor:
    return _device_module(device).get_rng_state(device)


@get_device_rng_state.register_fake
def _(device: torch.device) -> torch.Tensor:
    return torch.empty(_device_module(device).get_rng_state(device).numel(), dtype=torch.uint8)


@torch.library.custom_op("spmd::set_device_rng_state", mutates_args=())
def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    _device_module(device).set_rng_state(state, device)


@set_device_rng_state.register_fake
def _(state: torch.Tensor, device: torch.device) -> None:
    return None


GET_DEVICE_RNG_STATE = torch.ops.spmd.get_device_rng_state.default
SET_DEVICE_RNG_STATE = torch.ops.spmd.set_device_rng_state.default
torch.fx.node.has_side_effect(SET_DEVICE_RNG_STATE)
RNG_STATE_OPS = (GET_RNG_STATE, SET_RNG_STATE, GET_DEVICE_RNG_STATE, SET_DEVICE_RNG_STATE)


# CPU LSTM/GRU layers trace to `aten.mkldnn_rnn_layer`, whose kernel returns the workspace its
# backward needs only when grad mode is on; the graph runs under no_grad, so the backward got
# an undefined workspace. This op runs the same kernel with grad mode on, on detached inputs (so
# no autograd graph is built); the tracer swaps it in (keep_rnn_workspaces).

_RNN_LAYER = torch.ops.aten.mkldnn_rnn_layer.default


@torch.library.custom_op("spmd::mkldnn_rnn_layer_train", mutates_args=())
def mkldnn_rnn_layer_train(
    input: torch.Tensor,
    weight0: torch.Tensor,
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    weight3: torch.Tensor,
    hx_: torch.Tensor,
    cx_: torch.Tensor,
    reverse: bool,
    batch_sizes: list[int],
    mode: int,
    hidden_size: int,
    num_layers: int,
    has_biases: bool,
    bidirectional: bool,
    batch_first: bool,
    train: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = [t.detach() for t in (input, weight0, weight1, weight2, weight3, hx_, cx_)]
    with torch.enable_grad():
        out = _RNN_LAYER(*tensors, reverse, batch_sizes, mode, hidden_size, num_layers, has_biases,
                         bidirectional, batch_first, train)  # fmt: skip
    # Custom ops may not return their inputs or views of them; the kernel's outputs are fresh.
    return tuple(out)  # type: ignore[return-value]


@mkldnn_rnn_layer_train.register_fake
def _(input, weight0, weight1, weight2, weight3, hx_, cx_, *rest):  # noqa: ANN001
    return tuple(_RNN_LAYER(input, weight0, weight1, weight2, weight3, hx_, cx_, *rest))


RNN_LAYER_TRAIN = torch.ops.spmd.mkldnn_rnn_layer_train.default


def keep_rnn_workspaces(graph: torch.fx.Graph) -> int:
    """Swap every training ``aten.mkldnn_rnn_layer`` whose workspace (output 3) is used for
    :data:`RNN_LAYER_TRAIN` (same arguments, same outputs). Returns how many were swapped."""
    n_swapped = 0
    for n in graph.nodes:
        if n.op != "call_function" or n.target is not _RNN_LAYER:
            continue
        if any(u.target is operator.getitem and u.args[1] == 3 and u.users for u in n.users):
            n.target = RNN_LAYER_TRAIN
            n_swapped += 1
    return n_swapped
