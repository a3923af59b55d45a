"""Compatibility with Hugging Face ``transformers`` under spmd's trace: two shims.

``transformers.utils.is_tracing(t)`` is true for any ``FakeTensor``, and spmd traces the
step under fake tensors. Where Hugging Face decides from a tensor's *values* whether it
may skip work, it then takes the conservative path under spmd's trace even where eager,
with the same inputs, takes the other one. The case that changes results:
``masking_utils.find_packed_sequence_indices(position_ids)``, asked whenever a causal LM
runs without a cache and without an ``attention_mask`` (training with ``use_cache=False``).
Eager finds the positions ``0..T-1`` of one sequence per row, returns ``None``, and SDPA
runs with ``is_causal=True`` and no mask; under the trace the check is skipped, the model
builds an explicit ``T x T`` causal mask and SDPA runs with it: other kernels, other bits
(up to 1e-4 in step-0 gradients of a tiny Llama), and on a GPU no flash attention and an
s^2 mask per sequence.

The position ids the model builds itself (``torch.arange(T) + past_seen_tokens``) depend
on no input of the step: their values are known at trace time. :func:`hf_static_masks`
wraps ``find_packed_sequence_indices`` for the duration of the trace: when its argument's
value follows from constants alone (:func:`constant_value`: its ancestors in the graph
being traced are functional, non-random ops with no placeholder among them), the check
runs on that concrete value, as eager's does, and a row of one sequence gives eager's
``None``. Position ids that come from the step's inputs (packed sequences passed by the
user), and a 2-D ``attention_mask`` passed to the step (padded or not: its values are
data), keep Hugging Face's mask path, so padding is always masked.

Why this is still needed now that ``torch.compiler.is_compiling()`` is false outside
``optimizer.step()`` (:func:`spmd.frontend.optim.traceable_optimizers`): ``is_tracing(t)``
asks ``isinstance(t, FakeTensor)`` as well, and every tensor of the trace is one, so
``find_packed_sequence_indices`` would still skip its check on the fake value. The other
question a mask builder asks, ``_ignore_causal_mask_sdpa`` (may SDPA take ``is_causal=True``),
reads only ``is_compiling()`` when there is no padding mask (releases before 5.2x) or nothing
at all (later ones): with eager's answer from the flag, it needs no shim.

The second shim is the CTC loss of ``*ForCTC`` models (``loss_type="ForCTC"``: Wav2Vec2, HuBERT,
WavLM...). Hugging Face concatenates each sample's labels with ``labels.masked_select(mask)``,
whose length is the number of kept labels: a value, not a shape a graph can hold. Under the
trace, ``LOSS_MAPPING["ForCTC"]`` keeps the targets as ``(batch, U)`` rows with the kept labels
first (:func:`_padded_ctc_targets`), which ``F.ctc_loss`` reads the same way: the loss and the
gradients are eager's bit for bit. Nothing else in ``transformers`` is changed; without
``transformers`` imported this is a no-op.

Versions: spmd supports transformers 5.23 and later (the ``hf`` and ``test`` extras of
``pyproject.toml``); both shims were checked on 5.23.0 and 5.24.0 (``tests/unit/test_hf_compat.py``,
``tests/unit/test_eager_branches.py``, ``tests/unit/test_foreign_models.py``). Older 5.x releases
(the accelerator image's 5.17.0 among them) differ in three places, none of which a shim here can
change without rewriting Hugging Face's model code: ``LOSS_MAPPING`` has no ``"ForCTC"`` entry before
5.21 (``Wav2Vec2ForCTC`` computes the loss inline with ``masked_select``; the CTC shim then leaves
everything unchanged); Wav2Vec2's encoder asks ``torch.rand([]) < config.layerdrop`` in training
even at ``layerdrop=0`` before 5.23, so tracing any Wav2Vec2/HuBERT/WavLM training step is refused
(``DataDependentControlFlowError`` at ``if not skip_the_layer``); and Mixtral's load-balancing loss
counts tokens per expert with ``torch.bincount`` (an output shape that depends on the values) before
5.23, so training it with ``output_router_logits`` is refused whatever the experts implementation.
The position-ids shim works on 5.17.0 too. The experts hint (:func:`hf_data_dependent_hint`) reads
``config._experts_implementation`` and ``transformers/integrations/moe.py``, present in all of them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, get_proxy_mode, get_proxy_slot

from passes import torch_compat
from passes.torch_compat import FakeTensor, OpOverload, unset_fake_temporarily

log = logging.getLogger("spmd")

# A value computed from more nodes than this is not an index tensor; leave it traced.
_MAX_NODES = 64


def constant_value(t: Any) -> torch.Tensor | None:
    """The real value of ``t``, a tensor of the graph being traced, when it follows from
    constants alone (no placeholder, attribute, random or in-place op among the ops that
    computed it); else ``None``. Evaluates those ops again on real tensors, outside the trace."""
    mode = get_proxy_mode()
    if mode is None or not isinstance(t, FakeTensor):
        return None
    proxy = get_proxy_slot(t, mode.tracer, None, lambda p: p.proxy)
    if proxy is None:
        return None
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> bool:
        if node in seen:
            return True
        seen.add(node)
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload):
            return False
        schema = torch_compat.op_schema(target)
        if torch.Tag.nondeterministic_seeded in target.tags or schema.is_mutable:
            return False
        for arg in node.all_input_nodes:
            if not visit(arg):
                return False
        order.append(node)
        return len(order) <= _MAX_NODES

    if not visit(proxy.node):
        return None
    env: dict[fx.Node, Any] = {}
    with disable_proxy_modes_tracing(), unset_fake_temporarily():
        try:
            for node in order:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception as exc:  # e.g. a device the trace only pretended to have: stay traced
            log.debug("spmd: cannot evaluate %s outside the trace: %r", proxy.node, exc)
            return None
    value = env[proxy.node]
    return value if isinstance(value, torch.Tensor) else None


def _static_packed_check(original: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        value = constant_value(position_ids)
        if value is not None:
            # On the real value, as eager: outside the trace (is_tracing() is then false).
            with disable_proxy_modes_tracing(), unset_fake_temporarily():
                packed = original(value)
        if value is not None and packed is None:
            log.debug("spmd: position ids are constants of one sequence per row: no packed-sequence mask")
            return None
        return original(position_ids)

    find_packed_sequence_indices.__spmd_shim__ = True  # type: ignore[attr-defined]
    return find_packed_sequence_indices


_SHIMS = {
    "find_packed_sequence_indices": _static_packed_check,
}


def _padded_ctc_targets(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def ForCTCLoss(  # noqa: N802 - Hugging Face's name
        logits: torch.Tensor,
        labels: torch.Tensor,
        logit_lengths: torch.Tensor,
        blank_token_id: int,
        reduction: str = "mean",
        zero_infinity: bool = False,
        ignore_index: int = -100,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(labels, FakeTensor) or labels.dim() != 2:
            return original(
                logits,
                labels,
                logit_lengths,
                blank_token_id,
                reduction,
                zero_infinity,
                ignore_index,
                **kwargs,
            )
        # transformers' ForCTCLoss, but the targets stay (batch, U): each row's kept labels first,
        # in order (a stable sort on "dropped"), where Hugging Face concatenates them with
        # masked_select (a shape that depends on the labels' values). The CTC kernel reads each
        # sample's first target_length labels either way: the same loss and gradient, bit for bit.
        labels = labels.to(logits.device)
        labels_mask = (labels != ignore_index) & (labels != blank_token_id)
        target_lengths = labels_mask.sum(-1)
        order = torch.argsort((~labels_mask).to(torch.int8), dim=1, stable=True)
        targets = labels.gather(1, order)
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
        with torch.backends.cudnn.flags(enabled=False):
            return torch.nn.functional.ctc_loss(
                log_probs,
                targets,
                logit_lengths,
                target_lengths,
                blank=blank_token_id,
                reduction=reduction,
                zero_infinity=zero_infinity,
            )

    ForCTCLoss.__spmd_shim__ = True  # type: ignore[attr-defined]
    return ForCTCLoss


@contextlib.contextmanager
def _ctc_loss_shim() -> Iterator[None]:
    losses = sys.modules.get("transformers.loss.loss_utils")
    mapping = getattr(losses, "LOSS_MAPPING", None)
    original = mapping.get("ForCTC") if isinstance(mapping, dict) else None
    if original is None or getattr(original, "__spmd_shim__", False):
        yield
        return
    mapping["ForCTC"] = _padded_ctc_targets(original)  # type: ignore[index]
    try:
        yield
    finally:
        mapping["ForCTC"] = original  # type: ignore[index]


@contextlib.contextmanager
def hf_static_masks() -> Iterator[None]:
    """For the duration of a trace, let ``transformers`` decide from position ids whose values
    are known at trace time, as eager does, and give its ``ForCTC`` loss fixed-shape targets
    (see the module docstring)."""
    masking = sys.modules.get("transformers.masking_utils")
    originals = {}
    for name, wrap in _SHIMS.items():
        original = getattr(masking, name, None)
        if original is not None and not getattr(original, "__spmd_shim__", False):
            originals[name] = original
            setattr(masking, name, wrap(original))
    try:
        with _ctc_loss_shim():
            yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)


def _is_experts_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face experts module: its class went through
    ``transformers.integrations.moe.use_experts_implementation`` (the decorator that dispatches
    on ``config._experts_implementation``), or, for releases without it, is named ``*Experts``."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    filename = getattr(code, "co_filename", "").replace("\\", "/")
    return filename.endswith("transformers/integrations/moe.py") or type(module).__name__.endswith("Experts")


def hf_data_dependent_hint(module: torch.nn.Module | None) -> str:
    """What to change when a Hugging Face experts module fails the trace with a data-dependent
    shape (``nonzero``): in the ``"eager"`` experts implementation it loops over the experts the
    routing hit. Empty for any other module: ``transformers`` sets
    ``config._experts_implementation == "eager"`` on every model, MoE or not, so the config alone
    does not say that the refusing module has experts."""
    config = getattr(module, "config", None)
    if module is None or getattr(config, "_experts_implementation", None) != "eager":
        return ""
    if not _is_experts_module(module):
        return ""
    return (
        " This is a Hugging Face experts module in its 'eager' implementation (a loop over the experts "
        "the routing hit): build the model with experts_implementation='grouped_mm' (Hugging Face's "
        "default) or 'batched_mm', which compute every expert over fixed shapes and trace "
        "(from_pretrained(..., experts_implementation='grouped_mm'), or "
        "model.set_experts_implementation('grouped_mm'))."
    )


__all__ = ["constant_value", "hf_data_dependent_hint", "hf_static_masks"]
