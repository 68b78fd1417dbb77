"""Built-in dataset plugins.

The image datasets return raw uint8 tensors in `TensorDataset`s plus an
`ImageTransform`, so the runner can keep them on the device and do the float
conversion there, batch by batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import TensorDataset

from mpsrun.plugins.builtin import readers
from mpsrun.plugins.contract import DataSplits, ImageTransform

_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


class DatasetUnavailable(Exception):
    """The data is not on disk and could not be fetched: bad input (exit code 2)."""


def _has_files(raw: Path) -> bool:
    return all(readers.idx_path(raw, f) is not None for f in _MNIST_FILES)


def _subset(x: torch.Tensor, y: torch.Tensor, n: Optional[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if n is None or n >= len(y):
        return x, y
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(y), generator=g)[:n]
    return x[idx], y[idx]


def _torchvision_mnist(
    cls_name: str,
    root: str,
    download: bool,
    resize: Optional[int],
    rgb: bool,
    subset: Optional[int],
    val_subset: Optional[int],
    normalize: bool,
    seed: int,
) -> DataSplits:
    root_path = Path(root).expanduser()
    raw = root_path / cls_name / "raw"
    if not _has_files(raw):
        if not download:
            raise DatasetUnavailable(
                f"{cls_name} files not found in {raw.resolve()} and download is off; "
                f"expected {', '.join(f + '.gz' for f in _MNIST_FILES)} there"
            )
        try:
            import torchvision.datasets as tvd  # only to download; reading is numpy's (readers.py)

            getattr(tvd, cls_name)(str(root_path), train=True, download=True)
        except Exception as e:
            raise DatasetUnavailable(
                f"{cls_name} files not found in {raw.resolve()} and the download failed "
                f"({type(e).__name__}: {e}); put {', '.join(f + '.gz' for f in _MNIST_FILES)} there "
                f"or set dataset.root to the folder that holds {cls_name}/raw"
            ) from None
    splits = []
    for train, n in ((True, subset), (False, val_subset)):
        prefix = "train" if train else "t10k"
        try:
            images = readers.read_idx(readers.idx_path(raw, f"{prefix}-images-idx3-ubyte"))  # type: ignore[arg-type]
            labels = readers.read_idx(readers.idx_path(raw, f"{prefix}-labels-idx1-ubyte"))  # type: ignore[arg-type]
        except (OSError, EOFError, readers.IdxFormatError) as e:
            raise DatasetUnavailable(f"{cls_name} files in {raw.resolve()} cannot be read: {type(e).__name__}: {e}") from None
        x = torch.from_numpy(images).unsqueeze(1).contiguous()  # uint8 [N, 1, 28, 28]
        y = torch.from_numpy(labels).long()
        x, y = _subset(x, y, n, seed + (0 if train else 1))
        splits.append(TensorDataset(x, y))
    mean, std = ((0.2860,), (0.3530,)) if cls_name == "FashionMNIST" else ((0.1307,), (0.3081,))
    transform = ImageTransform(
        mean=mean if normalize else None, std=std if normalize else None, resize=resize, rgb=rgb
    )
    return DataSplits(
        train=splits[0],
        val=splits[1],
        num_classes=10,
        input_shape=transform.output_shape((1, 28, 28)),
        transform=transform,
    )


def fashion_mnist(
    root: str = "data",
    download: bool = True,
    resize: Optional[int] = None,
    rgb: bool = False,
    subset: Optional[int] = None,
    val_subset: Optional[int] = None,
    normalize: bool = False,
    seed: int = 0,
) -> DataSplits:
    """Fashion-MNIST (60,000 train / 10,000 test 28x28 images) read from the IDX files in ROOT/FashionMNIST/raw (downloaded with torchvision when absent).

    resize, rgb (grayscale to 3 channels) and normalize run on the device per batch;
    subset / val_subset take a seeded random subset of each split.
    """
    return _torchvision_mnist("FashionMNIST", root, download, resize, rgb, subset, val_subset, normalize, seed)


def mnist(
    root: str = "data",
    download: bool = True,
    resize: Optional[int] = None,
    rgb: bool = False,
    subset: Optional[int] = None,
    val_subset: Optional[int] = None,
    normalize: bool = False,
    seed: int = 0,
) -> DataSplits:
    """MNIST handwritten digits (60,000 / 10,000 28x28 images) read from the IDX files in ROOT/MNIST/raw.

    Same options as fashion_mnist.
    """
    return _torchvision_mnist("MNIST", root, download, resize, rgb, subset, val_subset, normalize, seed)


def digits(val_fraction: float = 0.2, seed: int = 0) -> DataSplits:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images): offline, trains in seconds on a CPU.

    The validation split is stratified and seeded, so every run sees the same split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    # Read straight from scikit-learn's bundled csv.gz, split as train_test_split(stratify=)
    # would: the same arrays and split without importing scikit-learn (readers.py says why).
    images, target = readers.read_digits()
    x = torch.tensor(images, dtype=torch.uint8).unsqueeze(1)  # values 0..16
    y = torch.tensor(target, dtype=torch.long)
    tr, va = readers.stratified_split(target, val_fraction, seed)
    tr_t, va_t = torch.from_numpy(tr), torch.from_numpy(va)
    return DataSplits(
        train=TensorDataset(x[tr_t], y[tr_t]),
        val=TensorDataset(x[va_t], y[va_t]),
        num_classes=10,
        input_shape=(1, 8, 8),
        transform=ImageTransform(scale=1.0 / 16.0),
    )
