"""Dataset plugins: callables that return mpsrun.DataSplits.

mpsrun fills in `seed` (the recipe's seed) and `recipe_dir` (the recipe file's
folder, for data files named relative to the recipe) when the function declares
them; every other parameter is a recipe key under `dataset:`.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset

from mpsrun import DataSplits


def spirals(
    arms: int = 3,
    points_per_arm: int = 500,
    noise: float = 0.15,
    turns: float = 1.0,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> DataSplits:
    """Interleaved 2-D spirals, one class per arm: tiny, offline, and not linearly separable.

    Returns TensorDatasets of raw tensors (float32 points, int64 labels), so mpsrun
    keeps them on the device and batches there. Raise ValueError for bad arguments:
    mpsrun reports it as bad input (exit code 2) naming this plugin.
    """
    if arms < 2:
        raise ValueError(f"arms must be at least 2, got {arms}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(arms, points_per_arm, generator=g)  # distance along the arm, 0..1
    angle = r * turns * 2 * math.pi + torch.arange(arms).unsqueeze(1) * (2 * math.pi / arms)
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=-1)
    x = (x + noise * r.unsqueeze(-1) * torch.randn(x.shape, generator=g)).reshape(-1, 2)
    y = torch.arange(arms).repeat_interleave(points_per_arm)
    order = torch.randperm(len(y), generator=g)
    n_val = max(1, int(len(y) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return DataSplits(
        train=TensorDataset(x[train].float(), y[train]),
        val=TensorDataset(x[val].float(), y[val]),
        num_classes=arms,
        input_shape=(2,),
    )
