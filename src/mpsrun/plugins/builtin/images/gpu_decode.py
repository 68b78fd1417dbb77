"""JPEG decoding on a CUDA GPU with nvJPEG (`torchvision.io.decode_jpeg(device="cuda")`).

Why: a 16-core host decodes a few thousand small JPEGs per second with PIL; nvJPEG on an
H100 decodes batches of them in a fraction of that time, and the resize runs there too.
It starts late (CUDA context, nvJPEG handles, the resize kernels: seconds on a fresh
process), so it runs on a thread beside the PIL workers (`decode.Claims`): they decode from
the front of the list while it starts, it takes batches from the back once ready. Files are
read by a thread pool (reading releases the GIL), decoded in batches, cropped to the
target's aspect ratio and resized with antialiasing (as PIL's resize does) in one call per
batch of same-sized images, and copied into the same uint8 memory map the CPU path fills
on a writer thread while the next batch decodes. Anything nvJPEG refuses (a corrupt file,
an unusual JPEG) is returned to the caller, which sends it through PIL: so corrupt files
are judged the same way on every machine. So is, before decoding, any JPEG nvJPEG would
not show as a photo viewer does (`for_pil`: an EXIF orientation, CMYK): the same pixels on
every machine, counted by reason in `Thread.passed` for the build to say.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

import numpy as np

BATCH = 256
AHEAD = 3  # batches whose files are being read while one decodes
READERS = 16  # threads reading files (I/O releases the GIL; a page-cache read is a memcpy)


def available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def warm(device: str, c: int) -> None:
    """Start everything the first batch would wait for: the CUDA context, nvJPEG, the resize kernels."""
    import torch
    import torch.nn.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg

    tiny = encode_jpeg(torch.zeros((3, 16, 16), dtype=torch.uint8))
    img = decode_jpeg([tiny, tiny], mode=ImageReadMode.GRAY if c == 1 else ImageReadMode.RGB, device=device)[0]
    F.interpolate(img[None].float(), size=(8, 8), mode="bilinear", antialias=True, align_corners=False)
    if device == "cuda":
        torch.cuda.synchronize()


def decode_gpu(
    paths: Sequence[str],
    order: Sequence[int],
    claim: Callable[[int], range],
    arr: np.ndarray,
    progress: Optional[Callable[[int], None]] = None,
    device: str = "cuda",
    passed: Optional[dict[str, int]] = None,
) -> list[tuple[int, str]]:
    """Decode the JPEGs at the positions `claim(BATCH)` hands out (rows `order[pos]` of `arr`, (N, C, H, W)) until it
    hands out none; returns the (index, path) pairs left for PIL. `progress(n)` after each batch.

    `device`: "cuda" in use; "cpu" runs the same code with torchvision's CPU decoder (the tests do).
    `passed` counts, by reason (`for_pil`), the files handed to PIL before decoding.
    """
    import threading

    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    _, c, h, w = arr.shape
    mode = ImageReadMode.GRAY if c == 1 else ImageReadMode.RGB
    left: list[tuple[int, str]] = []
    lock = threading.Lock()  # `passed` is counted from the reader threads

    def read(p: str) -> Optional[torch.Tensor]:
        """The file's bytes, or None for PIL: unreadable, or a JPEG nvJPEG would not show as a viewer does."""
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError:
            return None
        why = for_pil(data)
        if why is not None:
            if passed is not None:
                with lock:
                    passed[why] = passed.get(why, 0) + 1
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    with ThreadPoolExecutor(max_workers=READERS) as pool, ThreadPoolExecutor(max_workers=1) as writer:

        def submit() -> Optional[tuple[list[int], list[str], list[Future]]]:
            got = claim(BATCH)
            if not got:
                return None
            idx = [order[p] for p in got]
            ps = [paths[i] for i in idx]
            return idx, ps, [pool.submit(read, p) for p in ps]

        ahead: deque = deque()
        for _ in range(AHEAD):
            nxt = submit()
            if nxt is None:
                break
            ahead.append(nxt)
        writes: deque = deque()
        while ahead:
            idx, ps, futures = ahead.popleft()
            nxt = submit()
            if nxt is not None:
                ahead.append(nxt)
            datas = [f.result() for f in futures]
            ok = [(i, p, d) for i, p, d in zip(idx, ps, datas) if d is not None and d.numel() > 0]
            left += [(i, p) for i, p, d in zip(idx, ps, datas) if d is None or d.numel() == 0]
            try:
                images = decode_jpeg([d for _, _, d in ok], mode=mode, device=device)
                pairs = list(zip(ok, images))
            except Exception:  # one bad file fails the batch: decode one by one, the refused go to PIL
                pairs = []
                for item in ok:
                    try:
                        pairs.append((item, decode_jpeg(item[2], mode=mode, device=device)))
                    except Exception:
                        left.append((item[0], item[1]))
            if pairs:
                rows = np.asarray([item[0] for item, _ in pairs], dtype=np.int64)
                out = _fit_all([img for _, img in pairs], h, w).cpu()
                while len(writes) > 1:  # at most one write behind: bounded memory
                    writes.popleft().result()
                writes.append(writer.submit(_store, arr, rows, out.numpy()))
            if progress is not None:
                progress(len(idx))
        for f in writes:
            f.result()
    if device == "cuda":
        torch.cuda.empty_cache()  # give the decode buffers back: the resident rule reads the free memory
    return left


SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # start-of-frame markers
XMP = b"http://ns.adobe.com/xap/1.0/\0"
INSPECTED = SOF | {0xE1, 0xEE}  # EXIF / XMP, Adobe, start of frame


def for_pil(data: bytes) -> Optional[str]:
    """None when nvJPEG decodes this JPEG as a photo viewer shows it; else why PIL decodes it instead.

    Read from the markers before the image data (a few hundred bytes, no decoding): an EXIF (or XMP)
    orientation, which nvJPEG does not apply (torchvision applies it on the CPU only); four components
    (CMYK, YCCK: nvJPEG's colours differ from PIL's, Adobe's inverted CMYK included) or RGB stored
    without YCbCr (Adobe transform 0); 12-bit, lossless or arithmetic coding; and anything that does not
    parse as a JPEG header or lacks the end marker (PIL judges it, so a corrupt or truncated file is named
    the same way on every machine).
    """
    n = len(data)
    if data[:2] != b"\xff\xd8":
        return "not a JPEG header"
    if data[-2:] != b"\xff\xd9" and data.rstrip(b"\0\r\n ")[-2:] != b"\xff\xd9":
        return "no JPEG end marker"  # truncated (PIL refuses it, nvJPEG may not), or data after the image
    i, adobe_rgb, view = 2, False, memoryview(data)  # segments viewed, not copied (an EXIF block can be 64 KiB)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return "not a JPEG header"
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if marker == 0xDA:  # start of scan: the header is over
            return None
        if marker not in INSPECTED:  # tables, JFIF, comments: skipped without a copy
            i += 2 + length
            continue
        seg = view[i + 4 : i + 2 + length]
        if marker == 0xE1 and seg[:6] == b"Exif\0\0" and _exif_orientation(seg[6:]) != 1:
            return "EXIF orientation"
        if marker == 0xE1 and seg[: len(XMP)] == XMP and b"Orientation" in bytes(seg):
            return "EXIF orientation"
        if marker == 0xEE and seg[:5] == b"Adobe" and len(seg) >= 12 and seg[11] == 0:
            adobe_rgb = True
        if marker in SOF:
            if marker not in (0xC0, 0xC1, 0xC2) or len(seg) < 6 or seg[0] != 8:
                return "12-bit, lossless or arithmetic JPEG"
            comps = seg[5]
            if comps == 4:
                return "CMYK JPEG"
            if comps not in (1, 3):
                return "unusual JPEG"
            if comps == 3 and (adobe_rgb or bytes(seg[6:15:3]) == b"RGB"):
                return "RGB-coded JPEG"
        i += 2 + length
    return "not a JPEG header"


def _exif_orientation(tiff: memoryview) -> int:
    """Tag 0x0112 of the first IFD of an EXIF block (TIFF layout); 1 when absent, 0 when it does not parse."""
    import struct

    try:
        e = "<" if tiff[:2] == b"II" else ">" if tiff[:2] == b"MM" else ""
        if not e:
            return 0
        (ifd,) = struct.unpack(e + "I", tiff[4:8])
        (count,) = struct.unpack(e + "H", tiff[ifd : ifd + 2])
        for k in range(count):
            at = ifd + 2 + 12 * k
            tag, typ = struct.unpack(e + "HH", tiff[at : at + 4])
            if tag == 0x0112:
                return struct.unpack(e + "H", tiff[at + 8 : at + 10])[0] if typ == 3 else 0
    except struct.error:
        return 0
    return 1


def _store(arr: np.ndarray, rows: np.ndarray, block: np.ndarray) -> None:
    """Rows into the map's file: one `pwrite` when they are consecutive (the usual case; a system call rather
    than a page fault per 4 KiB of a fresh file), else a scatter through the map."""
    consecutive = rows[-1] - rows[0] + 1 == len(rows) and (np.diff(rows) == 1).all()
    filename = getattr(arr, "filename", None)
    if consecutive and filename and hasattr(os, "pwrite"):
        fd = os.open(filename, os.O_WRONLY)
        try:
            data, offset = memoryview(np.ascontiguousarray(block)).cast("B"), int(rows[0]) * block[0].nbytes
            while len(data):
                n = os.pwrite(fd, data, offset)
                data, offset = data[n:], offset + n
        finally:
            os.close(fd)
    elif consecutive:
        arr[int(rows[0]) : int(rows[-1]) + 1] = block
    else:
        arr[rows] = block


def _fit_all(images: list[Any], h: int, w: int) -> Any:
    """(n, C, h, w) uint8 on the images' device: same-sized images cropped and resized in one call."""
    import torch

    out = torch.empty((len(images), images[0].shape[0], h, w), dtype=torch.uint8, device=images[0].device)
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, img in enumerate(images):
        groups.setdefault(tuple(img.shape), []).append(j)
    for shape, js in groups.items():
        stack = torch.stack([images[j] for j in js]) if len(js) > 1 else images[js[0]][None]
        out[torch.tensor(js, device=out.device) if len(js) < len(images) else slice(None)] = _fit(stack, h, w)
    return out


def _fit(img: Any, h: int, w: int) -> Any:
    """(n, C, h0, w0) -> (n, C, h, w): centre-crop to the target's aspect ratio, then resize with antialiasing."""
    import torch.nn.functional as F

    h0, w0 = img.shape[-2:]
    s = max(w / w0, h / h0)
    ch, cw = min(h0, max(1, round(h / s))), min(w0, max(1, round(w / s)))
    top, left = (h0 - ch) // 2, (w0 - cw) // 2
    crop = img[..., top : top + ch, left : left + cw]
    if (ch, cw) == (h, w):  # already the cache's size (a folder written at that size): no resampling
        return crop
    crop = F.interpolate(crop.float(), size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    return crop.round_().clamp_(0, 255).to(img.dtype)


class Thread:
    """The GPU decoder on a thread: warms up, then takes batches from the back of the claims.

    `init_s` (warm-up seconds), `decoded` (images it decoded), `left` (refused, for PIL), `error`
    (why it could not run: the caller says so on screen and in the run's tags) and `absent` (no CUDA
    GPU: nothing to say) are read after `join()`.
    """

    def __init__(self, paths: Sequence[str], order: Sequence[int], claim: Callable[[int], range], arr: np.ndarray, device: str = "cuda") -> None:
        import threading

        self.claimed: list[int] = []  # positions taken: if decoding fails midway, all of them go back to PIL

        def take(k: int) -> range:
            got = claim(k)
            self.claimed += got
            return got

        self.args = (paths, order, take, arr)
        self.device = device
        self.init_s = 0.0
        self.decoded = 0
        self.left: list[tuple[int, str]] = []
        self.passed: dict[str, int] = {}  # files handed to PIL before decoding, by reason (`for_pil`)
        self.error: Optional[str] = None
        self.absent = False  # no CUDA GPU here: it ended without taking anything, and nothing is said
        self.checked = threading.Event()  # set once it knows whether there is a GPU
        self.thread = threading.Thread(target=self._run, name="mpsrun-nvjpeg", daemon=True)
        self.thread.start()

    def _count(self, n: int) -> None:
        self.decoded += n

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.device == "cuda" and not available():  # asked here, after the PIL workers are forked (see cache._build)
                self.absent = True
                return
        finally:
            self.checked.set()
        try:
            warm(self.device, self.args[3].shape[1])
        except Exception as e:  # no usable nvJPEG: PIL takes every file; said by the caller
            self.error = f"{type(e).__name__}: {str(e)[:160]}"
            return
        finally:
            self.init_s = time.perf_counter() - t0
        try:
            self.left = decode_gpu(*self.args, progress=self._count, device=self.device, passed=self.passed)
        except Exception as e:  # midway: PIL decodes every file this thread took (rows written twice are the same file)
            self.error = f"{type(e).__name__}: {str(e)[:160]}"
            paths, order = self.args[0], self.args[1]
            self.left = [(order[p], paths[order[p]]) for p in self.claimed]

    def handed(self) -> str:
        """The files given to PIL before decoding, by reason, for the build's line ('' when none): a file nvJPEG
        would show otherwise than a viewer is a slower path, said rather than silent."""
        n = sum(self.passed.values())
        return f" ({n:,} given to PIL: " + ", ".join(f"{why} {k:,}" for why, k in sorted(self.passed.items())) + ")" if n else ""

    def join(self) -> None:
        self.thread.join()
