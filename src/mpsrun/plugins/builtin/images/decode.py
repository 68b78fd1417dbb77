"""Decode image files once, in parallel, straight into a uint8 memory map (N, C, H, W).

Why worker processes that write into the map themselves: decoding is CPU-bound Python
(PIL releases the GIL only in parts), so threads would not scale, and sending decoded
pixels back through a pipe would cost as much as decoding small images. Each worker
opens the same file with `np.memmap(mode="r+")` and fills its rows; only the indices of
files that failed come back.

Each image is resized so it covers the target (h, w) and centre-cropped: the shorter
side becomes the target's for `size: 224`. JPEGs use PIL's draft mode (the decoder
scales by 1/2, 1/4 or 1/8 in the DCT, never below the target), which makes large photos
several times cheaper. A transparent image (PNG with alpha, palette transparency) is put
on white before dropping alpha; mode `gray` is PIL's luminance.

On a CUDA machine JPEGs are decoded by nvJPEG (`torchvision.io.decode_jpeg` on the GPU,
see `gpu_decode`); any file it refuses goes through PIL here like the rest.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

Progress = Callable[[int, int], None]  # (done, total)
CHUNK = 64  # files per task: small enough for a live progress bar, large enough to amortise the pickling


def load(path: str, h: int, w: int, gray: bool) -> np.ndarray:
    """One file as (C, h, w) uint8; raises on a corrupt or truncated file."""
    from PIL import Image

    with Image.open(path) as im:
        w0, h0 = im.size
        s = max(w / w0, h / h0)
        if im.format == "JPEG":
            im.draft("L" if gray else "RGB", (max(1, int(w0 * s + 0.999)), max(1, int(h0 * s + 0.999))))
            s = max(w / im.size[0], h / im.size[1])  # the draft may already have scaled it
        im.load()  # decode now: a truncated file raises here, not later
        im = _mode(im, gray)
        w0, h0 = im.size
        cw, ch = w / s, h / s  # the crop in source pixels
        left, top = (w0 - cw) / 2, (h0 - ch) / 2
        out = im.resize((w, h), Image.BILINEAR, box=(left, top, left + cw, top + ch))
        a = np.asarray(out, dtype=np.uint8)
    return a[None] if gray else a.transpose(2, 0, 1)


def _mode(im, gray: bool):  # type: ignore[no-untyped-def]
    from PIL import Image

    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, rgba)
    target = "L" if gray else "RGB"
    return im if im.mode == target else im.convert(target)


def _work(args: tuple) -> tuple[int, list[tuple[int, str]]]:
    """Decode rows `indices` of `paths` into the map at `out`; (count, [(index, error)])."""
    out, shape, indices, paths = args
    arr = np.memmap(out, dtype=np.uint8, mode="r+", shape=shape)
    _, c, h, w = shape
    bad = []
    for i, p in zip(indices, paths):
        try:
            arr[i] = load(p, h, w, c == 1)
        except Exception as e:  # corrupt, truncated, not really an image: reported, never fatal here
            bad.append((i, f"{type(e).__name__}: {str(e)[:120]}"))
    arr.flush()
    del arr
    return len(indices), bad


def workers_default() -> int:
    try:
        return len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except AttributeError:
        return os.cpu_count() or 1


def decode_cpu(
    paths: Sequence[str],
    indices: Sequence[int],
    out: str,
    shape: tuple[int, int, int, int],
    workers: int,
    progress: Optional[Progress] = None,
) -> dict[int, str]:
    """Decode `paths` into rows `indices` of the map with `workers` processes; {index: error} for failures."""
    total = len(paths)
    chunk = max(8, min(CHUNK, total // max(1, 4 * workers)))  # a few tasks per worker, so they finish together
    tasks = [(out, shape, list(indices[i : i + chunk]), list(paths[i : i + chunk])) for i in range(0, total, chunk)]
    bad: dict[int, str] = {}
    done = 0
    if workers <= 1 or len(tasks) <= 1:
        results = map(_work, tasks)
        pool = None
    else:
        from PIL import Image  # noqa: F401 - imported before forking, so no child waits on an import another thread held

        # fork on Linux (no re-import; the children only run PIL and numpy); spawn on macOS, where fork is unsafe.
        ctx = mp.get_context("spawn" if sys.platform == "darwin" else "fork")
        pool = ctx.Pool(min(workers, len(tasks)))
        results = pool.imap_unordered(_work, tasks)
    try:
        for n, errs in results:
            done += n
            bad.update(errs)
            if progress is not None:
                progress(done, total)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return bad


class Meter:
    """A one-line progress display on stderr with images per second (plain text, so logs stay readable)."""

    def __init__(self, label: str, total: int, stream=None) -> None:  # type: ignore[no-untyped-def]
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self.last < (0.25 if self.tty else 5.0):
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        line = f"{self.label}: {done:,}/{total:,} images ({100 * done / max(total, 1):.0f}%), {rate:,.0f} img/s"
        end = "\n" if done >= total or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()

    def rate(self, done: int) -> float:
        return done / max(time.perf_counter() - self.t0, 1e-9)


def is_jpeg(path: str) -> bool:
    return Path(path).suffix.lower() in (".jpg", ".jpeg")
