"""The decoded-image cache: one uint8 memory map per (file list, sizes, mtimes, size, mode).

Layout under `$MPSRUN_CACHE/images/` (default `~/.cache/mpsrun/images/`), one folder per key:
`images.u8` (raw N x C x H x W bytes, memory-mapped by every later run) and `meta.json`
(shape, files that failed to decode with why, per-channel mean and std). The key hashes
each file's absolute path, size and modification time plus the settings, so a changed,
added or removed file, or another `size` or `mode`, makes a new cache, and a reused one
needs only `os.stat` of each file: no image file is opened. A folder appears only when
complete (built under a temporary name, then renamed), so a run killed while decoding
leaves nothing that a later run could mistake for a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from mpsrun.plugins import nvidia
from mpsrun.plugins.builtin.images import decode, gpu_decode

VERSION = 2  # bump when the decoded pixels would differ (resize rule, alpha handling; 2: EXIF orientation, 16-bit gray scaled)
STATS_SAMPLE = 512  # images read (on a pixel grid) to compute the per-channel mean and std


def root() -> Path:
    """`$MPSRUN_CACHE/images`, else `~/.cache/mpsrun/images`."""
    base = os.environ.get("MPSRUN_CACHE") or str(Path("~/.cache/mpsrun").expanduser())
    return Path(base).expanduser() / "images"


def key(files: Sequence[Path], h: int, w: int, mode: str, stats: Optional[dict[str, tuple[int, int]]] = None) -> str:
    """The cache's name: every file's absolute path, size and modification time, and the settings.

    `stats` (path -> (size, mtime_ns)): what the listing read with its one `stat` per file
    (scan.Listing.stats); a file it lacks is stat-ed here. 100,000 files take seconds, not minutes.
    """
    digest = hashlib.sha256(json.dumps({"v": VERSION, "h": h, "w": w, "mode": mode}).encode())
    known = stats or {}
    lines = []
    for p in files:
        s = str(p)
        got = known.get(s)
        if got is None:
            st = os.stat(p)
            got = (st.st_size, st.st_mtime_ns)
        lines.append(f"{s if os.path.isabs(s) else os.path.abspath(s)}\0{got[0]}\0{got[1]}\n")
    digest.update("".join(lines).encode())
    return digest.hexdigest()[:24]


@dataclass
class Cache:
    """A built or reused cache, opened as a copy-on-write memory map (writable for torch, never written back)."""

    folder: Path
    images: np.ndarray  # (N, C, H, W) uint8 memmap
    bad: dict[int, str]  # index -> why it could not be decoded
    mean: list[float]
    std: list[float]
    status: str  # "built" or "reused"
    seconds: float = 0.0  # the whole build as the user waits for it (key, decoding, statistics) when built
    how: list[str] = field(default_factory=list)  # which decoders ran, and how many files each
    phases: dict[str, Optional[float]] = field(default_factory=dict)  # where the build's seconds went (see `_build`)
    notes: list[str] = field(default_factory=list)  # said on screen and kept with the run (a decoder that could not run)


def open_or_build(files: Sequence[Path], h: int, w: int, mode: str, workers: Optional[int] = None, quiet: bool = False,
                  stats: Optional[dict[str, tuple[int, int]]] = None) -> Cache:
    """The cache for these files and settings: reopened when it exists, else decoded now.

    Runs that start together on the same data (the ranks of a DDP job, `mpsrun bench --parallel`
    cells) take a file lock beside the cache, so one decodes and the others wait and reuse it.
    """
    from filelock import FileLock

    t0 = time.perf_counter()
    c = 1 if mode == "gray" else 3
    folder = root() / key(files, h, w, mode, stats)
    key_s = time.perf_counter() - t0
    found = _open(folder)
    if found is not None:
        return found
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        found = _open(folder)  # built by another process while this one waited
        if found is not None:
            return found
        return _build(folder, [str(p) for p in files], (len(files), c, h, w), workers or decode.workers_default(), quiet, t0, key_s)


def _open(folder: Path) -> Optional[Cache]:
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    shape = tuple(meta["shape"])
    arr = np.memmap(folder / "images.u8", dtype=np.uint8, mode="c", shape=shape)
    return Cache(folder, arr, {int(k): v for k, v in meta["bad"].items()}, meta["mean"], meta["std"], "reused")


GPU_LOOK_S = 0.5  # PIL's pace is judged after this long
GPU_WORTH_S = 5.0  # nvJPEG starts only when PIL alone would take at least this much longer: its start (CUDA, torchvision,
# nvJPEG) beside 16 busy PIL processes took 8.7 s on the H100 machine and slowed them by a quarter meanwhile


def _gpu_present() -> bool:
    """An NVIDIA GPU by the driver's /proc entries (no CUDA started); where there are none to read (not Linux), CUDA is
    asked, except on macOS, which has no CUDA."""
    n = nvidia.visible_gpus()
    if n is not None:
        return n > 0
    return sys.platform != "darwin" and gpu_decode.available()


def gpu_wanted() -> bool:
    """nvJPEG is tried unless MPSRUN_IMAGE_DECODE=cpu (the benchmark's PIL-only figure).

    Whether CUDA is there is asked on the decoder's thread, after the PIL workers are forked:
    `torch.cuda.is_available()` starts the CUDA driver, which held the first worker back about
    0.35 s on the H100 machine (`benchmarks/decode_trace.py`), a fifth of a 10,000-image build.
    """
    return os.environ.get("MPSRUN_IMAGE_DECODE", "auto") != "cpu"


def _build(folder: Path, paths: list[str], shape: tuple[int, int, int, int], workers: int, quiet: bool, t0: float, key_s: float) -> Cache:
    """Decode every file into a fresh map, PIL workers from the front of the list and nvJPEG from the back.

    Phases (seconds, kept in meta.json and shown by the benchmark): `key` (stat every file),
    `workers_start` (forking the PIL workers), `gpu_init` (CUDA context and nvJPEG, on a thread,
    overlapped with the workers' decoding), `decode` (first worker start to last file written),
    `pil_retry` (files nvJPEG refused, through PIL here), `stats` (per-channel mean and std).
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    phases: dict[str, Optional[float]] = {"key": key_s}
    notes: list[str] = []
    pool: Optional[decode.Workers] = None
    claims: Optional[decode.Claims] = None
    try:
        out = tmp / "images.u8"
        with open(out, "wb") as f:
            f.truncate(int(np.prod(shape)))
        meter = decode.Meter(f"decoding {len(paths):,} images once into {folder}", len(paths),
                             stream=open(os.devnull, "w") if quiet else None, t0=t0)
        use_gpu = gpu_wanted() and _gpu_present()
        # PIL-only files first, JPEGs last: the GPU takes from the back and never goes below the first JPEG
        order = sorted(range(len(paths)), key=lambda i: decode.is_jpeg(paths[i])) if use_gpu else list(range(len(paths)))
        floor = sum(1 for i in order if not decode.is_jpeg(paths[i])) if use_gpu else len(order)
        use_gpu = use_gpu and floor < len(order)  # no JPEG, nothing for nvJPEG
        ctx = decode.context()
        claims = decode.Claims(len(order), gpu_floor=floor, ctx=ctx)
        # every core to PIL: the GPU thread joins late (1 s or more of warm-up), and at 10,000 images PIL was done before it
        n_proc = min(max(1, workers), max(1, len(paths) // decode.CHUNK))
        t = time.perf_counter()
        pool = decode.Workers(n_proc if workers > 1 else 1, str(out), shape, paths, order, claims, ctx)  # forked before CUDA starts, or is asked for
        phases["workers_start"] = time.perf_counter() - t
        gpu = None
        total = len(paths)
        gpu_why = ""  # why nvJPEG was not started, said with the decoders
        if use_gpu and not pool.procs:
            gpu_why = "nvJPEG not started: too few files to share"
            use_gpu = False
        if pool.procs:
            while pool.poll(0.1):
                if use_gpu and gpu is None and time.perf_counter() - t >= GPU_LOOK_S:
                    # seconds PIL alone would still take, at its pace so far
                    left = (total - pool.done) * (time.perf_counter() - t) / pool.done if pool.done else float("inf")
                    if left >= GPU_WORTH_S:
                        arr = np.memmap(out, dtype=np.uint8, mode="r+", shape=shape)
                        gpu = gpu_decode.Thread(paths, order, claims.back, arr)
                    else:
                        use_gpu = False
                        gpu_why = f"nvJPEG not started: PIL had {left:.1f} s left, under the GPU's start of about {GPU_WORTH_S:.0f} s"
                meter(pool.done + (gpu.decoded if gpu else 0), total)
            if use_gpu and gpu is None:
                gpu_why = f"nvJPEG not started: PIL finished within {GPU_LOOK_S} s"
        else:
            pool.run_here()
        pool.join()
        gpu_left: list[tuple[int, str]] = []
        if gpu is not None:
            gpu.checked.wait(5)  # whether there is a GPU at all: instant without CUDA, the driver's start (~0.3 s) with it
            if claims.close() or not gpu.thread.is_alive():  # it took files (or is done): wait for them
                gpu.join()
                gpu_left = gpu.left
                phases["gpu_init"] = gpu.init_s
            else:  # still starting when PIL finished everything: not waited for (it will find nothing to take)
                phases["gpu_init"] = None
            if gpu.error:
                notes.append(f"images: GPU decoding (nvJPEG) failed, PIL decoded its files instead: {gpu.error}")
            del arr
            if gpu.absent:  # no CUDA GPU: a CPU machine's build, said as one
                gpu = None
                phases.pop("gpu_init", None)
        phases["decode"] = time.perf_counter() - t
        bad = dict(pool.bad)
        t = time.perf_counter()
        if gpu_left:  # refused by nvJPEG (or its thread failed): PIL judges them, here
            arr = np.memmap(out, dtype=np.uint8, mode="r+", shape=shape)
            for i, p in gpu_left:
                try:
                    decode.load_into(p, arr[i])
                except Exception as e:
                    bad[i] = f"{type(e).__name__}: {str(e)[:120]}"
            arr.flush()
            del arr
        phases["pil_retry"] = time.perf_counter() - t
        # failed midway: PIL decoded again every file the thread had taken, so it counts none
        n_gpu = 0 if gpu is None or gpu.error else gpu.decoded - len(gpu_left)
        how = [gpu_why] if gpu_why else []
        if gpu is not None:
            how.append(f"nvJPEG on the GPU: {n_gpu:,}" + gpu.handed() + (" (still starting when PIL had finished)" if phases.get("gpu_init", 0) is None else ""))
        n_pil = total - n_gpu
        how.append(f"PIL in {len(pool.procs) or 1} process(es): {n_pil:,}")
        t = time.perf_counter()
        arr = np.memmap(out, dtype=np.uint8, mode="r", shape=shape)
        mean, std = _stats(arr, bad)
        del arr
        phases["stats"] = time.perf_counter() - t
        seconds = time.perf_counter() - t0
        meta = {"shape": list(shape), "bad": {str(k): v for k, v in sorted(bad.items())}, "mean": mean, "std": std,
                "seconds": seconds, "files": len(paths), "how": how, "phases": phases}
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(tmp, folder)
        except OSError:  # another run built the same cache meanwhile: use it, drop ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:  # interrupted or failed: no worker or GPU batch goes on writing a file nobody will read
        if claims is not None:
            claims.close()
        if pool is not None:
            pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meter(total, total, final=f" in {seconds:.2f} s ({'; '.join(how)})")
    for n in notes:
        print(n, file=meter.stream, flush=True)
    arr = np.memmap(folder / "images.u8", dtype=np.uint8, mode="c", shape=shape)
    return Cache(folder, arr, bad, mean, std, "built", seconds, how, phases, notes)


def _stats(arr: np.ndarray, bad: dict[int, str]) -> tuple[list[float], list[float]]:
    """Per-channel mean and std in [0, 1] over an evenly spaced sample of the good images.

    Why a pixel grid (at most about 64 x 64 per image) and integer sums: the float64 pass over
    2,048 full 256px images took 2.4 s on the 2-core machine, longer than decoding 2,000 of them; 512 images on
    the grid take about 0.04 s, and the figures only set the normalisation.
    """
    good = [i for i in range(len(arr)) if i not in bad]
    if not good:
        return [0.5] * arr.shape[1], [0.25] * arr.shape[1]
    pick = good[:: max(1, len(good) // STATS_SAMPLE)][:STATS_SAMPLE]
    step = max(1, min(arr.shape[2], arr.shape[3]) // 64)
    s = np.zeros(arr.shape[1], dtype=np.float64)
    s2 = np.zeros(arr.shape[1], dtype=np.float64)
    n = 0
    for i in range(0, len(pick), 256):
        block = arr[np.asarray(pick[i : i + 256]), :, ::step, ::step].astype(np.uint32)
        s += block.sum(axis=(0, 2, 3), dtype=np.uint64)
        s2 += (block * block).sum(axis=(0, 2, 3), dtype=np.uint64)
        n += block.shape[0] * block.shape[2] * block.shape[3]
    mean = s / n / 255.0
    std = np.sqrt(np.maximum(s2 / n / 255.0**2 - mean**2, 1e-12))
    return [round(float(m), 6) for m in mean], [round(float(max(v, 1e-3)), 6) for v in std]
