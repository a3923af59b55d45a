"""``spmd.frontend.hf_compat``: which traced tensors count as constants, and the shim's scope. The models
it is for (HF causal LMs with sdpa attention) are in tests/unit/test_foreign_models.py and
tests/dist/test_hf_attention.py."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd.frontend.hf_compat import constant_value, hf_static_masks


def _seen(f, *inputs: torch.Tensor) -> list:
    """``constant_value`` of what ``f`` returns, while make_fx traces it on fake tensors."""
    seen: list = []

    def traced(*xs: torch.Tensor) -> torch.Tensor:
        out = f(*xs)
        seen.append(constant_value(out))
        return out

    make_fx(traced, tracing_mode="fake")(*inputs)
    return seen


def test_values_computed_from_constants_are_concrete() -> None:
    x = torch.randn(2, 5)
    (value,) = _seen(lambda x: (torch.arange(x.shape[1]) + 3).unsqueeze(0).expand(x.shape[0], -1), x)
    assert torch.equal(value, (torch.arange(5) + 3).expand(2, -1))


@pytest.mark.parametrize(
    "f",
    [
        lambda x: torch.arange(x.shape[1]) + x[0].long(),  # reads an input
        lambda x: torch.rand(x.shape[1]),  # random: evaluating it again would draw other numbers
        lambda x: torch.zeros(3).add_(1),  # in place
    ],
)
def test_inputs_random_and_in_place_ops_stay_traced(f) -> None:
    assert _seen(f, torch.randn(2, 5)) == [None]


def test_outside_a_trace_nothing_is_constant() -> None:
    assert constant_value(torch.arange(3)) is None


def test_the_shim_lives_only_for_the_block() -> None:
    masking = pytest.importorskip("transformers.masking_utils")
    original = masking.find_packed_sequence_indices
    with hf_static_masks():
        assert masking.find_packed_sequence_indices is not original
        with hf_static_masks():  # nested (a trace inside a trace): wrapped once
            assert masking.find_packed_sequence_indices.__wrapped__ is original
    assert masking.find_packed_sequence_indices is original


def test_the_ctc_shim_leaves_a_mapping_without_forctc_alone(monkeypatch) -> None:
    """transformers 5.17 has no ``LOSS_MAPPING["ForCTC"]`` (its CTC models compute the loss inline)."""
    losses = pytest.importorskip("transformers.loss.loss_utils")
    mapping = {k: v for k, v in losses.LOSS_MAPPING.items() if k != "ForCTC"}
    monkeypatch.setattr(losses, "LOSS_MAPPING", mapping)
    before = dict(mapping)
    with hf_static_masks():
        assert mapping == before
    assert mapping == before


def test_the_ctc_shim_lives_only_for_the_block() -> None:
    losses = pytest.importorskip("transformers.loss.loss_utils")
    if "ForCTC" not in losses.LOSS_MAPPING:  # transformers 5.17: the test above covers it
        pytest.skip(f"transformers {sys.modules['transformers'].__version__} has no LOSS_MAPPING['ForCTC']")
    original = losses.LOSS_MAPPING["ForCTC"]
    with hf_static_masks():
        assert losses.LOSS_MAPPING["ForCTC"].__wrapped__ is original
        with hf_static_masks():  # nested (a trace inside a trace): wrapped once
            assert losses.LOSS_MAPPING["ForCTC"].__wrapped__ is original
    assert losses.LOSS_MAPPING["ForCTC"] is original
