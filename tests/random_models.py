"""Randomly shaped models for the property tests (tests/unit/test_properties.py) and their
world-size-2 sample (tests/dist/test_reliability.py)."""

from __future__ import annotations

import torch
import torch.nn as nn


class RandomMLP(nn.Module):
    """Linear layers of the given widths with ReLU between, then a Linear to ``n_classes``."""

    def __init__(self, widths: list[int], n_classes: int = 4):
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
