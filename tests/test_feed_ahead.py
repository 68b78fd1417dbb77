"""Host batches gathered ahead (issue 44, item 2): the producer runs on into the next epoch's first batches while
the last steps run, the batches stay the resident path's in order, an epoch that asks for another order drops what was
gathered ahead, an epoch left early stops the thread, and a memory map's pages are mapped before the first gather.
A disk stream over a truncated cache file says so when it is opened.

The CUDA tests at the end (the graphs' feed from device slots across epochs; the zero-copy option's batches) skip
without CUDA.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mpsrun.train.loop.data import HostBatches, ResidentBatches
from mpsrun.train.loop.feed.host import Feed, MemoryRows, buffer_bytes, populate
from mpsrun.train.loop.feed.stream import DiskRows

CUDA = torch.cuda.is_available()


def _data(n: int = 203) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(n)


def _epoch(batches) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    return [(xb.clone(), yb.clone()) for xb, yb in batches]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


def _settle(host: HostBatches) -> None:
    """Wait for the thread to finish gathering ahead (it ends once the slots are full), so the count is exact."""
    if host._worker is not None:
        host._worker.join(timeout=10)


def _gathering(before: set) -> list[str]:
    """Feeding threads alive now that were not before (another test's runs in this process may hold their own)."""
    return [t.name for t in set(threading.enumerate()) - before if t.name.startswith(("mpsrun-host-batches", "mpsrun-gather"))]


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_next_epoch_is_gathered_ahead_and_its_batches_are_the_resident_ones(shuffle: bool) -> None:
    before = set(threading.enumerate())
    x, y = _data()
    res = ResidentBatches(x, y, 16, torch.device("cpu"), shuffle, seed=5)
    host = HostBatches(MemoryRows(x, y), 16, torch.device("cpu"), shuffle, seed=5)
    host.gather_threads = 2
    for epoch in range(4):
        res.set_epoch(epoch)
        host.set_epoch(epoch)
        _settle(host)
        got = _epoch(host)
        assert _same(_epoch(res), got), f"epoch {epoch}"
        assert host.batches_ahead == (0 if epoch == 0 else len(host._pinned)), f"epoch {epoch}"
    host.close()
    assert _gathering(before) == []


def test_an_epoch_in_another_order_drops_what_was_gathered_ahead() -> None:
    """A resumed run starts at epoch 5, a caller iterates without set_epoch: the read-ahead (epoch 1's) is not used."""
    x, y = _data()
    res = ResidentBatches(x, y, 16, torch.device("cpu"), True, seed=5)
    host = HostBatches(MemoryRows(x, y), 16, torch.device("cpu"), True, seed=5)
    host.set_epoch(0)
    _epoch(host)
    _settle(host)
    for epoch in (5, 6):
        res.set_epoch(epoch)
        host.set_epoch(epoch)
        _settle(host)
        assert _same(_epoch(res), _epoch(host))
    assert host.batches_ahead > 0  # 6 followed 5: gathered ahead
    res.set_epoch(7)
    host.set_epoch(7)
    want = _epoch(res)
    assert _same(want, _epoch(host))
    again = _epoch(host)  # no set_epoch: the generator goes on, as before (no order to draw ahead)
    assert host.batches_ahead == 0 and len(again) == len(want) and not _same(want, again)
    host.close()


def test_an_epoch_left_early_stops_the_thread_and_the_next_is_whole() -> None:
    before = set(threading.enumerate())
    x, y = _data()
    res = ResidentBatches(x, y, 16, torch.device("cpu"), True, seed=5)
    host = HostBatches(MemoryRows(x, y), 16, torch.device("cpu"), True, seed=5)
    host.gather_threads = 2
    host.set_epoch(0)
    it = iter(host)
    next(it)
    next(it)
    it.close()  # e.g. a first batch taken to compile
    assert _gathering(before) == []  # stopped, nothing gathered ahead
    res.set_epoch(0)
    host.set_epoch(0)
    assert host.batches_ahead == 0 and _same(_epoch(res), _epoch(host))
    host.close()


def test_an_epoch_begun_while_the_last_is_still_open_neither_hangs_nor_mixes_batches() -> None:
    """Iterators left open (not run to the end, not closed): the next epoch takes over; the old one may not read on."""
    before = set(threading.enumerate())
    x, y = _data()
    res = ResidentBatches(x, y, 16, torch.device("cpu"), True, seed=5)
    host = HostBatches(MemoryRows(x, y), 16, torch.device("cpu"), True, seed=5)
    host.set_epoch(0)
    whole = iter(host)
    for _ in range(len(host)):  # every batch taken, the iterator still open (it holds the last slot)
        next(whole)
    ahead = len(host._pinned) - 1  # the slots the thread can fill ahead meanwhile
    for _ in range(1000):
        if host._next_run is not None and host._next_run.next == ahead:
            break
        time.sleep(0.01)
    for epoch, taken in ((1, 3), (2, None)):  # epoch 1 left open after 3 batches
        res.set_epoch(epoch)
        host.set_epoch(epoch)
        if taken is None:
            assert _same(_epoch(res), _epoch(host))
            continue
        it = iter(host)
        got = [(xb.clone(), yb.clone()) for _, (xb, yb) in zip(range(taken), it)]
        assert host.batches_ahead == ahead  # the open epoch 0 had handed out every batch: its read-ahead used
        assert _same(_epoch(res)[:taken], got)
    with pytest.raises(RuntimeError, match="read on after the next one began"):
        next(whole)
    host.close()
    assert _gathering(before) == []


def test_the_graphs_feed_closing_at_the_last_batch_keeps_the_read_ahead() -> None:
    """GraphTrainer takes exactly an epoch's batches through Feed.into, then closes the feed: that is a whole epoch."""
    x, y = _data(192)
    res = ResidentBatches(x, y, 16, torch.device("cpu"), True, seed=5)
    host = HostBatches(MemoryRows(x, y), 16, torch.device("cpu"), True, seed=5)
    for epoch in (0, 1):
        res.set_epoch(epoch)
        host.set_epoch(epoch)
        _settle(host)
        feed, sx, sy = host.feeder(), torch.zeros(4, 16, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.long)
        got = []
        for _ in range(3):  # 12 batches: 3 replays of 4 steps
            feed.into(sx, sy)
            got += [(sx[j].clone(), sy[j].clone()) for j in range(4)]
        feed.close()
        assert _same(_epoch(res), got)
    assert host.batches_ahead == len(host._pinned)
    host.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ is Linux's")
def test_a_memory_map_is_populated_before_the_first_gather(tmp_path: Path) -> None:
    """A fresh map of a file in the page cache: the gather faults every 64 KB without populate, hardly at all after."""
    n, shape = 512, (3, 64, 64)  # 6 MB
    path = tmp_path / "images.u8"
    np.random.default_rng(0).integers(0, 256, size=(n, *shape), dtype=np.uint8).tofile(path)
    out = np.empty((n, *shape), dtype=np.uint8)
    perm = np.random.default_rng(1).permutation(n)
    faults = []
    for pop in (False, True):
        x = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=(n, *shape)))
        if pop and not populate(x):
            pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14+)")
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        np.take(x.numpy(), perm, axis=0, out=out, mode="clip")
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        assert np.array_equal(out, np.fromfile(path, dtype=np.uint8).reshape(n, *shape)[perm])
    if faults[0] < 6 * 2**20 // 2**16 // 2:  # the H200 machine's kernel maps a fresh file map in large blocks: 3 faults for 6 MB
        pytest.skip(f"this kernel faults a fresh map of 6 MB only {faults[0]} times: populate has nothing to remove here")
    assert faults[1] < faults[0] // 4, faults
    # MemoryRows populates once, at its first epoch
    rows = MemoryRows(torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=(n, *shape))), torch.arange(n))
    assert not rows.mapped
    rows.begin(None, False)
    assert rows.mapped


def test_a_truncated_cache_is_said_when_the_stream_opens_it(tmp_path: Path) -> None:
    n, shape = 100, (3, 16, 16)
    path = tmp_path / "images.u8"
    np.zeros((n, *shape), dtype=np.uint8).tofile(path)
    rows, labels = np.arange(0, n, 2), torch.arange(n // 2)
    DiskRows(str(path), n, shape, rows, labels, 2**20, buffer_bytes(8, shape))  # whole: opens
    with open(path, "r+b") as f:
        f.truncate(n * 768 - 1)
    with pytest.raises(OSError, match="truncated"):
        DiskRows(str(path), n, shape, rows, labels, 2**20, buffer_bytes(8, shape))
    with pytest.raises(ValueError, match="run past"):
        DiskRows(str(path), n - 1, shape, rows + 1, labels, 2**20, buffer_bytes(8, shape))


@pytest.mark.skipif(not CUDA, reason="device slots, pinned buffers and the side stream need a CUDA GPU")
def test_the_graphs_feed_on_cuda_reads_ahead_across_epochs_cuda() -> None:
    before = set(threading.enumerate())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 256, (1000, 3, 16, 16), dtype=torch.uint8, generator=g), torch.arange(1000)
    dev = torch.device("cuda")
    res = ResidentBatches(x, y, 50, dev, True, seed=5)
    host = HostBatches(MemoryRows(x, y), 50, dev, True, seed=5)
    host.ahead = 6
    sx, sy = torch.zeros(4, 50, 3, 16, 16, dtype=torch.uint8, device=dev), torch.zeros(4, 50, dtype=torch.long, device=dev)
    for epoch in range(3):
        res.set_epoch(epoch)
        host.set_epoch(epoch)
        _settle(host)
        feed: Feed = host.feeder()
        got = []
        for _ in range(5):  # 20 batches: 5 replays of 4 steps, on the loop's stream
            feed.into(sx, sy)
            sx.add_(0)  # a kernel reading the static input, as a replay does
            got += [(sx[j].clone(), sy[j].clone()) for j in range(4)]
        feed.close()
        assert _same(_epoch(res), got), f"epoch {epoch}"
        assert host.batches_ahead == (0 if epoch == 0 else 6), f"epoch {epoch}"
    host.close()
    assert _gathering(before) == []


@pytest.mark.skipif(not CUDA, reason="pinned memory the GPU reads itself needs a CUDA GPU")
def test_zero_copy_batches_are_the_resident_batches_cuda() -> None:
    """The option the benchmark measures: the rows pinned once, each batch an index_select on the GPU over PCIe."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 256, (1000, 3, 16, 16), dtype=torch.uint8, generator=g), torch.arange(1000)
    dev = torch.device("cuda")
    res = ResidentBatches(x, y, 64, dev, True, seed=5)
    host = HostBatches(MemoryRows(x, y), 64, dev, True, seed=5)
    host.zero_copy = True
    for epoch in range(2):
        res.set_epoch(epoch)
        host.set_epoch(epoch)
        _settle(host)
        got = _epoch(host)
        assert host._alias is not None and _same(_epoch(res), got), f"epoch {epoch}"
    assert host.batches_ahead > 0
    host.close()
