"""Batches of data that stays on the host, fed to the device while the previous steps run.

A producer thread gathers each batch (`rows.take_rows` over the host tensor or the memory map,
which releases the GIL, split over a few threads) into one of a few pinned buffers, and on CUDA
copies it into a device slot on a side stream; the training loop's stream waits on that copy's
event only. A device slot is written again only after the loop's stream has read it (an event the
loop records when it asks for the next batch), so the copies of the next batches overlap the steps
that are running. Under CUDA graphs (`steps.GraphTrainer`) the batches are copied from their slots
into the graphs' static input, as resident batches are: the same graphs, the same fused kernels.
The thread runs on past an epoch's last batch into the next epoch's first ones (as many as there are slots),
so an epoch starts with its batches on the device, not with the device waiting for a graph's worth of them;
and a memory map's pages are mapped at once before the first epoch (`populate`), not faulted in one by one.

The order: a seeded full permutation per epoch, the very draw the resident path makes, so the batches
(and so the results) are the resident path's; or, for a cache streamed from disk (`stream.DiskRows`),
shuffled blocks.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional

import torch

from mpsrun.train.loop.feed.order import epoch_seed
from mpsrun.train.loop.feed.rows import MemoryEpoch, MemoryRows, pinned_alias, populate, take_rows  # noqa: F401 (host.X, as before)

PINNED_SLOTS = 4  # host buffers: the producer runs this many batches ahead of the copies
DEVICE_SLOTS = 4  # device buffers for eager steps; graphs ask for two groups' worth (`ahead`)
GATHER_THREADS_MAX = 8  # threads gathering one batch (`gather_threads_default`)


Source = Any  # MemoryRows or stream.DiskRows: begin(generator, shuffle) -> epoch with fill(out_x, out_y, a, b) and close()


class _Run:
    """One epoch's batches: the source's epoch (its order), the batches' bounds, and the queue of those produced.

    key: the order's name, ("epoch", e) (a seeded full permutation) or ("in order",), so a run produced ahead is taken
    by the epoch it was drawn for only; None: an order nobody can draw again (no `set_epoch` before the epoch).
    """

    def __init__(self, key: Optional[tuple], epoch: Any, bounds: list[tuple[int, int]]) -> None:  # epoch: None until drawn
        self.key, self.epoch, self.bounds = key, epoch, bounds
        self.ready: queue.Queue = queue.Queue()  # (slot, rows) per batch, or the exception that stopped the producer
        self.next = 0  # the first batch not produced yet
        self.closed = False
        self.gen: Optional[torch.Generator] = None  # the generator its order was drawn from
        self.lock = threading.Lock()  # the loop's thread and the producer's may both come to draw it


class _Slots:
    """Which pinned buffers and device slots are free, and the stop of the threads that fill them."""

    def __init__(self, pinned: int, dev: int) -> None:
        self.stop = threading.Event()
        self.free_pin: queue.Queue = queue.Queue()
        self.free_dev: queue.Queue = queue.Queue()
        for i in range(pinned):
            self.free_pin.put(i)
        for i in range(dev):
            self.free_dev.put(i)

    def take(self, q: queue.Queue) -> Optional[int]:
        while not self.stop.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue
        return None


class HostBatches:
    """Batches gathered on the host, on a thread, and handed to the device ahead of the step that needs them.

    The thread does not stop at an epoch's end: once it has gathered an epoch's last batch it goes on with the
    next epoch's first batches (as many as there are device slots, or pinned buffers off CUDA), drawn in the order
    `set_epoch(e + 1)` will ask for, while the last steps, the validation and the epoch's bookkeeping run. Without
    it every epoch began with the device idle until a graph's worth of batches (16 of 256 images of 256 px: 800 MB)
    was gathered. An epoch that asks for another order (no `set_epoch`, another seed) drops what was gathered ahead.
    """

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
        self.gather_threads = gather_threads_default(self.cuda)
        # a disk stream reads each byte once an epoch, counted per epoch: its next epoch is not begun early
        self.read_ahead = isinstance(source, MemoryRows)
        # not yet a default (measured by benchmarks/images_bench.py's host-zero-copy): memory rows pinned once, each
        # batch gathered by the GPU itself from them over PCIe, on the side stream; the thread only enqueues that
        self.zero_copy = False
        self._alias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (pinned rows, their GPU view, labels)
        self.batches_ahead = 0  # batches an epoch found gathered before it began (said by the benchmark, checked by a test)
        self.waited_s = 0.0  # seconds the loop waited for the thread in the last epoch (the benchmark says it)
        self._key: Optional[tuple] = None  # the order the next epoch draws (set_epoch)
        self._slots: Optional[_Slots] = None
        self._worker: Optional[threading.Thread] = None
        self._next_run: Optional[_Run] = None  # the next epoch, gathered ahead
        self._open: list[_Run] = []  # runs begun and not finished (their source epochs closed on a stop)
        self._reading: Optional[object] = None  # the epoch being read (its generator's token)
        self._held: Optional[int] = None  # the slot of the batch the loop holds
        self._whole = False  # the epoch being read has handed out its last batch

    # -------------------------------------------------------------- the engine's interface

    def set_epoch(self, epoch: int) -> None:
        self._gen.manual_seed(epoch_seed(self.seed, epoch))
        self._key = ("epoch", int(epoch))

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def head(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first k samples on the device (the graphs are captured on them)."""
        x, y = self.source.head(k)
        return x.to(self.device), y.to(self.device)

    def buffer_bytes(self) -> int:
        """Host bytes the batch buffers hold (counted in a disk stream's budget)."""
        return buffer_bytes(self.batch_size, self.source.sample_shape, torch.empty((), dtype=self._x_dtype).element_size())

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

    def close(self) -> None:
        """Stop the thread (and what it gathered ahead); the next epoch starts it again."""
        self._retire()
        self._halt()

    # -------------------------------------------------------------- buffers

    def _buffers(self) -> None:
        if self._pinned:
            return
        shape = (self.batch_size, *self.source.sample_shape)
        pin = self.cuda
        self._pinned = [(torch.empty(shape, dtype=self._x_dtype, pin_memory=pin), torch.empty(self.batch_size, dtype=self._y_dtype, pin_memory=pin))
                        for _ in range(min(PINNED_SLOTS, max(2, len(self))))]
        if self.cuda:  # no more slots than an epoch has batches (a small validation set asked for two replays' worth)
            self._dev = [(torch.empty(shape, dtype=self._x_dtype, device=self.device), torch.empty(self.batch_size, dtype=self._y_dtype, device=self.device))
                         for _ in range(min(max(self.ahead, 2), max(2, len(self))))]
            self._side = torch.cuda.Stream(self.device)
            self._copied = [torch.cuda.Event() for _ in self._pinned]  # the H2D copy out of a pinned buffer is done
            self._landed = [torch.cuda.Event() for _ in self._dev]  # a device slot holds its batch
            self._used = [torch.cuda.Event() for _ in self._dev]  # the loop's stream has read a device slot
            if self.zero_copy and isinstance(self.source, MemoryRows):
                pinned, view = pinned_alias(self.source.x, self.device)
                self._alias = (pinned, view, self.source.y.to(self.device))
        self._slots = _Slots(len(self._pinned), len(self._dev))

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

    # -------------------------------------------------------------- the producer

    def _begin(self, run: _Run, gen: Optional[torch.Generator] = None) -> None:
        """Draw the run's order (once): from `gen`, else from the seed its key names (the draw set_epoch(e) seeds)."""
        with run.lock:
            if run.epoch is not None:
                return
            if gen is None:
                key = run.key
                gen = torch.Generator().manual_seed(epoch_seed(self.seed, key[1])) if key is not None and key[0] == "epoch" else self._gen
            run.gen = gen
            run.epoch = self.source.begin(gen, self.shuffle)
            self._open.append(run)

    def _bounds(self) -> list[tuple[int, int]]:
        return [(i, min(i + self.batch_size, self.n)) for i in range(0, self.n, self.batch_size)]

    def _produce(self, run: _Run, upto: int, slots: _Slots, pool: Optional[ThreadPoolExecutor]) -> bool:
        """Batches run.next .. upto-1 into free slots, each put on run.ready; False if stopped."""
        cuda = self.cuda
        while run.next < upto:
            a, b = run.bounds[run.next]
            if self._alias is not None:  # zero-copy: the GPU gathers the batch from the pinned rows, on the side stream
                d = slots.take(slots.free_dev)
                if d is None:
                    return False
                side = self._side
                with torch.cuda.stream(side):
                    rows = run.epoch.rows(a, b).to(self.device)  # before the wait: the copy of 2 KB waits for nothing else
                    side.wait_event(self._used[d])
                    torch.index_select(self._alias[1], 0, rows, out=self._dev[d][0][: b - a])
                    torch.index_select(self._alias[2], 0, rows, out=self._dev[d][1][: b - a])
                    self._landed[d].record(side)
                run.next += 1
                run.ready.put((d, b - a))
                continue
            p = slots.take(slots.free_pin)
            if p is None:
                return False
            if cuda:
                self._copied[p].synchronize()  # its last copy to the device has read it
            self._gather(run.epoch, self._pinned[p], a, b, pool)
            if not cuda:
                run.next += 1
                run.ready.put((p, b - a))
                continue
            d = slots.take(slots.free_dev)
            if d is None:
                return False
            side = self._side
            with torch.cuda.stream(side):
                side.wait_event(self._used[d])  # the step that read this slot last has run
                self._dev[d][0][: b - a].copy_(self._pinned[p][0][: b - a], non_blocking=True)
                self._dev[d][1][: b - a].copy_(self._pinned[p][1][: b - a], non_blocking=True)
                self._copied[p].record(side)
                self._landed[d].record(side)
            slots.free_pin.put(p)
            run.next += 1
            run.ready.put((d, b - a))
        if run.next == len(run.bounds) and not run.closed:
            run.closed = True
            run.epoch.close()
            self._open.remove(run)
        return True

    def _work(self, run: _Run, after: Optional[threading.Thread], slots: _Slots, then: Optional[_Run]) -> None:
        """The thread: the rest of `run` (after the thread that gathered its first batches ahead), then the first
        batches of the next epoch, `then`, as many as there are slots, and ends (nothing waits on a later call)."""
        current = run
        try:
            if after is not None:
                after.join()
            if self.cuda and self.device.index is not None:
                torch.cuda.set_device(self.device)
            pool = ThreadPoolExecutor(self.gather_threads, thread_name_prefix="mpsrun-gather") if self.gather_threads > 1 else None
            try:
                if run.epoch is None:
                    self._begin(run)
                if not self._produce(run, len(run.bounds), slots, pool) or then is None or slots.stop.is_set():
                    return
                current = then
                self._begin(then)
                self._produce(then, min(len(then.bounds), len(self._dev) if self.cuda else len(self._pinned)), slots, pool)
            finally:
                if pool is not None:
                    pool.shutdown(wait=True)
        except BaseException as e:  # said in the loop's thread, where it stops the run
            current.ready.put(e)

    def _halt(self) -> None:
        """Stop the thread, close the epochs it left unfinished, wait for the copies in flight; every slot free again."""
        if self._slots is None:
            return
        self._slots.stop.set()
        if self._worker is not None:
            self._worker.join()
        self._worker, self._next_run = None, None
        for run in self._open:
            run.epoch.close()
        self._open = []
        if self.cuda:  # the next epoch's copies start after every step of this one has read its slot, and every copy
            # begun for it has landed (an epoch left early, e.g. a first batch taken to compile, leaves some in flight)
            self._side.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self._slots = _Slots(len(self._pinned), len(self._dev))

    # -------------------------------------------------------------- one epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._buffers()
        self._retire()
        key = self._key if self.shuffle else ("in order",)
        self._key = None  # the generator's draw is this epoch's (or was drawn ahead, from the same seed)
        run, prev = self._next_run, self._worker
        if run is not None and key is not None and run.key == key:
            self.batches_ahead = run.next
            self._begin(run, self._gen)  # drawn on the thread already, as a rule
            if run.gen is not self._gen:  # the generator left as this epoch's own draw would have left it
                assert run.gen is not None
                self._gen.set_state(run.gen.get_state())
        else:
            self._halt()
            run, prev = _Run(key, None, self._bounds()), None
            self._begin(run, self._gen)  # here: the generator set_epoch seeded (or as the last epoch left it)
            self.batches_ahead = 0
        slots = self._slots
        assert slots is not None
        then = None  # the next epoch, its order drawn and its first batches gathered on the thread once this one's are
        if self.read_ahead and key is not None:
            then = _Run(("epoch", key[1] + 1) if key[0] == "epoch" else key, None, self._bounds())
        self._next_run = then
        self._worker = threading.Thread(target=self._work, args=(run, prev, slots, then), name="mpsrun-host-batches", daemon=True)
        self._worker.start()
        token = object()  # this epoch's reading: a later epoch's start retires it
        self._reading, self._held, self._whole = token, None, False
        self.waited_s = 0.0
        cuda = self.cuda
        try:
            for i in range(len(run.bounds)):
                if self._held is not None:
                    self._free(slots, self._held)
                    self._held = None
                t0 = time.perf_counter()
                item = run.ready.get()
                self.waited_s += time.perf_counter() - t0
                if isinstance(item, BaseException):
                    raise item
                slot, m = item
                self._held, self._whole = slot, i + 1 == len(run.bounds)
                if cuda:
                    torch.cuda.current_stream(self.device).wait_event(self._landed[slot])
                    xb, yb = self._dev[slot]
                    yield xb[:m], yb[:m]
                else:
                    xb, yb = self._pinned[slot]
                    if self.device.type == "cpu":
                        yield xb[:m], yb[:m]
                    else:  # MPS: a plain copy
                        yield xb[:m].to(self.device), yb[:m].to(self.device)
                if self._reading is not token:
                    raise RuntimeError("host batches: an epoch was read on after the next one began")
        finally:
            if self._reading is token:
                self._retire()

    def _retire(self) -> None:
        """The epoch being read ends: every batch handed out (the graphs' feed closes at its last), its last slot is
        free and the thread runs on into the next epoch; left early, or failed, nothing runs on."""
        if self._reading is None:
            return
        self._reading = None
        if self._whole:
            if self._held is not None and self._slots is not None:
                self._free(self._slots, self._held)
        else:
            self._halt()
        self._held, self._whole = None, False

    def _free(self, slots: _Slots, slot: int) -> None:
        """The loop is done with a batch: on CUDA its reads are enqueued, so the slot is free after them; on the CPU they ran."""
        if self.cuda:
            self._used[slot].record(torch.cuda.current_stream(self.device))
            slots.free_dev.put(slot)
        else:
            slots.free_pin.put(slot)


def buffer_bytes(batch_size: int, sample_shape: tuple[int, ...], itemsize: int = 1) -> int:
    """Host bytes of the batch buffers of batches of `batch_size` samples (at most PINNED_SLOTS of them): what a disk
    stream's budget sets aside for them before the batches exist."""
    return PINNED_SLOTS * batch_size * math.prod(sample_shape) * itemsize


def gather_threads_default(cuda: bool = True) -> int:
    """Threads that gather one batch. Feeding a GPU: half the cores this process may use, at most 8 (a batch of 256
    images of 256 px is 50 MB; at 17,500 img/s that is 3.4 GB/s of scattered rows, more than one or two cores of a GPU
    server copy). Feeding the CPU or MPS: a quarter, at most 4, as before (on the CPU the steps want the cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 2
    return max(1, min(GATHER_THREADS_MAX, cores // 2) if cuda else min(4, cores // 4))


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

