"""Decode image files once, in parallel, straight into a uint8 memory map (N, C, H, W).

Why worker processes that write into the file themselves: decoding is CPU-bound Python
(PIL releases the GIL only in parts), so threads would not scale, and sending decoded
pixels back through a pipe would cost as much as decoding small images. Each worker
writes its rows into the same file, one `pwritev` an image (see `_decode_claims`); only counts and the
indices of files that failed come back.

Why a shared two-ended counter (`Claims`) rather than a pool's task list: on a CUDA
machine the GPU decoder (`gpu_decode`) starts several seconds late (CUDA context, nvJPEG)
and then outruns the CPU. The PIL workers take chunks from the front of the list from the
first moment, the GPU takes batches from the back once it is ready, and they stop where
they meet: neither waits for the other, and no file is decoded twice. Workers are forked
(no re-import; they only run PIL and numpy) before anything starts CUDA in this process.

Each image is turned upright as a photo viewer shows it (EXIF orientation), then resized so it
covers the target (h, w) and centre-cropped: the shorter side becomes the target's for `size: 224`.
Every file PIL can decode is read, whatever its size (1x1, 2x3000), mode or format; only a file
that cannot be decoded fails (`_decoded`). JPEGs use PIL's draft mode (the decoder
scales by 1/2, 1/4 or 1/8 in the DCT, never below the target), which makes large photos
several times cheaper; a file already at the target size is not resampled. A transparent
image (PNG with alpha, palette transparency) is put on white before dropping alpha; 16-bit gray
is scaled to 8 bits; mode `gray` is PIL's luminance.
"""

from __future__ import annotations

import math
import mmap
import multiprocessing as mp
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module does not name it
PAGE = mmap.PAGESIZE
ENV_STORE = "MPSRUN_DECODE_STORE"  # 'map': store through a shared map instead of one pwritev an image
ORIENTATION = 0x0112  # the EXIF tag
WIDE_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit gray PNGs open as I;16
CHUNK = 32  # files per claim of a PIL worker: small enough for a live progress bar and an even finish


def _decoded(path: str, h: int, w: int, gray: bool):  # type: ignore[no-untyped-def]
    """The PIL image of one file, at (w, h) in mode L or RGB, upright as a photo viewer shows it; raises on a
    corrupt or truncated file (and only then: any size, mode or EXIF of a file PIL can decode comes out)."""
    from PIL import Image

    with Image.open(path) as im:
        if im.format == "JPEG":
            _draft(im, h, w, gray)
        im.load()  # decode now: a truncated file raises here, not later
        return _fit(_mode(_upright(im), gray), h, w)


def _draft(im, h: int, w: int, gray: bool) -> None:  # type: ignore[no-untyped-def]
    """Let the JPEG decoder scale by 1/2, 1/4 or 1/8 in the DCT, never below what covers the target.

    The target is turned into the file's stored orientation first: a portrait photo stored sideways
    (EXIF orientation 5 to 8) covers (h, w) of the file's pixels, not (w, h).
    """
    tw, th = (h, w) if _orientation(im) in (5, 6, 7, 8) else (w, h)
    w0, h0 = im.size
    s = max(tw / w0, th / h0)
    im.draft("L" if gray else "RGB", (max(1, math.ceil(w0 * s - 1e-6)), max(1, math.ceil(h0 * s - 1e-6))))


def _orientation(im) -> int:  # type: ignore[no-untyped-def]
    """The EXIF (or XMP) orientation, 1 to 8; 1 (as stored) when there is none or it cannot be read: a viewer
    shows the pixels of a file whose EXIF is damaged, so do we."""
    try:
        o = int(im.getexif().get(ORIENTATION, 1))
    except Exception:
        return 1
    return o if 1 <= o <= 8 else 1


def _upright(im):  # type: ignore[no-untyped-def]
    """The image as a photo viewer shows it (`PIL.ImageOps.exif_transpose`); as is, uncopied, when already upright."""
    if _orientation(im) == 1:
        return im
    from PIL import ImageOps

    return ImageOps.exif_transpose(im)


def _fit(im, h: int, w: int):  # type: ignore[no-untyped-def]
    """Resize so the image covers (w, h), centre-cropped; untouched when already that size (PIL's resize would copy it).

    The crop is clamped to the image: in floating point `w / s` can land a hair past the source's side
    (49 px to 32: 49.00000000000001), which PIL refused as "box offset can't be negative" and the file
    was skipped as unreadable.
    """
    from PIL import Image

    w0, h0 = im.size
    if (w0, h0) == (w, h):
        return im
    s = max(w / w0, h / h0)
    cw, ch = min(float(w0), w / s), min(float(h0), h / s)  # the crop in source pixels
    left, top = (w0 - cw) / 2, (h0 - ch) / 2
    return im.resize((w, h), Image.BILINEAR, box=(left, top, left + cw, top + ch))


def load(path: str, h: int, w: int, gray: bool) -> np.ndarray:
    """One file as (C, h, w) uint8; raises on a corrupt or truncated file."""
    a = np.asarray(_decoded(path, h, w, gray), dtype=np.uint8)
    return a[None] if gray else a.transpose(2, 0, 1)


def load_into(path: str, dst: np.ndarray) -> None:
    """Decode one file into `dst` (C, h, w): band by band, each a contiguous copy (measured faster than
    writing the (h, w, C) array through a transposed view, which strides across the map's pages)."""
    c, h, w = dst.shape
    im = _decoded(path, h, w, c == 1)
    if c == 1:
        dst[0] = np.asarray(im)
    else:
        for k, band in enumerate(im.split()):
            dst[k] = np.asarray(band)


def _mode(im, gray: bool):  # type: ignore[no-untyped-def]
    """L or RGB as a viewer shows the file: 16-bit (and 32-bit integer) gray scaled to 8 bits, where PIL's
    `convert` clips at 255 (a 16-bit value of 1,000 of 65,535 would be white); anything transparent (an alpha
    band, a palette's or a colour key's transparency) put on white; 1-bit, palette, CMYK and the rest through
    PIL's conversion."""
    from PIL import Image

    if im.mode in WIDE_GRAY:
        a = np.asarray(im).astype(np.int64).clip(0, 65535)
        im = Image.fromarray(((a + 128) // 257).astype(np.uint8), "L")
    elif im.mode == "F":  # floating point: taken as 0-255, as PIL's convert does
        im = Image.fromarray(np.asarray(im).clip(0, 255).round().astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "PA", "RGBa") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, rgba)
    target = "L" if gray else "RGB"
    return im if im.mode == target else im.convert(target)


class Claims:
    """Positions 0..n-1 of a work list handed out from both ends, in process-shared memory.

    The front (`front`) is for PIL, which can decode anything; the back (`back`) for the GPU,
    which may not go below `gpu_floor` (the list is ordered so files only PIL reads come first).
    `close()` ends the hand-out: a GPU still starting then finds nothing left to take.
    """

    def __init__(self, n: int, gpu_floor: int = 0, ctx: Any = None) -> None:
        ctx = ctx or mp.get_context()
        self.lock = ctx.Lock()
        self.lo = ctx.RawValue("q", 0)
        self.hi = ctx.RawValue("q", n)
        self.closed = ctx.RawValue("b", 0)
        self.gpu_floor = gpu_floor
        self.gpu_took = 0  # positions the GPU claimed (its own process only)

    def front(self, k: int) -> range:
        with self.lock:
            a = self.lo.value
            b = min(a + k, self.hi.value)
            if a >= b:
                return range(0)
            self.lo.value = b
            return range(a, b)

    def back(self, k: int) -> range:
        with self.lock:
            b = self.hi.value
            a = max(b - k, self.lo.value, self.gpu_floor)
            if self.closed.value or a >= b:
                return range(0)
            self.hi.value = a
            self.gpu_took += b - a
            return range(a, b)

    def close(self) -> int:
        """Stop handing out; the number of positions the GPU took (to know whether to wait for it)."""
        with self.lock:
            self.closed.value = 1
            return self.gpu_took


def _decode_claims(out: str, shape: tuple[int, int, int, int], paths: Sequence[str], order: Sequence[int], claims: Claims,
                   report: Callable[[int, list[tuple[int, str]]], None]) -> None:
    """Take chunks from the front until none is left; decode each into the file; report (count, [(index, error)]).

    Why one `pwritev` of an image's bands at its row: measured with no decoding at all
    (`benchmarks/decode_store_probe.py`, 10,200 rows of 256px RGB, 15 processes, ext4 on the H100 machine),
    pwritev stored 15,200 rows/s and a shared map whose pages each row populates with
    `madvise(MADV_POPULATE_WRITE)` 7,700 (inserting pages into one file's page cache from many processes
    contends). Whole builds there swung too much from round to round to rank the two (3,700-7,600 img/s with
    either); on the 2-core machine they tie (1,190 against 1,110). MPSRUN_DECODE_STORE=map keeps the map (on tmpfs it stored 19,700 rows/s against
    pwritev's 11,100); a plain map, a fault per page, where there is no `pwritev` (`_store_map`).
    """
    _, c, h, w = shape
    row = c * h * w
    fd = os.open(out, os.O_RDWR)
    mm, populate = _store_map(fd, row * shape[0], want_map=os.environ.get(ENV_STORE, "pwrite") == "map")
    arr = np.frombuffer(mm, dtype=np.uint8).reshape(shape) if mm is not None else None
    try:
        while True:
            got = claims.front(CHUNK)
            if not got:
                break
            bad = []
            for pos in got:
                i = order[pos]
                try:
                    im = _decoded(paths[i], h, w, c == 1)
                    bands = im.split() if c > 1 else (im,)
                    if arr is not None:
                        if populate:
                            start = i * row - (i * row) % PAGE
                            mm.madvise(MADV_POPULATE_WRITE, start, (i + 1) * row - start)  # type: ignore[union-attr]
                        for k, band in enumerate(bands):
                            arr[i, k] = np.asarray(band)
                    else:
                        os.pwritev(fd, [b.tobytes() for b in bands], i * row)
                except Exception as e:  # corrupt, truncated, not really an image: reported, never fatal here
                    bad.append((i, f"{type(e).__name__}: {str(e)[:120]}"))
            report(len(got), bad)
    finally:
        del arr
        if mm is not None:
            mm.close()  # MAP_SHARED: the stores are in the page cache, the reader's map sees them
        os.close(fd)


def _store_map(fd: int, size: int, want_map: bool = True) -> tuple[Optional[mmap.mmap], bool]:
    """(map, populate) for the workers' stores: (None, False), one `pwritev` an image, unless the map is wanted
    or there is no `pwritev`; then a shared writable map whose pages each image populates with
    MADV_POPULATE_WRITE where the kernel takes it (Linux 5.14+), else a plain map, a fault per page."""
    if size <= 0 or (not want_map and hasattr(os, "pwritev")):
        return None, False
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, min(size, PAGE))
        return mm, True
    except (OSError, ValueError, AttributeError):  # refused, or no madvise at all
        if hasattr(os, "pwritev"):
            mm.close()
            return None, False
        return mm, False


def _worker(out: str, shape: tuple[int, int, int, int], paths: Sequence[str], order: Sequence[int], claims: Claims, q: Any) -> None:
    try:
        _decode_claims(out, shape, paths, order, claims, lambda n, bad: q.put((n, bad)))
    finally:
        q.put(None)  # this worker is done


def workers_default() -> int:
    try:
        return len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except AttributeError:
        return os.cpu_count() or 1


class Workers:
    """PIL worker processes taking from the front of `claims`; `poll()` gathers what they report.

    With `n <= 1` nothing is started: `run_here()` decodes in the calling process (the tests' audit
    hook sees those opens, and a handful of files is not worth a process start).
    """

    def __init__(self, n: int, out: str, shape: tuple[int, int, int, int], paths: Sequence[str], order: Sequence[int], claims: Claims,
                 ctx: Any) -> None:
        self.args = (out, shape, paths, order, claims)
        self.done = 0
        self.bad: dict[int, str] = {}
        self.procs: list[Any] = []
        self.q = ctx.SimpleQueue() if n > 1 else None
        if n > 1:
            from PIL import Image  # noqa: F401 - imported before forking: no child imports it again, or waits on an import lock
        for _ in range(n if n > 1 else 0):
            p = ctx.Process(target=_worker, args=(*self.args, self.q), daemon=True)
            p.start()
            self.procs.append(p)
        self.running = len(self.procs)

    def run_here(self) -> None:
        def report(n: int, bad: list[tuple[int, str]]) -> None:
            self.done += n
            self.bad.update(bad)

        _decode_claims(*self.args, report)

    def poll(self, wait: float) -> bool:
        """Collect reports for up to `wait` seconds; False once every worker has finished."""
        if self.q is None:
            return False
        end = time.perf_counter() + wait
        while self.running and time.perf_counter() < end:
            if self.q.empty():
                if not any(p.is_alive() for p in self.procs) and self.q.empty():
                    codes = [p.exitcode for p in self.procs]
                    raise RuntimeError(f"an image decoding worker ended without finishing (exit codes {codes}); rerun, or set dataset.workers: 1")
                time.sleep(0.005)
                continue
            msg = self.q.get()
            if msg is None:
                self.running -= 1
            else:
                self.done += msg[0]
                self.bad.update(msg[1])
        return self.running > 0

    def join(self) -> None:
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()

    def stop(self) -> None:
        """End the workers now (the build was interrupted or failed): a long-lived process keeps no decoders behind."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)


def context() -> Any:
    """fork on Linux (no re-import, nothing pickled); spawn on macOS, where fork is unsafe."""
    return mp.get_context("spawn" if sys.platform == "darwin" else "fork")


class Meter:
    """A one-line progress display on stderr with images per second since the build began (plain text, so logs stay readable)."""

    def __init__(self, label: str, total: int, stream=None, t0: Optional[float] = None) -> None:  # type: ignore[no-untyped-def]
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter() if t0 is None else t0
        self.last = 0.0
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int, final: str = "") -> None:
        now = time.perf_counter()
        if not final and (done == 0 or done >= total or now - self.last < (0.25 if self.tty else 5.0)):
            return  # the last line is the caller's, with the whole build's time
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        line = f"{self.label}: {done:,}/{total:,} images ({100 * done / max(total, 1):.0f}%), {rate:,.0f} img/s" + final
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


def is_jpeg(path: str) -> bool:
    """By the name's ending: a string test (pathlib's suffix cost 0.25 s over 20,000 calls on the H100 machine's CPU)."""
    return path[-4:].lower() in (".jpg", ".jpe") or path[-5:].lower() in (".jpeg", ".jfif")
