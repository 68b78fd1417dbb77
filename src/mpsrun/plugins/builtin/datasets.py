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


# FashionMNIST's labels 0-9 (torchvision's FashionMNIST.classes): the served model, the figures and
# data_info.json name them.
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")

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
    val_fraction: float = 0.1,
    val_on_test: bool = False,
    test_subset: Optional[int] = None,
) -> DataSplits:
    if not val_on_test and not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")

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

    def read(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = "train" if train else "t10k"  # read with numpy (readers.py): no torchvision import
        try:
            images = readers.read_idx(readers.idx_path(raw, f"{prefix}-images-idx3-ubyte"))  # type: ignore[arg-type]
            labels = readers.read_idx(readers.idx_path(raw, f"{prefix}-labels-idx1-ubyte"))  # type: ignore[arg-type]
        except (OSError, EOFError, readers.IdxFormatError) as e:
            raise DatasetUnavailable(f"{cls_name} files in {raw.resolve()} cannot be read: {type(e).__name__}: {e}") from None
        return torch.from_numpy(images).unsqueeze(1).contiguous(), torch.from_numpy(labels).long()  # uint8 [N, 1, 28, 28]

    x_test, y_test = read(False)
    x, y = read(True)
    notes = []
    if val_on_test:
        # The seeds' habit (the PyTorch quickstart validates on the test set): said, tagged, no test split.
        train_split = TensorDataset(*_subset(x, y, subset, seed))
        val_split = TensorDataset(*_subset(x_test, y_test, val_subset, seed + 1))
        test_split = None
        notes.append(f"val_on_test: validating on the official {cls_name} test set; no held-out test split is left")
    else:
        # A seeded hold-out of the training images validates; the official test set is the test split.
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + 2))
        n_val = max(1, round(len(y) * val_fraction))
        va, tr = perm[:n_val].sort().values, perm[n_val:].sort().values
        train_split = TensorDataset(*_subset(x[tr], y[tr], subset, seed))
        val_split = TensorDataset(*_subset(x[va], y[va], val_subset, seed + 1))
        test_split = TensorDataset(*_subset(x_test, y_test, test_subset, seed + 3))
    splits = [train_split, val_split]
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
        info={**({"notes": notes} if notes else {}), **({"classes": list(FASHION_CLASSES)} if cls_name == "FashionMNIST" else {})},
        test=test_split,
    )


def fashion_mnist(
    root: str = "data",
    download: bool = True,
    resize: Optional[int] = None,
    rgb: bool = False,
    subset: Optional[int] = None,
    val_subset: Optional[int] = None,
    normalize: bool = False,
    val_fraction: float = 0.1,
    val_on_test: bool = False,
    test_subset: Optional[int] = None,
    seed: int = 0,
) -> DataSplits:
    """Fashion-MNIST (60,000 train / 10,000 test 28x28 images) read from the IDX files in ROOT/FashionMNIST/raw (downloaded with torchvision when absent).

    resize, rgb (grayscale to 3 channels) and normalize run on the device per batch.
    val is a seeded hold-out (val_fraction) of the training images and the official
    test set is the test split, evaluated once at the end; val_on_test: true
    validates on the test set instead (the PyTorch quickstart's habit; the run says
    so). subset / val_subset / test_subset take a seeded random subset of the
    training images left after the hold-out, of val and of test.
    """
    return _torchvision_mnist("FashionMNIST", root, download, resize, rgb, subset, val_subset, normalize, seed, val_fraction, val_on_test, test_subset)


def mnist(
    root: str = "data",
    download: bool = True,
    resize: Optional[int] = None,
    rgb: bool = False,
    subset: Optional[int] = None,
    val_subset: Optional[int] = None,
    normalize: bool = False,
    val_fraction: float = 0.1,
    val_on_test: bool = False,
    test_subset: Optional[int] = None,
    seed: int = 0,
) -> DataSplits:
    """MNIST handwritten digits (60,000 / 10,000 28x28 images) read from the IDX files in ROOT/MNIST/raw.

    Same options as fashion_mnist.
    """
    return _torchvision_mnist("MNIST", root, download, resize, rgb, subset, val_subset, normalize, seed, val_fraction, val_on_test, test_subset)


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
