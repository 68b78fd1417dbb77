"""Built-in model plugins."""

from __future__ import annotations

import math
from typing import Literal, Optional

from torch import nn

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


def mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    num_outputs: Optional[int] = None,
    hidden: list[int] = [512, 512],  # noqa: B006 - shown as the default in `mpsrun plugins`
    dropout: float = 0.0,
    activation: Literal["relu", "gelu", "tanh"] = "relu",
) -> nn.Module:
    """Multi-layer perceptron on flattened inputs (784-512-512-10 for 28x28 images by default)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), _ACTIVATIONS[activation]()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_outputs or num_classes))  # num_outputs: k for regression
    return nn.Sequential(*layers)
