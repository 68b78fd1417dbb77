"""The `image_folder` and `image_csv` dataset plugins.

Both end the same way (`_splits`): the file list is cut into train / val (/ test), the
images are decoded once into the uint8 cache (or the cache is reopened), unreadable files
are skipped or refused, and the splits are `TensorDataset`s over the memory map, so the
runner's resident rule applies unchanged: small enough, and the whole cache is copied onto
the device once; otherwise batches are gathered from the map. The transform scales and
normalises with the dataset's own per-channel mean and std, on the device.
"""

from __future__ import annotations

import sys
import time
from typing import Literal, Optional, Union

import numpy as np
import torch
from torch.utils.data import TensorDataset

from mpsrun.plugins.builtin import readers
from mpsrun.plugins.builtin.images import cache as cache_mod
from mpsrun.plugins.builtin.images import scan
from mpsrun.plugins.contract import DataSplits, ImageTransform

SHOWN_BAD = 3  # unreadable files named on screen; the rest are counted


def image_folder(
    root: str,
    size: Union[int, list[int]] = 224,
    mode: Literal["rgb", "gray"] = "rgb",
    val_fraction: float = 0.1,
    on_bad_image: Literal["skip", "fail"] = "skip",
    workers: Optional[int] = None,
    seed: int = 0,
    recipe_dir: Optional[str] = None,
) -> DataSplits:
    """Images in class folders (ROOT/cat/1.jpg), or ROOT/train, ROOT/val (and ROOT/test) of that layout; decoded once into a uint8 cache.

    Class names are the folder names, in sorted order. JPEG, PNG, WebP and BMP files are
    read; other files are ignored. size: 224 resizes the shorter side to 224 and
    centre-crops a square; [h, w] covers h x w and centre-crops. mode: rgb or gray.
    Without a val/ folder, val_fraction of the training images (stratified, seeded)
    validate. The first run decodes every image in `workers` processes (default: all
    cores; nvJPEG on a CUDA GPU) into ~/.cache/mpsrun/images (or $MPSRUN_CACHE/images);
    later runs open no image file. on_bad_image: skip (named on screen, tagged
    mpsrun.data.skipped) or fail (exit 2). A relative root is read from the working
    folder, else from the recipe's folder.
    """
    t0 = time.perf_counter()
    path = scan.resolve_path(root, recipe_dir, "dataset.root")
    listing = scan.scan_folder(path)
    return _splits(listing, size, mode, val_fraction, on_bad_image, workers, seed, time.perf_counter() - t0)


def image_csv(
    csv: str,
    path_column: str = "path",
    label_column: str = "label",
    size: Union[int, list[int]] = 224,
    mode: Literal["rgb", "gray"] = "rgb",
    val_fraction: float = 0.1,
    on_bad_image: Literal["skip", "fail"] = "skip",
    workers: Optional[int] = None,
    seed: int = 0,
    recipe_dir: Optional[str] = None,
) -> DataSplits:
    """Images listed in a CSV: a path column (relative to the CSV's folder) and a label column (class names or integers 0..K-1).

    Class names are the sorted label names (or "0".."K-1" for integer labels). Same
    size, mode, val_fraction, on_bad_image, workers and cache as image_folder.
    """
    t0 = time.perf_counter()
    path = scan.resolve_path(csv, recipe_dir, "dataset.csv")
    listing = scan.scan_csv(path, path_column, label_column)
    return _splits(listing, size, mode, val_fraction, on_bad_image, workers, seed, time.perf_counter() - t0)


def _hw(size: Union[int, list[int]]) -> tuple[int, int]:
    if isinstance(size, int):
        h = w = size
    elif isinstance(size, (list, tuple)) and len(size) == 2:
        h, w = int(size[0]), int(size[1])
    else:
        raise ValueError(f"dataset.size must be an integer or [height, width], got {size!r}")
    if not (1 <= h <= 4096 and 1 <= w <= 4096):
        raise ValueError(f"dataset.size must be between 1 and 4096 pixels, got {size!r}")
    return h, w


def _split_indices(listing: scan.Listing, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Rows of the all-files list per split; a seeded stratified hold-out when there is no val/."""
    out: dict[str, np.ndarray] = {}
    start = 0
    for s in scan.SPLITS:
        n = len(listing.files.get(s, []))
        if n:
            out[s] = np.arange(start, start + n)
        start += n
    if "val" not in out:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"dataset.val_fraction must be between 0 and 1, got {val_fraction}")
        y = np.asarray(listing.labels["train"])
        try:
            tr, va = readers.stratified_split(y, val_fraction, seed)
        except ValueError as e:
            raise ValueError(f"cannot hold out val_fraction {val_fraction} of {len(y)} images stratified by class: {e}; add images or a val/ folder") from None
        out["val"], out["train"] = np.sort(va), np.sort(tr)
    return out


def _take(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """A view when the rows are one contiguous run (no copy of the map), else a gather."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return x[int(rows[0]) : int(rows[-1]) + 1]
    return x[torch.from_numpy(rows)]


def _splits(
    listing: scan.Listing,
    size: Union[int, list[int]],
    mode: str,
    val_fraction: float,
    on_bad_image: str,
    workers: Optional[int],
    seed: int,
    scan_s: float = 0.0,
) -> DataSplits:
    h, w = _hw(size)
    if workers is not None and workers < 1:
        raise ValueError(f"dataset.workers must be at least 1, got {workers}")
    rows = _split_indices(listing, val_fraction, seed)  # before decoding: a bad split costs no time
    files = listing.all_files()
    labels = np.asarray([lab for s in scan.SPLITS for lab in listing.labels.get(s, [])], dtype=np.int64)
    cache = cache_mod.open_or_build(files, h, w, mode, workers)
    if cache.status == "reused":  # the build says so with its progress line; a reuse in one line
        print(f"images: {len(files):,} decoded earlier, read from {cache.folder} (no image file opened)", file=sys.stderr, flush=True)
    notes: list[str] = list(cache.notes)
    tags = {"mpsrun.data.cache": cache.status, "mpsrun.data.cache_dir": str(cache.folder)}
    if cache.status == "built":  # the progress line said it on screen; the run keeps the figure
        tags["mpsrun.data.decode_img_per_s"] = f"{len(files) / max(scan_s + cache.seconds, 1e-9):.0f}"  # as the user waits: scan to cache ready
        tags["mpsrun.data.decode"] = "; ".join(cache.how)
        phases = {"scan": scan_s, **cache.phases}  # where the first run's wait went
        tags["mpsrun.data.decode_phases"] = ", ".join(f"{k} {'not waited for' if v is None else f'{v:.2f} s'}" for k, v in phases.items())
    if cache.bad:
        shown = "; ".join(f"{files[i]} ({why})" for i, why in sorted(cache.bad.items())[:SHOWN_BAD])  # in file order, the same on every build
        more = f" and {len(cache.bad) - SHOWN_BAD} more" if len(cache.bad) > SHOWN_BAD else ""
        if on_bad_image == "fail":
            raise ValueError(f"{len(cache.bad)} image(s) could not be decoded: {shown}{more}; fix or remove them, or set dataset.on_bad_image: skip")
        notes.append(f"images: skipped {len(cache.bad)} unreadable image(s): {shown}{more}")
        bad = np.asarray(sorted(cache.bad), dtype=np.int64)
        rows = {s: r[~np.isin(r, bad)] for s, r in rows.items()}
    for s, r in rows.items():
        present = set(labels[r].tolist())
        if s == "train" and len(present) < 2:
            raise ValueError(f"the training images left hold {len(present)} class(es): a classifier needs at least two")
    x = torch.from_numpy(cache.images)  # (N, C, H, W) uint8 over the memory map
    y = torch.from_numpy(labels)
    ds = {s: TensorDataset(_take(x, r), y[torch.from_numpy(r)]) for s, r in rows.items()}
    transform = ImageTransform(mean=tuple(cache.mean), std=tuple(cache.std))
    c = 1 if mode == "gray" else 3
    info = {
        "classes": listing.classes,
        "class_names": listing.classes,
        "image_size": [h, w],
        "mode": mode,
        "mean": cache.mean,
        "std": cache.std,
        "source": listing.source,
        "cache": str(cache.folder),
        "notes": notes,
        "tags": {**tags, "mpsrun.data.skipped": str(len(cache.bad))},
    }
    return DataSplits(
        train=ds["train"],
        val=ds["val"],
        num_classes=len(listing.classes),
        input_shape=(c, h, w),
        transform=transform,
        info=info,
        test=ds.get("test"),
    )
