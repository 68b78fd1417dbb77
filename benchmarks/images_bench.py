"""Your own images, side by side: torchvision ImageFolder + DataLoader against mpsrun's decode-once cache.

One command, on this machine, one after another, on the same synthetic JPEG folder it writes
itself (N images of --size px in --classes classes, PIL):
  (a) torchvision `ImageFolder` + `DataLoader` (RandomResizedCrop(--crop) + RandomHorizontalFlip,
      ToTensor, Normalize; shuffled, pinned on CUDA, persistent workers), one run per
      --workers value: what every user writes;
  (b) mpsrun: the `image_folder` plugin's cache build (decode img/s, a fresh cache), then the
      engine that `mpsrun run` uses (the same `train()`, resident data, CUDA graphs on CUDA)
      with the recipe augmentation random_resized_crop + random_horizontal_flip on the device;
  (c) on CUDA: the same model and engine on resident random uint8 tensors at --crop (no decode,
      no augmentation): the ceiling.
Same model, optimizer (SGD, momentum 0.9), precision and memory format everywhere. Figures are
steady training images per second: the median over epochs after the first (warm-up, workers
starting, graph capture), with the device synchronised around each epoch. Validation is not timed.

    python benchmarks/images_bench.py --device cpu                     # 2-core dev machine
    python benchmarks/images_bench.py --device cuda --model resnet18 --bf16 --channels-last \
        --batch 256 --size 256 --crop 224 --n 10000 --workers 8 15     # H100 (about 2-3 minutes)

    python benchmarks/images_bench.py --device cpu --size 256 --n 3000 --build-only   # the decode figure alone

The host path (issue 44: data over the device's room, gathered on a thread) against resident, the producer alone
(`feed`: img/s per number of gather threads, without and with the copies to the GPU, and the GPU gathering from
pinned memory itself), that option end to end (`host-zero-copy`), the host path as it was (`host-before`), and
listing + cache key of 100,000 files, on the GPU machine in one call of under 240 s:

    export PYTHONPATH=$PWD/src; (timeout 45 python -m pytest -q -p no:cacheprovider tests/test_feed_ahead.py \
        tests/test_images_scale.py -k "cuda and not auto_places" > $OUT/tests.log 2>&1; echo "tests rc $?" >> $OUT/tests.log); \
    timeout 190 python benchmarks/images_bench.py --device cuda --model resnet18 --bf16 --channels-last --batch 256 \
        --size 256 --crop 224 --n 20000 --epochs 4 --paths resident,host,host-reused,feed,host-zero-copy,host-before \
        --skip loader,pil,ceiling --feed-epochs 2 --listing 100000 > $OUT/images_bench.log 2>&1; \
    echo "bench rc $?" >> $OUT/images_bench.log; tail -4 $OUT/tests.log; grep -v '^decoding' $OUT/images_bench.log | tail -40

The cache build's line gives the whole build's img/s (what the user waits for) and its phases (scan,
key, workers_start, gpu_init, decode, pil_retry, stats); PIL decoding alone in as many processes,
nothing stored, follows it. Appends the result (machine, command, figures) to docs/benchmarks.md with --record.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def _write_one(args: tuple) -> None:
    path, kind, size, seed = args
    from PIL import Image

    from mpsrun.testing.images import draw

    Image.fromarray(draw(kind, size, np.random.default_rng(seed))).save(path, quality=90)


def write_folder(root: Path, n: int, classes: int, size: int, val: int) -> None:
    """train/<class>/*.jpg (n images) and val/<class>/*.jpg (val images), written in parallel."""
    jobs = []
    for split, count in (("train", n), ("val", val)):
        for c in range(classes):
            (root / split / f"c{c:02d}").mkdir(parents=True, exist_ok=True)
        jobs += [(str(root / split / f"c{i % classes:02d}" / f"{i:06d}.jpg"), i % classes, size, i + (0 if split == "train" else 10**7)) for i in range(count)]
    with get_context("fork" if sys.platform != "darwin" else "spawn").Pool(os.cpu_count()) as pool:
        pool.map(_write_one, jobs, chunksize=64)


def _decode_only(args: tuple) -> int:
    from mpsrun.plugins.builtin.images import decode

    paths, size = args
    for p in paths:
        decode._decoded(p, size, size, False)
    return len(paths)


def pil_decode_only(root: Path, size: int, workers: int) -> float:
    """img/s of PIL decoding (and resizing) alone in `workers` forked processes, nothing stored: set beside the build's
    decode phase, it says whether decoding or writing into the memory map bounds the CPU side."""
    paths = sorted(str(p) for p in root.rglob("*.jpg"))
    chunks = [(paths[i : i + 32], size) for i in range(0, len(paths), 32)]
    with get_context("fork" if sys.platform != "darwin" else "spawn").Pool(workers) as pool:
        pool.map(_decode_only, chunks[:workers])  # started and warm before timing
        t0 = time.perf_counter()
        n = sum(pool.imap_unordered(_decode_only, chunks))
        return n / (time.perf_counter() - t0)


def store_ab(root: Path, a: argparse.Namespace, tmp: Path, say: Callable[[str], None]) -> None:
    """Whole cache builds of one folder, the stores alternating round by round (each build a fresh cache folder)."""
    from mpsrun.plugins.builtin.images.datasets import image_folder

    got: dict[str, list[float]] = {s: [] for s in a.stores.split(",")}
    for r in range(a.repeats):
        for store in got:
            os.environ["MPSRUN_CACHE"] = str(tmp / f"cache-{store}-{r}")
            os.environ["MPSRUN_DECODE_STORE"] = store
            os.sync()  # the last build's 2 GB of dirty pages written back first: each build starts as a user's first does
            t0 = time.perf_counter()
            splits = image_folder(str(root), size=a.size, workers=a.decode_workers)
            n = len(splits.train) + len(splits.val)
            got[store].append(n / (time.perf_counter() - t0))
            say(f"round {r + 1}, store {store}: {got[store][-1]:,.0f} img/s whole build ({splits.info['tags'].get('mpsrun.data.decode_phases', '')})")
            del splits
    os.environ.pop("MPSRUN_DECODE_STORE", None)
    for store, v in got.items():
        say(f"store {store}: median {statistics.median(v):,.0f} img/s whole build ({', '.join(f'{x:,.0f}' for x in v)})")
    say(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")


def build_model(name: str, classes: int, crop: int) -> nn.Module:
    if name == "small_cnn":  # two strided 3x3 convolutions, global pooling, a linear head
        return nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=classes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def dataloader_run(root: Path, a: argparse.Namespace, device: torch.device, workers: int) -> float:
    """(a) The hand-written loop: steady training img/s."""
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    tf = T.Compose([T.RandomResizedCrop(a.crop), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize([0.5] * 3, [0.25] * 3)])
    ds = ImageFolder(str(root / "train"), transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=workers, pin_memory=device.type == "cuda",
                                     persistent_workers=workers > 0, drop_last=False)
    torch.manual_seed(0)
    model = build_model(a.model, a.classes, a.crop).to(device)
    if a.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if a.bf16 else contextlib.nullcontext()
    rates = []
    for _ in range(a.epochs):
        _sync(device)
        t0 = time.perf_counter()
        seen = 0
        for x, y in dl:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if a.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with amp:
                loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seen += len(y)
        _sync(device)
        rates.append(seen / (time.perf_counter() - t0))
    del dl
    return statistics.median(rates[1:] or rates)


def engine_run(train_ds, val_ds, transform, train_transform, a: argparse.Namespace, device: torch.device, input_shape,  # type: ignore[no-untyped-def]
               resident: bool | str = True, feed: dict | None = None) -> tuple[float, list[str], str]:
    """(b) and (c): mpsrun's engine (the loop `mpsrun run` drives); steady training img/s, the notes, where the data was.

    resident: True (copied onto the device), False (left on the host: batches gathered on a thread into pinned
    buffers, copied on a side stream, the same CUDA graphs), "auto" (a split over the host budget streams from disk).
    feed: attributes set on host batches (gather_threads, read_ahead), e.g. the host path as it was before (OLD_FEED).
    The fused batch-norm and max-pool kernels are on where `mpsrun run` turns them on (CUDA graphs, channels_last).
    """
    from mpsrun.train.loop.data import plan_batches
    from mpsrun.train.loop.engine import Listener, Options, train

    torch.manual_seed(0)
    model = build_model(a.model, a.classes, a.crop).to(device)
    if a.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    plan = plan_batches(train_ds, val_ds, batch_size=a.batch, device=device, seed=0, transform=transform, train_transform=train_transform,
                        resident=resident, max_bytes=64 * 2**30, free_bytes=None)
    for b in (plan.train, plan.val):
        for k, v in (feed or {}).items():
            if hasattr(b, k):
                setattr(b, k, v)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    graphs = device.type == "cuda" and plan.graphable
    options = Options(precision="bf16" if a.bf16 else "fp32", channels_last=a.channels_last, graphs=graphs, cudnn_benchmark=device.type == "cuda")
    if graphs and a.channels_last:  # as `mpsrun run` does (train/assemble.py): the kernels run inside the replays
        from mpsrun.train.kernels import fused_norm, fused_pool

        options.fused_norm = bool(fused_norm.candidates(model))
        options.fused_pool = bool(fused_pool.candidates(model))
    result = train(model, opt, plan, device, a.epochs, options, Listener())
    rates = [e.train_samples_per_s for e in result.epochs]
    last_s = result.epochs[-1].train_time_s if result.epochs else 0.0
    where = "resident" if plan.resident else getattr(plan.train, "path_name", "dataloader")
    fused = [k for k in ("fused_norm", "fused_pool") if getattr(options, k)]
    if hasattr(plan.train, "gather_threads"):
        where += ", zero-copy (the GPU gathers from the pinned cache)" if getattr(plan.train, "_alias", None) is not None else ""
        where += (f", {plan.train.gather_threads} gather thread(s), read ahead {'on' if plan.train.read_ahead else 'off'}: "
                  f"{plan.train.batches_ahead} batches gathered before the last epoch began, the loop waited "
                  f"{plan.train.waited_s:.2f} s for batches of its {last_s:.2f} s")
        plan.train.close()
        plan.val.close()
    where += f", graphs {'on' if options.graphs else 'off'}" + (f", {' + '.join(fused)}" if fused else "")
    return statistics.median(rates[1:] or rates), options.notes, where + f"; epochs {' / '.join(f'{r:,.0f}' for r in rates)} img/s"


def listing_run(n: int, tmp: Path, say: Callable[[str], None]) -> None:
    """Listing and the cache key of `n` files (empty files named .jpg: neither opens an image), in 10 class folders."""
    from mpsrun.plugins.builtin.images import cache, scan

    root = tmp / "listing"
    for c in range(10):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(c, n, 10):
            open(root / f"c{c}" / f"{i:07d}.jpg", "wb").close()
    os.sync()
    t0 = time.perf_counter()
    listing = scan.scan_folder(root)
    t1 = time.perf_counter()
    cache.key(listing.all_files(), 224, 224, "rgb", listing.stats)
    t2 = time.perf_counter()
    say(f"listing + cache key of {n:,} files: {t2 - t0:.2f} s (listing, one stat per file: {t1 - t0:.2f} s; key: {t2 - t1:.2f} s)")


def feed_run(cache_file: Path, shape: tuple, a: argparse.Namespace, device: torch.device, say: Callable[[str], None]) -> None:
    """The host path's producer alone, no training step: img/s and GB/s of batches gathered in a shuffled order from
    a fresh memory map of the whole cache (page cache warm: just built or read) into the batch buffers, per number of
    gather threads; the first epoch maps the pages (populated at once where Linux can), the later ones are the steady figure. On CUDA also the
    batches copied into the device slots on the side stream (pinned buffers), as the host path feeds the graphs."""
    from mpsrun.train.loop.feed.host import HostBatches, MemoryRows, gather_threads_default

    n = shape[0]
    row = int(np.prod(shape[1:]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    default = gather_threads_default()
    counts = sorted({t for t in (1, 2, 4, 8, 16, default) if t <= cores} | {default})
    epochs = max(2, a.feed_epochs)

    def measure(dev: torch.device, threads: int) -> tuple[float, float, int]:
        x = torch.from_numpy(np.memmap(cache_file, dtype=np.uint8, mode="c", shape=shape))  # a fresh map: no page mapped yet
        hb = HostBatches(MemoryRows(x, torch.zeros(n, dtype=torch.long)), a.batch, dev, True, 0)
        hb.gather_threads = threads
        hb.ahead = 34  # the device slots the graphs ask for (steps.GraphTrainer.capture)
        rates = []
        for e in range(epochs):
            hb.set_epoch(e)
            _sync(dev)
            t0 = time.perf_counter()
            for _ in hb:
                pass
            _sync(dev)
            rates.append(n / (time.perf_counter() - t0))
        ahead = hb.batches_ahead
        hb.close()
        return rates[0], statistics.median(rates[1:]), ahead

    say(f"feed only (the host path's producer, no training step): {n:,} images of {tuple(shape[1:])} uint8 ({n * row / 2**30:.2f} GiB), "
        f"batch {a.batch}, gathered in a shuffled order from a fresh memory map of the cache (page cache warm) on {cores} cores; "
        f"default gather threads here: {default}")
    best = (0.0, default)
    mine = 0.0  # the default thread count's steady rate
    for t in counts:
        first, steady, ahead = measure(torch.device("cpu"), t)
        best = max(best, (steady, t))
        mine = steady if t == default else mine
        say(f"  feed, gather only, {t:2d} thread{'s' if t > 1 else ' '}: steady {steady:,.0f} img/s ({steady * row / 1e9:.2f} GB/s), "
            f"first epoch (a fresh map) {first:,.0f} img/s{'  <- default' if t == default else ''}")
    if device.type != "cuda":  # the graphs' pattern with a stand-in for the GPU, read-ahead off (as before) and on
        for ahead in (False, True):
            rates = stand_in(cache_file, shape, a, default, a.batch / (0.5 * mine), ahead)
            say(f"  feed, the graphs' pattern (16 batches a replay, 34 slots) into a stand-in GPU of {0.5 * mine:,.0f} img/s (half the "
                f"gather's), {default} thread(s), read-ahead {'on ' if ahead else 'off'}: epochs {' / '.join(f'{r:,.0f}' for r in rates)} img/s, "
                f"steady {statistics.median(rates[1:]):,.0f} ({statistics.median(rates[1:]) / (0.5 * mine):.2f} of the stand-in)")
    if device.type == "cuda":
        for t in sorted({default, best[1], 4}):
            first, steady, ahead = measure(device, t)
            say(f"  feed, gather + copy to the GPU (pinned, side stream), {t:2d} threads: steady {steady:,.0f} img/s ({steady * row / 1e9:.2f} GB/s), "
                f"first epoch {first:,.0f} img/s; batches gathered ahead of an epoch: {ahead}{'  <- default' if t == default else ''}")
        zero_copy(cache_file, shape, a, device, say)


def stand_in(cache_file: Path, shape: tuple, a: argparse.Namespace, threads: int, step_s: float, ahead: bool) -> list[float]:
    """Epoch img/s of the host batches fed as the graphs take them: 16 batches, then a replay handed to a stand-in GPU
    (a thread that sleeps step_s a batch, while the loop goes on to the next 16), the epoch timed to the stand-in's
    end with a pause between epochs (the validation); 34 buffers, the device slots the graphs ask for."""
    import queue
    import threading

    from mpsrun.train.loop.feed import host

    n = shape[0]
    x = torch.from_numpy(np.memmap(cache_file, dtype=np.uint8, mode="c", shape=shape))
    saved, host.PINNED_SLOTS = host.PINNED_SLOTS, 34  # on the CPU the pinned buffers are the slots
    hb = host.HostBatches(host.MemoryRows(x, torch.zeros(n, dtype=torch.long)), a.batch, torch.device("cpu"), True, 0)
    host.PINNED_SLOTS = saved
    hb.gather_threads, hb.read_ahead = threads, ahead
    replays: queue.Queue = queue.Queue()

    def gpu() -> None:
        while (k := replays.get()) is not None:
            time.sleep(k * step_s)
            replays.task_done()

    threading.Thread(target=gpu, daemon=True).start()
    rates = []
    for e in range(4):
        hb.set_epoch(e)
        t0 = time.perf_counter()
        k = 0
        for _ in hb:
            k += 1
            if k == 16:
                replays.put(k)
                k = 0
        if k:
            replays.put(k)
        replays.join()
        rates.append(n / (time.perf_counter() - t0))
        time.sleep(0.2)
    replays.put(None)
    hb.close()
    return rates


def zero_copy(cache_file: Path, shape: tuple, a: argparse.Namespace, device: torch.device, say: Callable[[str], None]) -> None:
    """A way the host path could go (not mpsrun's yet): the cache copied once into pinned host memory, which the GPU
    reads itself (a CUDA tensor over the same memory, unified addressing): each batch one index_select kernel over
    PCIe, no CPU thread. Measured on its own: img/s of batches gathered that way, and the seconds the pinning took."""
    n = shape[0]
    try:
        t0 = time.perf_counter()
        pinned = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(torch.from_numpy(np.memmap(cache_file, dtype=np.uint8, mode="c", shape=shape)))
        pin_s = time.perf_counter() - t0

        class Alias:  # the pinned memory as the GPU addresses it
            __cuda_array_interface__ = {"shape": tuple(shape), "typestr": "|u1", "data": (pinned.data_ptr(), False), "version": 3, "strides": None}

        xa = torch.as_tensor(Alias(), device=device)
        assert xa.is_cuda and xa.data_ptr() == pinned.data_ptr()
        out = torch.empty((a.batch, *shape[1:]), dtype=torch.uint8, device=device)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        idx = perm.to(device)
        rates = []
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            for i in range(0, n - a.batch + 1, a.batch):
                torch.index_select(xa, 0, idx[i : i + a.batch], out=out)
            _sync(device)
            rates.append((n // a.batch) * a.batch / (time.perf_counter() - t0))
        last = (n // a.batch - 1) * a.batch
        same = torch.equal(out.cpu(), pinned[perm[last : last + a.batch]])
        row = int(np.prod(shape[1:]))
        say(f"  feed, zero-copy (not mpsrun's path yet): the GPU gathers each batch from the cache pinned in host memory, no CPU thread: "
            f"{statistics.median(rates[1:]):,.0f} img/s ({statistics.median(rates[1:]) * row / 1e9:.2f} GB/s over PCIe), batches right: {same}; "
            f"pinning and copying the {n * row / 2**30:.2f} GiB cache took {pin_s:.2f} s")
        del xa, pinned
    except Exception as e:  # said, not fatal: a measurement of an option
        say(f"  feed, zero-copy: not measured ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")


OLD_FEED = {"gather_threads": max(1, min(4, (os.cpu_count() or 2) // 4)), "read_ahead": False}  # the host path before the producer ran ahead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="small_cnn", help="small_cnn (two strided convolutions) or a torchvision model name")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the training process in both paths (default: "
                    "torch's own for mpsrun, as `mpsrun run` has them; on cpu the DataLoader loop is measured with 1 and with "
                    "torch's own, since its workers need the cores, and its best counts)")
    ap.add_argument("--n", type=int, default=1536, help="training images written")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--size", type=int, default=80, help="side of the written JPEGs (and of the cache)")
    ap.add_argument("--crop", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="DataLoader num_workers values to try")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--record", action="store_true", help="append the result to docs/benchmarks.md")
    ap.add_argument("--build-only", action="store_true", help="only the cache build (the decode figure), no training")
    ap.add_argument("--decode-workers", type=int, default=None, help="dataset.workers for the cache build (default: all cores)")
    ap.add_argument("--stores", default=None, help="with --build-only: whole builds alternating these stores (MPSRUN_DECODE_STORE, "
                    "e.g. map,pwrite), --repeats rounds, each a fresh cache of the same folder; medians printed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default="resident,host,host-reused,stream", help="mpsrun's data paths to time: resident (on the device), "
                    "host (the cache left on the host, as over resident_max_gb, just built), host-reused (the same, the cache reopened "
                    "as a later run does), host-before (host with the producer as it was: a quarter of the cores, at most 4, gathering, "
                    "no read-ahead across epochs), host-zero-copy (host with the cache pinned once and each batch gathered by the GPU from it: "
                    "an option measured, not a default), stream (over a host memory budget of --stream-gb: read from disk in shuffled blocks), "
                    "feed (the host path's producer alone, no training: img/s per number of gather threads)")
    ap.add_argument("--stream-gb", type=float, default=None, help="host memory budget of the stream path (default: a quarter of the cache)")
    ap.add_argument("--feed-epochs", type=int, default=3, help="epochs of each feed-only measurement (the first maps the pages)")
    ap.add_argument("--skip", default="", help="parts left out, comma-separated: loader (the DataLoader runs), ceiling (resident random "
                    "tensors), pil (the PIL-only build and PIL decoding alone)")
    ap.add_argument("--listing", type=int, default=0, help="also time listing and the cache key of this many files (e.g. 100000)")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    device = torch.device(a.device)
    own_threads = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    # the DataLoader loop's training-process threads: on the CPU its workers compete with them, so both ways are tried
    loader_threads = [a.threads] if a.threads else ([1, own_threads] if device.type == "cpu" and own_threads > 1 else [own_threads])
    cmd = "python benchmarks/images_bench.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    lines = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "jpegs"
        t0 = time.perf_counter()
        write_folder(root, a.n, a.classes, a.size, max(a.classes * 2, a.n // 50))
        print(f"wrote {a.n:,} {a.size}px JPEGs in {a.classes} classes in {time.perf_counter() - t0:.1f} s", flush=True)
        if a.listing:
            listing_run(a.listing, Path(tmp), say)

        if a.build_only and a.stores:
            store_ab(root, a, Path(tmp), say)
            return
        # (b) first: the cache build is the decode figure; a fresh cache folder
        os.environ["MPSRUN_CACHE"] = str(Path(tmp) / "cache")
        from mpsrun.plugins.builtin.images.datasets import image_folder
        from mpsrun.train.loop import augment

        t0 = time.perf_counter()
        splits = image_folder(str(root), size=a.size, workers=a.decode_workers)
        build_s = time.perf_counter() - t0
        n_all = len(splits.train) + len(splits.val)
        tags = splits.info["tags"]
        say(f"mpsrun cache build: {n_all:,} images in {build_s:.2f} s = {n_all / build_s:,.0f} img/s whole build, files in the page cache (just written) "
            f"({tags.get('mpsrun.data.decode', '')}; {tags.get('mpsrun.data.decode_phases', '')})")
        for note in splits.info.get("notes", []):
            say(f"  note: {note}")
        if device.type == "cuda" and "pil" not in skip:  # the CPU decoders alone, for comparison (a second fresh cache)
            os.environ["MPSRUN_CACHE"] = str(Path(tmp) / "cache_cpu")
            os.environ["MPSRUN_IMAGE_DECODE"] = "cpu"
            t0 = time.perf_counter()
            alone = image_folder(str(root), size=a.size, workers=a.decode_workers)
            say(f"mpsrun cache build, PIL workers only: {n_all / (time.perf_counter() - t0):,.0f} img/s whole build "
                f"({alone.info['tags'].get('mpsrun.data.decode', '')}; {alone.info['tags'].get('mpsrun.data.decode_phases', '')})")
            os.environ.pop("MPSRUN_IMAGE_DECODE")
            del alone
        w = a.decode_workers or len(os.sched_getaffinity(0))
        if "pil" not in skip:
            say(f"PIL decoding alone (nothing stored), {w} processes: {pil_decode_only(root, a.size, w):,.0f} img/s")
        if a.build_only:
            say(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
            return
        cache_bytes = os.path.getsize(Path(splits.info["cache"]) / "images.u8")
        say(f"cache: {cache_bytes / 2**30:.2f} GiB ({n_all:,} images of {tuple(splits.input_shape)} uint8) at {splits.info['cache']}; "
            f"over the former default cap (resident_max_gb 2): {'yes' if cache_bytes > 2 * 2**30 else 'no'}")
        # the recipe entries' checked values, as plain objects (so the benchmark needs no pydantic)
        steps = [SimpleNamespace(name="random_resized_crop", args=SimpleNamespace(size=a.crop, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))),
                 SimpleNamespace(name="random_horizontal_flip", args=SimpleNamespace(p=0.5))]
        rates: dict[str, float] = {}
        for path in a.paths.split(","):
            if path == "feed":
                row = int(np.prod(splits.input_shape))
                feed_run(Path(splits.info["cache"]) / "images.u8", (cache_bytes // row, *tuple(splits.input_shape)), a, device, say)
                continue
            if path == "host-reused":  # reopened as a later run does: a fresh map of the cache file
                splits = image_folder(str(root), size=a.size, workers=a.decode_workers)
            elif path == "stream":
                budget = a.stream_gb or max(cache_bytes / 4, 64 * 2**20) / 2**30
                splits = image_folder(str(root), size=a.size, workers=a.decode_workers, host_max_gb=budget)
            aug = augment.build(steps, splits.transform, tuple(splits.input_shape))
            resident = {"resident": True, "host": False, "host-reused": False, "host-before": False, "host-zero-copy": False, "stream": "auto"}[path]
            feed = OLD_FEED if path == "host-before" else {"zero_copy": True} if path == "host-zero-copy" else None
            try:
                rates[path], notes, where = engine_run(splits.train, splits.val, aug.eval, aug.train, a, device, aug.input_shape, resident, feed)
            except Exception as e:
                if path != "host-zero-copy":
                    raise
                say(f"mpsrun {path}: failed ({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})")
                continue
            budget_note = f", host memory budget {budget:.2f} GiB" if path == "stream" else ""
            say(f"mpsrun {path} ({where}{budget_note}; cache {splits.info['tags']['mpsrun.data.cache']}, device augmentation): {rates[path]:,.0f} img/s"
                + (f"  notes: {'; '.join(notes)}" if notes else ""))
        mpsrun_rate = rates.get("resident") or max(rates.values(), default=0.0)
        del splits

        # (a) the DataLoader loop, per worker count
        loader = {}
        mine = torch.get_num_threads()
        for w in ([] if "loader" in skip else a.workers):
            for t in loader_threads:
                torch.set_num_threads(t)
                loader[w, t] = dataloader_run(root, a, device, w)
                say(f"ImageFolder + DataLoader(num_workers={w}), {t} torch thread{'s' if t > 1 else ''} in the training process: {loader[w, t]:,.0f} img/s")
        torch.set_num_threads(mine)
        best_w = max(loader, key=loader.get) if loader else None  # type: ignore[arg-type]

        # (c) resident random tensors at the crop size: the model's own ceiling
        ceiling = None
        if device.type == "cuda" and "ceiling" not in skip:
            from torch.utils.data import TensorDataset

            from mpsrun.plugins.contract import ImageTransform

            g = torch.Generator().manual_seed(0)
            x = torch.randint(0, 256, (a.n, 3, a.crop, a.crop), dtype=torch.uint8, generator=g)
            y = torch.randint(0, a.classes, (a.n,), generator=g)
            xv, yv = x[: a.batch], y[: a.batch]
            tf = ImageTransform(mean=(0.5,) * 3, std=(0.25,) * 3)
            ceiling, _, _ = engine_run(TensorDataset(x, y), TensorDataset(xv, yv), tf, None, a, device, (3, a.crop, a.crop))
            say(f"same model on resident random uint8 tensors: {ceiling:,.0f} img/s")

    for path, r in rates.items():
        vs = [f"/ best DataLoader (num_workers={best_w[0]}, {best_w[1]} torch thread(s)): {r / loader[best_w]:.2f}x"] if best_w else []
        if "resident" in rates and path != "resident":
            vs.append(f"/ mpsrun resident: {r / rates['resident']:.2f}x")
        if vs:
            say(f"mpsrun {path} " + "; ".join(vs))
    if ceiling:
        say(f"mpsrun / resident random tensors: {mpsrun_rate / ceiling:.2f} ({100 * (1 - mpsrun_rate / ceiling):.1f}% below)")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    head = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC — {machine}, torch {torch.__version__}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    print(head)
    if a.record:
        doc = ROOT / "docs" / "benchmarks.md"
        with open(doc, "a") as f:
            f.write(f"\n### {head}\n\n`{cmd}`\n\n" + "".join(f"- {s}\n" for s in lines))


if __name__ == "__main__":
    main()
