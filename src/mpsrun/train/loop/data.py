"""Batching: where the data lives, and the batches the engine takes from there.

Batches are raw (e.g. uint8 images): the engine applies the dataset's transform on the device,
inside the (possibly graphed) step. Three places, one order:
- resident: the raw tensors copied to the device once; each epoch gathers them in a new order in
  a single kernel, so a batch is a free slice and no per-sample Python runs;
- host (`feed/host.py`): data over the device's room stays in host memory (or the cache's memory
  map); batches are gathered on a thread into pinned buffers and copied on a side stream while
  the previous steps run, into the same CUDA graphs' static input (the next epoch's first batches
  while this epoch's last steps and the validation run);
- disk (`feed/stream.py`): a cache over the host memory budget is read in shuffled blocks.
`resident_max_gb: auto` (the default) decides between the first two by what fits beside the model
(`feed/place.py`; on CUDA after a measured step, `BatchPlan.settle`). The shuffle order comes from a
seeded CPU generator, identical on every device and on the resident and host paths, so they see
the same batches.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from mpsrun.train.loop.feed import place
from mpsrun.train.loop.feed.host import HostBatches, MemoryRows, buffer_bytes
from mpsrun.train.loop.feed.order import epoch_seed

__all__ = ["BatchPlan", "HostBatches", "LoaderBatches", "ResidentBatches", "epoch_seed", "plan_batches", "raw_tensors"]

Transform = Optional[Callable[[torch.Tensor], torch.Tensor]]


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

    def head(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first k samples (the graphs are captured on them)."""
        return self.x[:k], self.y[:k]

    def feeder(self) -> "SliceFeed":
        """For the graphs: this epoch's samples, copied into each replay's static input in turn."""
        return SliceFeed(*self.epoch_tensors())


class SliceFeed:
    """Successive slices of an epoch's device tensors, copied into a CUDA graph's static input (k steps of b)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y, self.i = x, y, 0

    def into(self, sx: torch.Tensor, sy: torch.Tensor) -> None:
        n = sx.shape[0] * sx.shape[1]
        sx.copy_(self.x[self.i : self.i + n].view(sx.shape))
        sy.copy_(self.y[self.i : self.i + n].view(sy.shape))
        self.i += n

    def close(self) -> None:
        pass


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


Batches = ResidentBatches | LoaderBatches | HostBatches


@dataclass
class Pending:
    """Data whose place waits for a measured step (`resident_max_gb: auto` on CUDA): its raw tensors and size."""

    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    total: int
    batch_size: int
    seed: int


@dataclass
class BatchPlan:
    train: Batches
    val: Batches
    resident: bool
    reason: str  # why resident or not: recorded on the run
    transform: Transform = None  # applied by the engine to each raw input batch, on the device
    train_transform: Transform = None  # training batches only (the recipe's `augment:`); None: `transform`
    pending: Optional[Pending] = None  # auto on CUDA: host batches until `settle` has measured a step

    @property
    def path(self) -> str:
        """The data path's name (screen, and the `data.path` tag): resident, else the batches' own, else dataloader."""
        return "resident" if self.resident else getattr(self.train, "path_name", "dataloader")

    @property
    def graphable(self) -> bool:
        """Whether CUDA graphs can replay this plan's steps: fixed-shape batches copied into their static input."""
        return all(hasattr(b, "feeder") for b in (self.train, self.val))

    def settle(self, measure: Callable[[torch.Tensor, torch.Tensor], int], graph_steps: int) -> str:
        """Place pending data: `measure(x, y)` runs one training step (undone) and returns its peak bytes.

        The note says where the data went and why; the plan's `resident` and `reason` follow.
        """
        p = self.pending
        assert p is not None
        device = self.train.device
        x, y = p.train[0][: p.batch_size].to(device), p.train[1][: p.batch_size].to(device)
        try:
            peak = measure(x, y)
        except Exception as e:  # the step itself fails: the data stays on the host; the capture or the epoch says why
            self.place_pending(False, f"resident_max_gb auto: the measured step failed ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200] if str(e) else ''}); {place.gib(p.total)} of raw tensors stay on the host")
            return f"data: {self.reason}"
        row = p.train[0][:1].numel() * p.train[0].element_size()
        static = 2 * graph_steps * p.batch_size * row  # train and validation graphs' inputs
        room, how = place.cuda_room(device, peak, static, graph_steps > 0)
        if p.total <= room:
            self.place_pending(True, f"resident_max_gb auto: {place.gib(p.total)} of raw tensors on the device (room {place.gib(room)}: {how})")
        else:
            self.place_pending(False, f"resident_max_gb auto: {place.gib(p.total)} of raw tensors exceed the room of {place.gib(room)} ({how}); "
                               "batches gathered from host memory into pinned buffers, copied on a side stream")
        return f"data: {self.reason}"

    def place_pending(self, on_device: bool, reason: str) -> None:
        """Pending data decided (by `settle`'s measured step, or a data-parallel rank's rule in train/loop/shards.py):
        onto the device as resident batches, or left in the host batches it has already."""
        p = self.pending
        assert p is not None
        self.pending = None
        if on_device:
            device = self.train.device
            self.train = ResidentBatches(*p.train, p.batch_size, device, True, p.seed)
            self.val = ResidentBatches(*p.val, p.batch_size, device, False, p.seed)
            self.resident = True
        self.reason = reason


def _stream(ds: Dataset) -> Optional[dict[str, Any]]:
    """A dataset over the host memory budget (`image_folder`'s MappedRows): how to read it from disk, else None."""
    return getattr(ds, "stream_spec", None)


def _host(ds: Dataset, batch_size: int, device: torch.device, shuffle: bool, seed: int) -> Optional[HostBatches]:
    spec = _stream(ds)
    if spec is not None:
        from mpsrun.train.loop.feed.stream import DiskRows

        shape = tuple(spec["sample_shape"])
        reserve = buffer_bytes(batch_size, shape)  # the batch buffers (uint8) come out of the same budget
        disk = DiskRows(spec["path"], spec["file_rows"], shape, spec["rows"], spec["labels"], spec["budget"], reserve)
        disk.dataset = ds  # data-parallel ranks read their share through a DataLoader over it
        return HostBatches(disk, batch_size, device, shuffle, seed)
    t = raw_tensors(ds)
    return HostBatches(MemoryRows(*t), batch_size, device, shuffle, seed) if t is not None else None


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
    max_bytes: int | str,
    free_bytes: int | None,
    num_workers: int = 0,
    persistent_workers: bool = True,
    pin_memory: bool | str = "auto",
) -> BatchPlan:
    """Choose resident batching when asked for or when the data fits; say why.

    max_bytes: the cap in bytes (a number in the recipe), or "auto": what fits beside the model
    (feed/place.py; on CUDA decided by `BatchPlan.settle` after a measured step).
    """
    if _stream(train) is not None or _stream(val) is not None:  # over host memory: streamed from disk
        tr_b, va_b = _host(train, batch_size, device, True, seed), _host(val, batch_size, device, False, seed)
        if tr_b is not None and va_b is not None:
            spec = _stream(train) or _stream(val)
            assert spec is not None
            reason = f"{spec['why']}; read from disk in shuffled blocks within {place.gib(spec['budget'])} of host memory"
            return BatchPlan(tr_b, va_b, False, reason, transform, train_transform)
    sizes = [nbytes(train), nbytes(val)]
    pending = False
    if resident is False:
        use, reason = False, "resident: false in the recipe"
    elif any(s is None for s in sizes):
        use, reason = False, "dataset exposes no raw tensors (not a TensorDataset)"
    else:
        total = sum(s for s in sizes if s is not None)
        if resident is True:
            use, reason = True, f"{total / 2**20:.1f} MiB of raw tensors on the device"
        elif max_bytes == "auto":
            room, how = place.plan_time_room(device, free_bytes)
            if room is None:
                pending, use, reason = True, False, f"resident_max_gb auto: {place.gib(total)} of raw tensors, placed after a measured step"
            elif total <= room:
                use, reason = True, f"resident_max_gb auto: {place.gib(total)} of raw tensors on the device (room {place.gib(room)}: {how})"
            else:
                use, reason = False, f"resident_max_gb auto: {place.gib(total)} of raw tensors exceed the room of {place.gib(room)} ({how})"
        else:
            cap = int(max_bytes)
            room = cap if free_bytes is None else min(cap, free_bytes // 2)
            if total <= room:
                use, reason = True, f"{total / 2**20:.1f} MiB of raw tensors on the device"
            else:
                use, reason = False, f"{total / 2**20:.1f} MiB exceeds the resident limit of {room / 2**20:.1f} MiB"
    tr, va = raw_tensors(train), raw_tensors(val)
    if use:
        assert tr is not None and va is not None
        return BatchPlan(
            ResidentBatches(*tr, batch_size, device, True, seed),
            ResidentBatches(*va, batch_size, device, False, seed),
            True,
            reason,
            transform,
            train_transform,
        )
    if tr is not None and va is not None and num_workers == 0:  # raw tensors in host memory: gathered per batch, on a thread
        plan = BatchPlan(
            HostBatches(MemoryRows(*tr), batch_size, device, True, seed),
            HostBatches(MemoryRows(*va), batch_size, device, False, seed),
            False,
            reason + ("" if pending else "; batches gathered from host memory"),
            transform,
            train_transform,
        )
        if pending:
            plan.pending = Pending(tr, va, sum(s for s in sizes if s is not None), batch_size, seed)
        return plan
    common = dict(num_workers=num_workers, persistent_workers=persistent_workers, pin_memory=pin_memory)
    return BatchPlan(
        LoaderBatches(train, batch_size, device, True, seed, **common),
        LoaderBatches(val, batch_size, device, False, seed, **common),
        False,
        reason,
        transform,
        train_transform,
    )
