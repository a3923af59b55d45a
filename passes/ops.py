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
