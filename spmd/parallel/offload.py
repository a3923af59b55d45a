"""CPU offload of the sharded state: ``DataParallel(..., offload_policy=CPUOffloadPolicy())``.

FSDP2's ``CPUOffloadPolicy`` (FSDP1: ``cpu_offload=CPUOffload(offload_params=True)``) as a
property of the state and of the compiled graph. When the model computes on an accelerator
(the mesh's device, e.g. CUDA):

* state: each parameter's local shard and the optimizer state shaped like it live on the
  CPU (pinned when ``pin_memory``); the DTensors keep the accelerator mesh, so
  ``full_tensor()``, ``state_dict()`` and DCP see the usual placements. Scalar state
  (Adam's ``step``) moves to the CPU too. Buffers stay on the device.
* graph: the traced step computes on the device; the partitioner then copies each shard
  host-to-device right before each of its all-gathers (forward, and the backward
  re-gather), copies each reduced gradient shard device-to-host right after its
  reduce-scatter's wait, and leaves the optimizer region reading CPU tensors only, so the
  optimizer runs on the CPU. Norms over offloaded gradients (``clip_grad_norm_``) cross to
  the device for their all-reduce and back. In a dump these are the
  ``aten._to_copy.default(..., device=...)`` nodes next to each collective.

The device-to-host copies are blocking (``non_blocking=False``): the CPU optimizer reads
the gradient right after, and a non-blocking copy would need an explicit stream sync the
graph does not express. Host-to-device copies from pinned memory are non-blocking.

On a model that computes on the CPU there is nothing to offload: the policy is accepted
and ignored (logged once), so one script runs on CPU and GPU machines alike.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from spmd.errors import ConfigError

log = logging.getLogger("spmd")

CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPUOffloadPolicy:
    """Keep sharded parameters, gradients and optimizer state on the CPU; run the optimizer there.

    Args:
        pin_memory: allocate the CPU shards in pinned (page-locked) memory, so host-to-device
            copies are asynchronous (FSDP2's field of the same name). Needs an accelerator.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(
                f"spmd.CPUOffloadPolicy: pin_memory must be True or False, got {self.pin_memory!r}."
            )


def to_host(t: torch.Tensor, policy: CPUOffloadPolicy) -> torch.Tensor:
    """``t`` on the CPU (pinned if the policy says so)."""
    t = t.to(CPU)
    return t.pin_memory() if policy.pin_memory and not t.is_pinned() else t
