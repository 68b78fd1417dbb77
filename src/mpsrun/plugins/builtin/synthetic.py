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
    task: Literal["classification", "regression"] = "classification",
    num_outputs: int = 1,
    seed: int = 0,
) -> DataSplits:
    """Random inputs of a given shape and class count, seeded: for speed tests, not for accuracy.

    Labels are random too, so validation accuracy stays near 1/num_classes; that is
    expected. dtype uint8 (the default) mimics an image dataset: raw bytes stay on the
    device and are scaled to [0, 1] there per batch, like mnist; float32 draws standard
    normal values instead. The default shape and sizes match MNIST, so timings compare.
    task: regression draws float targets (N,) (or (N, num_outputs)) from a fixed random
    linear function of the inputs plus 10% noise, so a model can learn them (R^2 near 0.9).
    """
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"shape must be a non-empty list of positive sizes, got {shape}")
    if task == "classification" and num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    if train_size < 1 or val_size < 1:
        raise ValueError(f"train_size and val_size must be positive, got {train_size} and {val_size}")
    nbytes = (train_size + val_size) * math.prod(shape) * (1 if dtype == "uint8" else 4)
    if nbytes > 16 * 2**30:
        raise ValueError(f"synthetic data of {nbytes / 2**30:.1f} GiB is over the 16 GiB this plugin makes")
    if num_outputs < 1:
        raise ValueError(f"num_outputs must be at least 1, got {num_outputs}")
    g = torch.Generator().manual_seed(seed)
    width = math.prod(shape)
    w = torch.randn((width, num_outputs), generator=g) / math.sqrt(width)

    def draw(n: int) -> TensorDataset:
        if dtype == "uint8":
            x = torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)
        else:
            x = torch.randn((n, *shape), generator=g)
        if task == "regression":
            xf = x.float().reshape(n, -1)
            xf = (xf / 255.0 - 0.5) * math.sqrt(12) if dtype == "uint8" else xf  # unit variance either way
            y = xf @ w
            y = y + 0.33 * torch.randn(y.shape, generator=g)
            y = y.squeeze(1) if num_outputs == 1 else y
        else:
            y = torch.randint(0, num_classes, (n,), generator=g)
        return TensorDataset(x, y)

    train, val = draw(train_size), draw(val_size)
    return DataSplits(
        train=train,
        val=val,
        num_classes=num_classes if task == "classification" else 0,
        input_shape=tuple(shape),
        transform=ImageTransform() if dtype == "uint8" else None,
        task=task,
    )
