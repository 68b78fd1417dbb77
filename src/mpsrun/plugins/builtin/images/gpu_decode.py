"""JPEG decoding on a CUDA GPU with nvJPEG (`torchvision.io.decode_jpeg(device="cuda")`).

Why: a 16-core host decodes a few thousand small JPEGs per second with PIL; nvJPEG on an
H100 decodes batches of them in a fraction of that time, and the resize runs there too.
Files are read by a thread pool (reading releases the GIL), decoded in batches, cropped to
the target's aspect ratio, resized with antialiasing (as PIL's resize does) and copied
into the same uint8 memory map the CPU path fills. Anything nvJPEG refuses (a corrupt file,
an unusual JPEG) is returned to the caller, which sends it through PIL: so corrupt files are
judged the same way on every machine.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from mpsrun.plugins.builtin.images.decode import Progress

BATCH = 256
AHEAD = 3  # batches whose files are being read while one decodes


def available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def decode_gpu(
    paths: Sequence[str],
    indices: Sequence[int],
    arr: np.ndarray,
    progress: Optional[Progress] = None,
    done_before: int = 0,
    total: int = 0,
    device: str = "cuda",
) -> list[tuple[int, str]]:
    """Decode JPEGs into rows `indices` of `arr` (N, C, H, W); returns the (index, path) pairs left for PIL.

    `device`: "cuda" in use; "cpu" runs the same code with torchvision's CPU decoder (the tests do).
    """
    import torch
    import torch.nn.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg

    _, c, h, w = arr.shape
    mode = ImageReadMode.GRAY if c == 1 else ImageReadMode.RGB
    left: list[tuple[int, str]] = []
    done = done_before

    def read(p: str) -> Optional[torch.Tensor]:
        try:
            with open(p, "rb") as f:
                return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        except OSError:
            return None

    batches = [(list(indices[i : i + BATCH]), list(paths[i : i + BATCH])) for i in range(0, len(paths), BATCH)]
    with ThreadPoolExecutor(max_workers=8) as pool:

        def submit(k: int) -> list:
            return [pool.submit(read, p) for p in batches[k][1]]

        ahead = deque(submit(k) for k in range(min(AHEAD, len(batches))))  # bounded: files are read a few batches ahead
        for k, (idx, ps) in enumerate(batches):
            futures = ahead.popleft()
            if k + AHEAD < len(batches):
                ahead.append(submit(k + AHEAD))
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
            out = torch.empty((len(pairs), c, h, w), dtype=torch.uint8, device=device)
            for j, (_, img) in enumerate(pairs):
                out[j] = _fit(img, h, w, F)
            rows = np.asarray([item[0] for item, _ in pairs], dtype=np.int64)
            if len(rows):
                arr[rows] = out.cpu().numpy()
            done += len(ok)
            if progress is not None:
                progress(done, total or len(paths))
    if device == "cuda":
        torch.cuda.empty_cache()  # give the decode buffers back: the resident rule reads the free memory
    return left


def _fit(img, h: int, w: int, F):  # type: ignore[no-untyped-def]
    """Centre-crop to the target's aspect ratio, then resize to (h, w) with antialiasing."""
    _, h0, w0 = img.shape
    s = max(w / w0, h / h0)
    ch, cw = min(h0, round(h / s)), min(w0, round(w / s))
    top, left = (h0 - ch) // 2, (w0 - cw) // 2
    crop = img[:, top : top + ch, left : left + cw]
    if (ch, cw) == (h, w):  # already the cache's size (a folder written at that size): no resampling
        return crop
    crop = F.interpolate(crop.unsqueeze(0).float(), size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    return crop.round_().clamp_(0, 255).to(img.dtype)[0]
