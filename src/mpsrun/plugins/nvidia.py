"""NVIDIA GPUs as the Linux driver lists them, without starting CUDA.

Why: `torch.cuda.is_available()` starts the CUDA driver (0.3-0.4 s on the H100 machine); a
question that only needs "is there an NVIDIA GPU here, and how many may this process use"
(the sweep's note on workers sharing one, the image cache deciding whether nvJPEG could help)
reads the driver's `/proc` entries instead. It lives with the plugins (not `devices/`) because the
package's wings let plugins import only plugins and recipes, and the sweep may import plugins.
"""

from __future__ import annotations

import os
from typing import Optional

PROC = "/proc/driver/nvidia/gpus"  # one folder per GPU the Linux driver manages


def visible_gpus(proc: str = PROC) -> Optional[int]:
    """NVIDIA GPUs this process may use: the driver's, narrowed by CUDA_VISIBLE_DEVICES; None where there is no driver."""
    try:
        n = len(os.listdir(proc))
    except OSError:
        return None
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        n = min(n, len([d for d in cvd.split(",") if d.strip() and not d.strip().startswith("-")]))
    return n
