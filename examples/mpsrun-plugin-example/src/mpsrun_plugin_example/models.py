"""Model plugins: callables that return a torch.nn.Module.

mpsrun fills in `input_shape` and `num_classes` from the dataset because the
function declares them; every other parameter is a recipe key under `model:`,
checked against these type hints before any data loads.
"""

from __future__ import annotations

import math

from torch import nn


class _Block(nn.Module):
    """x + MLP(LayerNorm(x)): the pre-norm residual block of transformers, on vectors."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, width)
        )

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x + self.body(x)


def residual_mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    width: int = 64,
    depth: int = 2,
    dropout: float = 0.0,
) -> nn.Module:
    """Residual MLP: flatten, project to `width`, `depth` pre-norm residual blocks, classify.

    Works on any input shape (it flattens), so it also runs on mpsrun's built-in
    datasets: `mpsrun run RECIPE dataset.name=digits`.
    """
    if width < 1 or depth < 0:
        raise ValueError(f"width must be positive and depth non-negative, got {width} and {depth}")
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), width),
        *[_Block(width, dropout) for _ in range(depth)],
        nn.LayerNorm(width),
        nn.Linear(width, num_classes),
    )
