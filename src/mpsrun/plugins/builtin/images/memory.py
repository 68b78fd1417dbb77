"""How much host memory a data set may hold before it streams from disk (the image plugins' `host_max_gb`).

Small and dependency-free on purpose: the training wing reads the same figures (train/loop/feed/place.py)
without importing the decoders.
"""

from __future__ import annotations

import os
from typing import Optional

HOST_SHARE = 0.5  # of the host's available memory a data set may hold before it streams from disk


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_available() -> Optional[int]:
    """MemAvailable on Linux; free physical pages where sysconf tells them; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def host_budget(value: Optional[float] = None) -> tuple[int, str]:
    """Bytes of host memory the data may hold, and where that figure comes from.

    `value` (GiB: the dataset's `host_max_gb`) wins, then the environment's MPSRUN_HOST_MAX_GB, then
    HOST_SHARE of the memory available now (a cache larger than that is streamed from disk).
    """
    if value is not None:
        if not value > 0:
            raise ValueError(f"dataset.host_max_gb must be more than 0, got {value}")
        return int(float(value) * 2**30), f"dataset.host_max_gb {value}"
    env = os.environ.get("MPSRUN_HOST_MAX_GB", "").strip()
    if env:
        try:
            v = float(env)
        except ValueError:
            raise ValueError(f"MPSRUN_HOST_MAX_GB must be a number of GiB, got {env!r}") from None
        if not v > 0:
            raise ValueError(f"MPSRUN_HOST_MAX_GB must be more than 0, got {env!r}")
        return int(v * 2**30), f"MPSRUN_HOST_MAX_GB={env}"
    avail = host_available()
    if avail is None:
        return 2**62, "host memory unknown: no limit"
    return int(avail * HOST_SHARE), f"{HOST_SHARE:.0%} of the host's available {gib(avail)}"
