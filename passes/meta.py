"""The node metadata vocabulary shared by the tracer and every pass.

The tracer records, once, what each node *is* (its role) and *when* it runs (its
phase), plus the module path that produced it. Passes read these keys instead of
guessing from node names, and must keep them true when they create nodes
(copy them from the node being replaced; see :func:`copy_meta`).
"""

from __future__ import annotations

import enum

import torch.fx as fx

ROLE = "spmd_role"
PHASE = "spmd_phase"
MODULE = "spmd_module"
# For placeholders: the fully qualified name of the state they carry
# (``"layers.0.weight"``, ``"state.layers.0.weight.exp_avg"``, ``"input.0"``).
STATE_NAME = "spmd_state_name"
# On a gradient node: the fully qualified name of the parameter it is the gradient of.
GRAD_OF = "spmd_grad_of"
# Which forward/backward pass of the step a node belongs to: 0, 1, ... for a step that
# accumulates gradients over micro-batches (one ``backward`` each), 0 otherwise. Optimizer
# nodes carry the number of backward calls.
MICROBATCH = "spmd_microbatch"
# On a dtype cast the tracer made for mixed precision: what it casts for compute, the fully
# qualified name of a parameter or buffer, or INPUT_CAST for a floating forward input of the
# root module. Partitioners find a parameter's compute copy by it (and cast before gathering).
CAST_OF = "spmd_cast_of"
INPUT_CAST = "<forward input>"
# On a parameter placeholder, set by the partitioner: how the parameter is distributed, in words
# (placements and the ranks of its groups, or "ignored"); the dump shows it.
PLACEMENT = "spmd_placement"
# On a parameter placeholder, set by the partitioner: True when the parameter is resharded after
# forward (fully_shard's ``reshard_after_forward=True``): what forward gathered is freed after its
# last forward reader and backward gathers the parameter again, so no backward op may read a
# forward gather of it (the ``reshard`` invariant, passes.invariants.check_reshard).
RESHARD = "spmd_reshard_after_forward"
# On a parameter placeholder, set by automatic tensor parallelism: why the parameter has its
# placement on the "tp" dimension (the candidate class it belongs to, what it saves and adds).
TP_CHOICE = "spmd_tp_choice"
# On every node DTensorExpandMode expands: the DTensor placements of the value the traced node
# computes (a tuple of Placements per tensor, a list of those for several outputs; a string for the
# nodes of an Override stand-in that runs on local tensors). The dump shows them.
NODE_PLACEMENTS = "spmd_expand_placements"


class Role(str, enum.Enum):
    """What a node holds."""

    PARAM = "param"
    BUFFER = "buffer"
    OPTIM_STATE = "optim_state"
    HYPERPARAM = "hyperparam"  # a lifted learning rate
    PARAM_GRAD = "param_grad"  # a parameter's ``.grad`` as it was before the step (accumulated onto)
    INPUT = "input"  # the user's local batch and other tensor arguments
    ACTIVATION = "activation"  # any intermediate of forward or backward
    GRAD = "grad"  # the gradient of a parameter, as the optimizer will read it
    UPDATE = "update"  # an optimizer-phase computation
    COMM = "comm"  # a collective, its wait, or the copies that pack/unpack a bucket (partitioner or pass)


class Phase(str, enum.Enum):
    """Which part of the train step a node belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


def role_of(node: fx.Node) -> Role | None:
    return node.meta.get(ROLE)


def phase_of(node: fx.Node) -> Phase | None:
    return node.meta.get(PHASE)


def module_of(node: fx.Node) -> str:
    """The module path that produced ``node`` ("" for the root or unknown)."""
    return node.meta.get(MODULE, "")


def set_meta(node: fx.Node, *, role: Role, phase: Phase, module: str = "", microbatch: int = 0) -> None:
    node.meta[ROLE] = role
    node.meta[PHASE] = phase
    node.meta[MODULE] = module
    node.meta[MICROBATCH] = microbatch


def copy_meta(dst: fx.Node, src: fx.Node, *, role: Role | None = None) -> None:
    """Give ``dst`` the phase and module of ``src`` (and its role unless overridden)."""
    dst.meta[ROLE] = role if role is not None else src.meta.get(ROLE, Role.ACTIVATION)
    dst.meta[PHASE] = src.meta.get(PHASE, Phase.FORWARD)
    dst.meta[MODULE] = src.meta.get(MODULE, "")
    dst.meta[MICROBATCH] = src.meta.get(MICROBATCH, 0)


# On a chunk's collective made by passes.async_tp: (chunk index, chunks). The dump shows it.
ASYNC_TP_CHUNK = "spmd_async_tp_chunk"

# On a copy that :func:`passes.layouts.fix_layouts` inserted because a tensor's real memory
# layout differed from the traced one where its reader depends on layout: what it fixed, in
# words. The dump marks such lines "| layout fix-up".
LAYOUT_FIX = "spmd_layout_fix"

# On a node whose kernel holds temporaries its inputs and outputs do not show (a chunked loss
# head, passes.linear_cross_entropy): the most bytes they take at once. The memory estimate
# (passes.memory) counts them as live while the node runs.
WORKSPACE = "spmd_workspace_bytes"
# On a loss head that passes.chunked_loss rewrote: what it did, in words; the dump shows it.
CHUNKED_LOSS = "spmd_chunked_loss"
