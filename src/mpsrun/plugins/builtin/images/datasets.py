"""The `image_folder` and `image_csv` dataset plugins.

Both end the same way (`_splits`): the file list is cut into train / val (/ test), the
images are decoded once into the uint8 cache (or the cache is reopened), unreadable files
are skipped or refused, and the splits are `TensorDataset`s over the memory map, so the
runner's resident rule applies unchanged: what fits beside the model is copied onto the device
once; otherwise batches are gathered from the map on a thread. Images over the host memory
budget (`host_max_gb`, MPSRUN_HOST_MAX_GB, else half the available memory) are `MappedRows`
instead, which the training loop reads from disk in shuffled blocks within that budget. The
transform scales and normalises with the dataset's own per-channel mean and std, on the device.
"""

from __future__ import annotations

import sys
import time
from typing import Literal, Optional, Union

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from mpsrun.plugins.builtin import readers
from mpsrun.plugins.builtin.images import cache as cache_mod
from mpsrun.plugins.builtin.images import memory, scan
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
    host_max_gb: Optional[float] = None,
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
    folder, else from the recipe's folder. host_max_gb: host memory the decoded images may
    hold (default: MPSRUN_HOST_MAX_GB, else half the available memory); a larger cache is
    read from disk in shuffled blocks within that budget.
    """
    t0 = time.perf_counter()
    path = scan.resolve_path(root, recipe_dir, "dataset.root")
    listing = scan.scan_folder(path)
    return _splits(listing, size, mode, val_fraction, on_bad_image, workers, seed, time.perf_counter() - t0, host_max_gb)


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
    host_max_gb: Optional[float] = None,
    recipe_dir: Optional[str] = None,
) -> DataSplits:
    """Images listed in a CSV: a path column (relative to the CSV's folder) and a label column (class names or integers 0..K-1).

    Class names are the sorted label names (or "0".."K-1" for integer labels). Same
    size, mode, val_fraction, on_bad_image, workers, host_max_gb and cache as image_folder.
    """
    t0 = time.perf_counter()
    path = scan.resolve_path(csv, recipe_dir, "dataset.csv")
    listing = scan.scan_csv(path, path_column, label_column)
    return _splits(listing, size, mode, val_fraction, on_bad_image, workers, seed, time.perf_counter() - t0, host_max_gb)


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


class MappedRows(Dataset):
    """A split of the cache left on disk, over the host memory budget: the training loop reads it in blocks
    (its `stream_spec`: train/loop/feed/stream.py); anything else reads it a sample at a time from the map."""

    def __init__(self, images: np.ndarray, path: str, rows: np.ndarray, labels: torch.Tensor, budget: int, why: str) -> None:
        self.images, self.rows, self.labels = images, rows, labels
        self.stream_spec = {"path": path, "file_rows": images.shape[0], "sample_shape": tuple(images.shape[1:]), "rows": rows,
                            "labels": labels, "budget": budget, "why": why}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.array(self.images[int(self.rows[i])])), self.labels[i]


STREAM_MIN_SHARE = 8  # a split over budget / 8 streams when the whole set is over the budget; smaller ones stay in memory


def _datasets(cache: cache_mod.Cache, x: torch.Tensor, y: torch.Tensor, rows: dict[str, np.ndarray], budget: int, how: str) -> tuple[dict[str, Dataset], str]:
    """TensorDatasets over the map while the images fit the host budget (the runner's resident rule applies);
    over it, the large splits are MappedRows, read from disk within the budget less the small splits' bytes."""
    row = int(np.prod(cache.images.shape[1:]))
    total = sum(len(r) for r in rows.values()) * row
    if total <= budget:
        return {s: TensorDataset(_take(x, r), y[torch.from_numpy(r)]) for s, r in rows.items()}, ""
    big = {s for s, r in rows.items() if len(r) * row > budget // STREAM_MIN_SHARE}
    held = sum(len(r) * row for s, r in rows.items() if s not in big)
    why = f"{memory.gib(total)} of decoded images exceed the host memory budget of {memory.gib(budget)} ({how})"
    out: dict[str, Dataset] = {}
    for s, r in rows.items():
        if s in big:
            share = (budget - held) * len(r) // max(1, sum(len(rows[b]) for b in big))
            out[s] = MappedRows(cache.images, str(cache.folder / "images.u8"), r, y[torch.from_numpy(r)], share, why)
        else:
            out[s] = TensorDataset(_take(x, r), y[torch.from_numpy(r)])
    return out, why


def _splits(
    listing: scan.Listing,
    size: Union[int, list[int]],
    mode: str,
    val_fraction: float,
    on_bad_image: str,
    workers: Optional[int],
    seed: int,
    scan_s: float = 0.0,
    host_max_gb: Optional[float] = None,
) -> DataSplits:
    h, w = _hw(size)
    budget, budget_how = memory.host_budget(host_max_gb)  # a bad figure is bad input before any decoding
    if workers is not None and workers < 1:
        raise ValueError(f"dataset.workers must be at least 1, got {workers}")
    rows = _split_indices(listing, val_fraction, seed)  # before decoding: a bad split costs no time
    files = listing.all_files()
    labels = np.asarray([lab for s in scan.SPLITS for lab in listing.labels.get(s, [])], dtype=np.int64)
    cache = cache_mod.open_or_build(files, h, w, mode, workers, stats=listing.stats)
    if cache.status == "reused":  # the build says so with its progress line; a reuse in one line
        print(f"images: {len(files):,} listed in {scan_s:.2f} s, decoded earlier, read from {cache.folder} (no image file opened)", file=sys.stderr, flush=True)
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
    ds, why = _datasets(cache, x, y, rows, budget, budget_how)
    if why:
        notes.append(f"images: {why}; read from disk in shuffled blocks (each once an epoch) within that budget")
        tags["mpsrun.data.host_budget"] = why
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
