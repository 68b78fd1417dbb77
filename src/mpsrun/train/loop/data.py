"""Batching: device-resident fast path, DataLoader path for the rest.

Batches are raw (e.g. uint8 images): the engine applies the dataset's transform
on the device, inside the (possibly graphed) step. The resident path copies the dataset's raw tensors to the device once and each
epoch gathers them in a new order in a single kernel, so a batch is a free slice
and no per-sample Python runs. The shuffle order comes from a seeded CPU
generator, identical on every device, so devices see the same batches.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset

Transform = Optional[Callable[[torch.Tensor], torch.Tensor]]


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch: a pure function of (seed, epoch).

    So an epoch's data order does not depend on how many epochs ran before it in
    this process, and a run resumed from a checkpoint sees exactly the batches an
    uninterrupted run would have seen.
    """
    return (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + 1) % 2**63


def raw_tensors(ds: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(inputs, labels) when a dataset exposes them (TensorDataset), else None."""
    tensors = getattr(ds, "tensors", None)
    if isinstance(tensors, (tuple, list)) and len(tensors) == 2 and all(torch.is_tensor(t) for t in tensors):
        return tensors[0], tensors[1]
    return None


def nbytes(ds: Dataset) -> int | None:
    t = raw_tensors(ds)
    return None if t is None else sum(x.numel() * x.element_size() for x in t)


class ResidentBatches:
    """Batches sliced from tensors that live on the device."""

    resident = True

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        device: torch.device,
        shuffle: bool,
        seed: int,
    ) -> None:
        self.x = x.to(device)
        self.y = y.to(device)
        self.n = len(self.y)
        self.samples = self.n  # samples per epoch (len() is batches)
        self.batch_size = batch_size
        self.device = device
        self.shuffle = shuffle
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed)

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shuffle for `epoch` (the engine calls it at each epoch start)."""
        self._gen.manual_seed(epoch_seed(self.seed, epoch))

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def epoch_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole epoch's raw inputs and labels, in this epoch's order."""
        if not self.shuffle:
            return self.x, self.y
        perm = torch.randperm(self.n, generator=self._gen).to(self.device, non_blocking=True)
        return self.x.index_select(0, perm), self.y.index_select(0, perm)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.epoch_tensors()
        bs = self.batch_size
        for i in range(0, self.n, bs):
            yield x[i : i + bs], y[i : i + bs]


class LoaderBatches:
    """A DataLoader whose batches are moved to the device and transformed there."""

    resident = False

    def __init__(
        self,
        ds: Dataset,
        batch_size: int,
        device: torch.device,
        shuffle: bool,
        seed: int,
        num_workers: int = 0,
        persistent_workers: bool = True,
        pin_memory: bool | str = "auto",
    ) -> None:
        pin = device.type == "cuda" if pin_memory == "auto" else bool(pin_memory) and device.type == "cuda"
        kwargs: dict = {}
        if num_workers > 0:
            kwargs["persistent_workers"] = persistent_workers
            if sys.platform == "darwin":
                # macOS defaults to spawn; say so explicitly so behaviour does not drift.
                kwargs["multiprocessing_context"] = "spawn"
        self.loader = DataLoader(
            ds,
            batch_size=batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(seed),
            num_workers=num_workers,
            pin_memory=pin,
            **kwargs,
        )
        self.samples = len(ds)  # samples per epoch (len() is batches)
        self.seed = seed
        self.device = device
        self.non_blocking = pin

    def set_epoch(self, epoch: int) -> None:
        """Reseed the sampler's generator for `epoch` (the sampler and worker seeds draw from it)."""
        if self.loader.generator is not None:
            self.loader.generator.manual_seed(epoch_seed(self.seed, epoch))

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for xb, yb in self.loader:
            xb = xb.to(self.device, non_blocking=self.non_blocking)
            yb = yb.to(self.device, non_blocking=self.non_blocking)
            yield xb, yb


class HostSliceBatches(LoaderBatches):
    """Raw tensors that stay in host memory (a memory-mapped image cache too large for the device).

    Each batch is one `index_select` over the host tensor (rows sorted, so a memory map is read
    front to back; validation batches are plain contiguous slices), pinned on CUDA and copied
    to the device while the previous batch trains: no per-sample Python, unlike a DataLoader
    over a TensorDataset. A thread gathers the next batch (index_select releases the GIL).
    Order: a seeded permutation per epoch, as on the resident path. Under DDP the shards wing
    uses the DataLoader this class still carries (`loader`), so every rank's share stays exact.
    """

    path_name = "host slices"

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, device: torch.device, shuffle: bool, seed: int) -> None:
        from torch.utils.data import TensorDataset

        super().__init__(TensorDataset(x, y), batch_size, device, shuffle, seed, num_workers=0)
        self.x, self.y = x, y
        self.n = len(y)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.pin = device.type == "cuda"
        self._gen = torch.Generator().manual_seed(seed)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._gen.manual_seed(epoch_seed(self.seed, epoch))

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def _gather(self, idx: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(idx, slice):
            xb, yb = self.x[idx], self.y[idx]
        else:
            xb, yb = self.x.index_select(0, idx), self.y.index_select(0, idx)
        if self.pin:
            xb, yb = xb.pin_memory(), yb.pin_memory()
        return xb, yb

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from concurrent.futures import ThreadPoolExecutor

        bs = self.batch_size
        if self.shuffle:
            perm = torch.randperm(self.n, generator=self._gen)
            parts: list = [perm[i : i + bs].sort().values for i in range(0, self.n, bs)]
        else:
            parts = [slice(i, i + bs) for i in range(0, self.n, bs)]
        with ThreadPoolExecutor(max_workers=1) as pool:
            nxt = pool.submit(self._gather, parts[0]) if parts else None
            for k in range(len(parts)):
                assert nxt is not None
                xb, yb = nxt.result()
                nxt = pool.submit(self._gather, parts[k + 1]) if k + 1 < len(parts) else None
                yield xb.to(self.device, non_blocking=self.pin), yb.to(self.device, non_blocking=self.pin)


Batches = ResidentBatches | LoaderBatches


@dataclass
class BatchPlan:
    train: Batches
    val: Batches
    resident: bool
    reason: str  # why resident or not: recorded on the run
    transform: Transform = None  # applied by the engine to each raw input batch, on the device
    train_transform: Transform = None  # training batches only (the recipe's `augment:`); None: `transform`


def plan_batches(
    train: Dataset,
    val: Dataset,
    *,
    batch_size: int,
    device: torch.device,
    seed: int,
    transform: Transform,
    resident: bool | str,
    train_transform: Transform = None,
    max_bytes: int,
    free_bytes: int | None,
    num_workers: int = 0,
    persistent_workers: bool = True,
    pin_memory: bool | str = "auto",
) -> BatchPlan:
    """Choose resident batching when asked for or when the data fits; say why."""
    sizes = [nbytes(train), nbytes(val)]
    if resident is False:
        use, reason = False, "resident: false in the recipe"
    elif any(s is None for s in sizes):
        use, reason = False, "dataset exposes no raw tensors (not a TensorDataset)"
    else:
        total = sum(s for s in sizes if s is not None)
        room = max_bytes if free_bytes is None else min(max_bytes, free_bytes // 2)
        if resident is True or total <= room:
            use = True
            reason = f"{total / 2**20:.1f} MiB of raw tensors on the device"
        else:
            use, reason = False, f"{total / 2**20:.1f} MiB exceeds the resident limit of {room / 2**20:.1f} MiB"
    if use:
        tr, va = raw_tensors(train), raw_tensors(val)
        assert tr is not None and va is not None
        return BatchPlan(
            ResidentBatches(*tr, batch_size, device, True, seed),
            ResidentBatches(*va, batch_size, device, False, seed),
            True,
            reason,
            transform,
            train_transform,
        )
    tr, va = raw_tensors(train), raw_tensors(val)
    if tr is not None and va is not None and num_workers == 0:  # raw tensors in host memory: sliced, not per sample
        return BatchPlan(
            HostSliceBatches(*tr, batch_size, device, True, seed),
            HostSliceBatches(*va, batch_size, device, False, seed),
            False,
            reason + "; batches gathered from host memory",
            transform,
            train_transform,
        )
    common = dict(num_workers=num_workers, persistent_workers=persistent_workers, pin_memory=pin_memory)
    return BatchPlan(
        LoaderBatches(train, batch_size, device, True, seed, **common),
        LoaderBatches(val, batch_size, device, False, seed, **common),
        False,
        reason,
        transform,
        train_transform,
    )
