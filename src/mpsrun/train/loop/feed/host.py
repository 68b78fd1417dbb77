"""Batches of data that stays on the host, fed to the device while the previous steps run.

A producer thread gathers each batch (one `index_select` over the host tensor or the memory map,
which releases the GIL, split over a few threads) into one of a few pinned buffers, and on CUDA
copies it into a device slot on a side stream; the training loop's stream waits on that copy's
event only. A device slot is written again only after the loop's stream has read it (an event the
loop records when it asks for the next batch), so the copies of the next batches overlap the steps
that are running. Under CUDA graphs (`steps.GraphTrainer`) the batches are copied from their slots
into the graphs' static input, as resident batches are: the same graphs, the same fused kernels.

The order: a seeded full permutation per epoch, the very draw the resident path makes, so the batches
(and so the results) are the resident path's; or, for a cache streamed from disk (`stream.DiskRows`),
shuffled blocks.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional

import numpy as np
import torch

from mpsrun.train.loop.feed.order import epoch_seed

PINNED_SLOTS = 4  # host buffers: the producer runs this many batches ahead of the copies
DEVICE_SLOTS = 4  # device buffers for eager steps; graphs ask for two groups' worth (`ahead`)


class MemoryRows:
    """Rows of a host tensor (in RAM or a memory map), gathered in the resident path's order."""

    path_name = "host slices"

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.n = len(y)
        self.sample_shape = tuple(x.shape[1:])
        self.bytes = x.numel() * x.element_size() + y.numel() * y.element_size()

    def begin(self, generator: Optional[torch.Generator], shuffle: bool) -> "MemoryEpoch":
        return MemoryEpoch(self, torch.randperm(self.n, generator=generator) if shuffle else None)

    def head(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[:k], self.y[:k]


class MemoryEpoch:
    def __init__(self, src: MemoryRows, perm: Optional[torch.Tensor]) -> None:
        self.src, self.perm = src, perm

    def fill(self, out_x: torch.Tensor, out_y: torch.Tensor, a: int, b: int) -> None:
        if self.perm is None:
            out_x[: b - a].copy_(self.src.x[a:b])
            out_y[: b - a].copy_(self.src.y[a:b])
            return
        idx = self.perm[a:b]
        take_rows(self.src.x, idx, out_x[: b - a])
        take_rows(self.src.y, idx, out_y[: b - a])

    def close(self) -> None:
        pass


def take_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = src[idx] along the first dimension, on the calling thread only.

    Why numpy's `take` and not `torch.index_select`: torch splits the copy over its intra-op (OpenMP) threads, and
    called from a feeding thread that makes a team of its own per calling thread beside the training's: on the
    2-core machine under load, 128 rows of 196 KB went from 9,400 rows/s (one torch thread) to 340 (two). numpy
    copies row by row (a memmove of each row) with the GIL released; `HostBatches` splits a batch over its own pool.
    """
    if src.dtype in _NOT_NUMPY:  # bfloat16 and the like: torch's own copy
        torch.index_select(src, 0, idx, out=out)
        return
    np.take(src.numpy(), idx.numpy(), axis=0, out=out.numpy(), mode="clip")  # "raise" would copy through a buffer of out's size


_NOT_NUMPY = {torch.bfloat16, getattr(torch, "float8_e4m3fn", torch.bfloat16), getattr(torch, "float8_e5m2", torch.bfloat16)}


Source = Any  # MemoryRows or stream.DiskRows: begin(generator, shuffle) -> epoch with fill(out_x, out_y, a, b) and close()


class HostBatches:
    """Batches gathered on the host, on a thread, and handed to the device ahead of the step that needs them."""

    def __init__(self, source: Source, batch_size: int, device: torch.device, shuffle: bool, seed: int) -> None:
        self.source = source
        self.n = source.n
        self.samples = self.n
        self.batch_size = batch_size
        self.device = device
        self.shuffle = shuffle
        self.seed = seed
        self.path_name = source.path_name
        self.cuda = device.type == "cuda"
        self.ahead = DEVICE_SLOTS  # device slots; GraphTrainer raises it to two replays' worth of batches
        self._gen = torch.Generator().manual_seed(seed)
        x1, y1 = source.head(1)  # one read (a disk stream opens its file for it): the buffers' dtypes
        self._x_dtype, self._y_dtype = x1.dtype, y1.dtype
        self._pinned: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._dev: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._loader: Any = None
        self.gather_threads = max(1, min(4, (os.cpu_count() or 2) // 4))

    # -------------------------------------------------------------- the engine's interface

    def set_epoch(self, epoch: int) -> None:
        self._gen.manual_seed(epoch_seed(self.seed, epoch))

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def head(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first k samples on the device (the graphs are captured on them)."""
        x, y = self.source.head(k)
        return x.to(self.device), y.to(self.device)

    def buffer_bytes(self) -> int:
        """Host bytes the batch buffers hold (counted in a disk stream's budget)."""
        row = math.prod(self.source.sample_shape) * torch.empty((), dtype=self._x_dtype).element_size()
        return PINNED_SLOTS * self.batch_size * row

    @property
    def loader(self) -> Any:
        """A DataLoader over the same rows: data-parallel ranks take their share through it (train/loop/shards.py)."""
        if self._loader is None:
            from torch.utils.data import DataLoader, TensorDataset

            src = self.source
            ds = TensorDataset(src.x, src.y) if isinstance(src, MemoryRows) else src.dataset
            self._loader = DataLoader(ds, batch_size=self.batch_size, shuffle=self.shuffle, generator=torch.Generator().manual_seed(self.seed),
                                      pin_memory=self.cuda)
        return self._loader

    def feeder(self) -> "Feed":
        """For the graphs: copies the next batches into a replay's static input."""
        return Feed(iter(self))

    # -------------------------------------------------------------- buffers

    def _buffers(self) -> None:
        if self._pinned:
            return
        shape = (self.batch_size, *self.source.sample_shape)
        pin = self.cuda
        self._pinned = [(torch.empty(shape, dtype=self._x_dtype, pin_memory=pin), torch.empty(self.batch_size, dtype=self._y_dtype, pin_memory=pin))
                        for _ in range(PINNED_SLOTS)]
        if self.cuda:
            self._dev = [(torch.empty(shape, dtype=self._x_dtype, device=self.device), torch.empty(self.batch_size, dtype=self._y_dtype, device=self.device))
                         for _ in range(max(self.ahead, 2))]

    def _gather(self, epoch: Any, out: tuple[torch.Tensor, torch.Tensor], a: int, b: int, pool: Optional[ThreadPoolExecutor]) -> None:
        """Rows [a, b) of the epoch into `out`, split over the pool's threads where the source allows (memory rows)."""
        if pool is not None and not isinstance(epoch, MemoryEpoch):  # a disk window: it splits its own copy
            epoch.fill(out[0], out[1], a, b, pool, self.gather_threads)
            return
        if pool is None or b - a < 4 * self.gather_threads:
            epoch.fill(out[0], out[1], a, b)
            return
        cuts = [a + (b - a) * i // self.gather_threads for i in range(self.gather_threads + 1)]
        jobs = [pool.submit(epoch.fill, out[0][s - a : e - a], out[1][s - a : e - a], s, e) for s, e in zip(cuts, cuts[1:])]
        for j in jobs:
            j.result()

    # -------------------------------------------------------------- one epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._buffers()
        epoch = self.source.begin(self._gen, self.shuffle)
        bounds = [(i, min(i + self.batch_size, self.n)) for i in range(0, self.n, self.batch_size)]
        stop = threading.Event()
        ready: queue.Queue = queue.Queue()
        free_pin: queue.Queue = queue.Queue()
        free_dev: queue.Queue = queue.Queue()
        for i in range(len(self._pinned)):
            free_pin.put(i)
        for i in range(len(self._dev)):
            free_dev.put(i)
        cuda = self.cuda
        if cuda:
            side = torch.cuda.Stream(self.device)
            copied = [torch.cuda.Event() for _ in self._pinned]  # the H2D copy out of a pinned buffer is done
            landed = [torch.cuda.Event() for _ in self._dev]  # a device slot holds its batch
            used = [torch.cuda.Event() for _ in self._dev]  # the loop's stream has read a device slot
        pool = ThreadPoolExecutor(self.gather_threads, thread_name_prefix="mpsrun-gather") if self.gather_threads > 1 else None

        def take(q: queue.Queue) -> Optional[int]:
            while not stop.is_set():
                try:
                    return q.get(timeout=0.1)
                except queue.Empty:
                    continue
            return None

        def produce() -> None:
            try:
                if cuda and self.device.index is not None:
                    torch.cuda.set_device(self.device)
                for a, b in bounds:
                    p = take(free_pin)
                    if p is None:
                        return
                    if cuda:
                        copied[p].synchronize()  # its last copy to the device has read it
                    self._gather(epoch, self._pinned[p], a, b, pool)
                    if not cuda:
                        ready.put((p, b - a))
                        continue
                    d = take(free_dev)
                    if d is None:
                        return
                    with torch.cuda.stream(side):
                        side.wait_event(used[d])  # the step that read this slot last has run
                        self._dev[d][0][: b - a].copy_(self._pinned[p][0][: b - a], non_blocking=True)
                        self._dev[d][1][: b - a].copy_(self._pinned[p][1][: b - a], non_blocking=True)
                        copied[p].record(side)
                        landed[d].record(side)
                    free_pin.put(p)
                    ready.put((d, b - a))
            except BaseException as e:  # said in the loop's thread, where it stops the run
                ready.put(e)

        worker = threading.Thread(target=produce, name="mpsrun-host-batches", daemon=True)
        worker.start()
        last: Optional[int] = None
        try:
            for _ in bounds:
                if last is not None and cuda:  # the loop has enqueued its reads of the previous batch: its slot is free after them
                    used[last].record(torch.cuda.current_stream(self.device))
                    free_dev.put(last)
                elif last is not None:  # on the CPU they have run
                    free_pin.put(last)
                last = None
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                slot, m = item
                if cuda:
                    torch.cuda.current_stream(self.device).wait_event(landed[slot])
                    xb, yb = self._dev[slot]
                    last = slot
                    yield xb[:m], yb[:m]
                else:
                    xb, yb = self._pinned[slot]
                    last = slot
                    if self.device.type == "cpu":
                        yield xb[:m], yb[:m]
                    else:  # MPS: a plain copy
                        yield xb[:m].to(self.device), yb[:m].to(self.device)
            if last is not None and cuda:
                used[last].record(torch.cuda.current_stream(self.device))
        finally:
            stop.set()
            worker.join()
            if pool is not None:
                pool.shutdown(wait=True)
            epoch.close()
            if cuda:  # the next epoch's copies start after every step of this one has read its slot, and every copy
                # begun for it has landed (an epoch left early, e.g. a first batch taken to compile, leaves some in flight)
                side.synchronize()
                torch.cuda.current_stream(self.device).synchronize()


class Feed:
    """The next batches, copied into a CUDA graph's static input (k steps of b samples) one batch at a time."""

    def __init__(self, it: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.it = it

    def into(self, sx: torch.Tensor, sy: torch.Tensor) -> None:
        for j in range(sx.shape[0]):
            xb, yb = next(self.it)
            sx[j].copy_(xb)
            sy[j].copy_(yb)

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if close is not None:
            close()

