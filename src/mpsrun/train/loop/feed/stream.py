"""A split of a uint8 cache larger than host memory, read from disk in shuffled blocks within a budget.

Why not the memory map: gathering random rows from a map larger than memory makes the kernel read
the disk in page-sized pieces at random, and every page read stays mapped (resident) until the
kernel drops it. Here each epoch reads every block of consecutive rows once, front to back, with
plain `readinto` into two window buffers allocated once (the window served and the next one, read
ahead on a thread), so the process's resident memory for the data is the budget and no more, and
the disk sees large sequential reads. The order is `order.block_order`: blocks permuted, rows
shuffled within a window of blocks (the budget sets how many blocks a window holds).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from mpsrun.train.loop.feed.rows import take_rows
from mpsrun.train.loop.feed.order import BlockOrder, block_order

BLOCK_MAX_BYTES = 32 * 2**20  # a block of consecutive rows is one read (or a few, where held-out rows break it)


class DiskRows:
    """`rows` (sorted, into a file of `file_rows` samples of `sample_shape` uint8) with their `labels`.

    budget: bytes the window buffers may hold (the caller's batch buffers come out of `reserve`).
    """

    path_name = "disk stream"

    def __init__(self, path: str, file_rows: int, sample_shape: tuple[int, ...], rows: np.ndarray, labels: torch.Tensor,
                 budget: int, reserve: int = 0) -> None:
        self.path = str(path)
        self.file_rows = int(file_rows)
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.row_bytes = int(np.prod(self.sample_shape))
        self.rows = np.asarray(rows, dtype=np.int64)
        self.labels = labels
        self.n = len(self.rows)
        size = os.path.getsize(self.path)
        if size < self.file_rows * self.row_bytes:  # said here, before an epoch's read runs short in the middle
            raise OSError(f"{self.path}: {size:,} bytes, short of {self.file_rows:,} samples of {self.row_bytes:,} bytes "
                          "(the cache file is truncated: delete its folder to decode the images again)")
        if self.n and (self.rows.min() < 0 or self.rows.max() >= self.file_rows):
            raise ValueError(f"{self.path}: the split's rows run past the cache's {self.file_rows:,} samples")
        self.budget = int(budget)
        avail = self.budget - int(reserve)
        if avail < 2 * self.row_bytes:
            raise ValueError(
                f"the host memory budget ({self.budget / 2**20:.1f} MiB) leaves {max(avail, 0) / 2**20:.1f} MiB beside the batch "
                f"buffers ({reserve / 2**20:.1f} MiB): too little to stream samples of {self.row_bytes / 2**10:.0f} KiB; raise "
                f"dataset.host_max_gb (or MPSRUN_HOST_MAX_GB) or lower batch_size"
            )
        # two windows (served, read ahead) of at least 4 blocks each where the budget allows: mixing needs several blocks
        self.block_rows = max(1, min(BLOCK_MAX_BYTES, avail // 8) // self.row_bytes)
        self.window_blocks = max(1, avail // (2 * self.block_rows * self.row_bytes))
        self.window_rows = self.window_blocks * self.block_rows
        self._bufs = [np.empty((min(self.window_rows, max(self.n, 1)), *self.sample_shape), dtype=np.uint8) for _ in range(2)]
        self.bytes_read = 0  # every read counted: a test checks each byte is read once an epoch
        self.peak_buffer_bytes = sum(b.nbytes for b in self._bufs)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reading

    def _runs(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """(file row, count, position in the block) of each run of consecutive file rows among rows[a:b]."""
        r = self.rows[a:b]
        if len(r) == 0:
            return []
        breaks = np.flatnonzero(np.diff(r) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(r)]))
        return [(int(r[s]), int(e - s), int(s)) for s, e in zip(starts, ends)]

    def _load(self, order: BlockOrder, w: int, buf: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """Read window `w`'s blocks into `buf`; returns the buffer and the split rows it holds, in buffer order."""
        flat = buf.reshape(buf.shape[0], -1)
        pos = 0
        held = []
        with open(self.path, "rb", buffering=0) as f:
            for blk in order.windows[w]:
                a, b = order.block_range(blk)
                for file_row, count, _ in self._runs(a, b):
                    view = memoryview(flat[pos : pos + count]).cast("B")
                    f.seek(file_row * self.row_bytes)
                    got = 0
                    while got < len(view):
                        k = f.readinto(view[got:])
                        if not k:
                            raise OSError(f"{self.path}: short read at row {file_row} (the cache file is truncated)")
                        got += k
                    with self._lock:
                        self.bytes_read += got
                    pos += count
                held.append(torch.arange(a, b))
        return buf, (torch.cat(held) if held else torch.zeros(0, dtype=torch.long))

    # ------------------------------------------------------------------ one epoch

    def begin(self, generator: Optional[torch.Generator], shuffle: bool) -> "DiskEpoch":
        return DiskEpoch(self, block_order(self.n, self.block_rows, self.window_blocks, generator, shuffle))

    def head(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first k samples (the graphs' capture runs on them): read directly, outside the budget's buffers."""
        k = min(k, self.n)
        out = np.empty((k, *self.sample_shape), dtype=np.uint8)
        flat = out.reshape(k, -1)
        with open(self.path, "rb", buffering=0) as f:
            for file_row, count, at in self._runs(0, k):
                f.seek(file_row * self.row_bytes)
                f.readinto(memoryview(flat[at : at + count]).cast("B"))
        return torch.from_numpy(out), self.labels[:k]


class DiskEpoch:
    """Serves one epoch's samples in order, position by position; the next window is read on a thread meanwhile."""

    def __init__(self, src: DiskRows, order: BlockOrder) -> None:
        self.src, self.order = src, order
        self.ends = np.cumsum([len(l) for l in order.local]).tolist()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpsrun-disk")
        self.w = -1
        self.cur: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the served window (pixels, split rows)
        self.ahead: Optional[Future] = None
        if order.windows:
            self.ahead = self.pool.submit(src._load, order, 0, src._bufs[0])

    def _next_window(self) -> None:
        assert self.ahead is not None
        buf, held = self.ahead.result()
        self.w += 1
        self.cur = (torch.from_numpy(buf), held)
        nxt = self.w + 1
        self.ahead = self.pool.submit(self.src._load, self.order, nxt, self.src._bufs[nxt % 2]) if nxt < len(self.order.windows) else None

    def fill(self, out_x: torch.Tensor, out_y: torch.Tensor, a: int, b: int, pool: Optional[ThreadPoolExecutor] = None, parts: int = 1) -> None:
        """Samples at positions [a, b) of the epoch into out_x[: b - a], out_y[: b - a]; called with increasing positions.

        pool, parts: the copy out of the window split over `parts` threads (a GPU eats a batch of 256 images of
        256 px, 50 MB, every 17 ms at 15,000 img/s: more than one thread copies in that time on some hosts)."""
        o = 0
        while a < b:
            while self.w < 0 or a >= self.ends[self.w]:
                self._next_window()
            start = self.ends[self.w - 1] if self.w else 0
            take = min(b, self.ends[self.w]) - a
            idx = self.order.local[self.w][a - start : a - start + take]
            assert self.cur is not None
            pix, held = self.cur
            take_rows(self.src.labels, held[idx], out_y[o : o + take])
            if pool is None or parts < 2 or take < 4 * parts:
                take_rows(pix, idx, out_x[o : o + take])
            else:
                cuts = [take * i // parts for i in range(parts + 1)]
                jobs = [pool.submit(take_rows, pix, idx[s:e], out_x[o + s : o + e]) for s, e in zip(cuts, cuts[1:])]
                for j in jobs:
                    j.result()
            a += take
            o += take

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.cancel()
        self.pool.shutdown(wait=True)
