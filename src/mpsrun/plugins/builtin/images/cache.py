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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from mpsrun.plugins.builtin.images import decode, gpu_decode

VERSION = 1  # bump when the decoded pixels would differ (resize rule, alpha handling)
STATS_SAMPLE = 2048  # images read to compute the per-channel mean and std


def root() -> Path:
    """`$MPSRUN_CACHE/images`, else `~/.cache/mpsrun/images`."""
    base = os.environ.get("MPSRUN_CACHE") or str(Path("~/.cache/mpsrun").expanduser())
    return Path(base).expanduser() / "images"


def key(files: Sequence[Path], h: int, w: int, mode: str) -> str:
    digest = hashlib.sha256(json.dumps({"v": VERSION, "h": h, "w": w, "mode": mode}).encode())
    for p in files:
        st = os.stat(p)
        digest.update(f"{os.path.abspath(p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
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
    seconds: float = 0.0  # decoding time when built
    how: list[str] = field(default_factory=list)  # which decoders ran


def open_or_build(files: Sequence[Path], h: int, w: int, mode: str, workers: Optional[int] = None, quiet: bool = False) -> Cache:
    """The cache for these files and settings: reopened when it exists, else decoded now.

    Runs that start together on the same data (the ranks of a DDP job, `mpsrun bench --parallel`
    cells) take a file lock beside the cache, so one decodes and the others wait and reuse it.
    """
    from filelock import FileLock

    c = 1 if mode == "gray" else 3
    folder = root() / key(files, h, w, mode)
    found = _open(folder)
    if found is not None:
        return found
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        found = _open(folder)  # built by another process while this one waited
        if found is not None:
            return found
        return _build(folder, [str(p) for p in files], (len(files), c, h, w), workers or decode.workers_default(), quiet)


def _open(folder: Path) -> Optional[Cache]:
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    shape = tuple(meta["shape"])
    arr = np.memmap(folder / "images.u8", dtype=np.uint8, mode="c", shape=shape)
    return Cache(folder, arr, {int(k): v for k, v in meta["bad"].items()}, meta["mean"], meta["std"], "reused")


def _build(folder: Path, paths: list[str], shape: tuple[int, int, int, int], workers: int, quiet: bool) -> Cache:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        out = tmp / "images.u8"
        with open(out, "wb") as f:
            f.truncate(int(np.prod(shape)))
        meter = decode.Meter(f"decoding {len(paths):,} images once into {folder}", len(paths), stream=open(os.devnull, "w") if quiet else None)
        t0 = time.perf_counter()
        how = []
        todo = list(range(len(paths)))
        if gpu_decode.available() and os.environ.get("MPSRUN_IMAGE_DECODE", "auto") != "cpu":
            jpegs = [i for i in todo if decode.is_jpeg(paths[i])]
            if jpegs:
                arr = np.memmap(out, dtype=np.uint8, mode="r+", shape=shape)
                left = gpu_decode.decode_gpu([paths[i] for i in jpegs], jpegs, arr, meter, 0, len(paths))
                arr.flush()
                del arr
                done = set(jpegs) - {i for i, _ in left}
                todo = [i for i in todo if i not in done]
                how.append(f"nvJPEG on the GPU: {len(done):,}")
        bad = decode.decode_cpu([paths[i] for i in todo], todo, str(out), shape, workers, _offset(meter, len(paths) - len(todo), len(paths)))
        if todo:
            how.append(f"PIL in {workers if workers > 1 and len(todo) > 8 else 1} process(es): {len(todo):,}")
        seconds = time.perf_counter() - t0
        arr = np.memmap(out, dtype=np.uint8, mode="r", shape=shape)
        mean, std = _stats(arr, bad)
        meta = {"shape": list(shape), "bad": {str(k): v for k, v in sorted(bad.items())}, "mean": mean, "std": std,
                "seconds": seconds, "files": len(paths), "how": how}
        (tmp / "meta.json").write_text(json.dumps(meta))
        del arr
        try:
            os.rename(tmp, folder)
        except OSError:  # another run built the same cache meanwhile: use it, drop ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    arr = np.memmap(folder / "images.u8", dtype=np.uint8, mode="c", shape=shape)
    return Cache(folder, arr, bad, mean, std, "built", seconds, how)


def _offset(meter: decode.Meter, before: int, total: int) -> decode.Progress:
    return lambda done, _n: meter(before + done, total)


def _stats(arr: np.ndarray, bad: dict[int, str]) -> tuple[list[float], list[float]]:
    """Per-channel mean and std in [0, 1] over an evenly spaced sample of the good images."""
    good = [i for i in range(len(arr)) if i not in bad]
    if not good:
        return [0.5] * arr.shape[1], [0.25] * arr.shape[1]
    pick = good[:: max(1, len(good) // STATS_SAMPLE)][:STATS_SAMPLE]
    s = np.zeros(arr.shape[1])
    s2 = np.zeros(arr.shape[1])
    n = 0
    for i in range(0, len(pick), 256):
        block = arr[np.asarray(pick[i : i + 256])].astype(np.float64) / 255.0
        s += block.sum(axis=(0, 2, 3))
        s2 += (block**2).sum(axis=(0, 2, 3))
        n += block.shape[0] * block.shape[2] * block.shape[3]
    mean = s / n
    std = np.sqrt(np.maximum(s2 / n - mean**2, 1e-12))
    return [round(float(m), 6) for m in mean], [round(float(max(v, 1e-3)), 6) for v in std]
