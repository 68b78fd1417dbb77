"""Built-in `synthetic` dataset: random tensors of any shape, for speed tests without downloads."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch.utils.data import TensorDataset

from mpsrun.plugins.contract import DataSplits, ImageTransform


def synthetic(
    shape: list[int] = [1, 28, 28],  # noqa: B006 - shown as the default in `mpsrun plugins`
    num_classes: int = 10,
    train_size: int = 60000,
    val_size: int = 10000,
    dtype: Literal["uint8", "float32"] = "uint8",
    seed: int = 0,
) -> DataSplits:
    """Random inputs of a given shape and class count, seeded: for speed tests, not for accuracy.

    Labels are random too, so validation accuracy stays near 1/num_classes; that is
    expected. dtype uint8 (the default) mimics an image dataset: raw bytes stay on the
    device and are scaled to [0, 1] there per batch, like mnist; float32 draws standard
    normal values instead. The default shape and sizes match MNIST, so timings compare.
    """
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"shape must be a non-empty list of positive sizes, got {shape}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    if train_size < 1 or val_size < 1:
        raise ValueError(f"train_size and val_size must be positive, got {train_size} and {val_size}")
    nbytes = (train_size + val_size) * math.prod(shape) * (1 if dtype == "uint8" else 4)
    if nbytes > 16 * 2**30:
        raise ValueError(f"synthetic data of {nbytes / 2**30:.1f} GiB is over the 16 GiB this plugin makes")
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> TensorDataset:
        if dtype == "uint8":
            x = torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)
        else:
            x = torch.randn((n, *shape), generator=g)
        y = torch.randint(0, num_classes, (n,), generator=g)
        return TensorDataset(x, y)

    train, val = draw(train_size), draw(val_size)
    return DataSplits(
        train=train,
        val=val,
        num_classes=num_classes,
        input_shape=tuple(shape),
        transform=ImageTransform() if dtype == "uint8" else None,
    )
