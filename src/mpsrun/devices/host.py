"""Low-level host probes (OS, CPU, chip, Rosetta, subprocess helpers) shared by
`backends` (can this device train here?) and `sysinfo` (tags for every run).

Each probe is wrapped so that a broken driver or an odd platform degrades to
"unknown" instead of crashing a training run; subprocesses are short and time-limited.
Callers use `host.NAME` rather than importing names, so one patch in a test
reaches every user.
"""

from __future__ import annotations

import functools
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_SUBPROCESS_TIMEOUT_S = 2.0
_GIB = 1024**3


def _safe(fn: Callable[[], T], default: T) -> T:
    """Run a probe; any failure (driver bug, missing binary, odd OS) yields ``default``."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - probes must never break a run
        return default


def _run(cmd: list[str]) -> str | None:
    """stdout of a short command, or None if it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=_SUBPROCESS_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    out = proc.stdout.strip()
    return out or None


def _yn(flag: bool | None) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")


def _parse_version(text: str | None, parts: int = 2) -> tuple[int, ...] | None:
    """Leading numeric components: '14.5' -> (14, 5), '2.9.1+cu130' -> (2, 9)."""
    if not text:
        return None
    nums = re.findall(r"\d+", text.split("+", 1)[0])
    if not nums:
        return None
    vals = [int(n) for n in nums[:parts]]
    while len(vals) < parts:
        vals.append(0)
    return tuple(vals)


def _fmt(ver: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in ver)


def _os_name() -> str:
    plat = sys.platform
    if plat.startswith("linux"):
        return "Linux"
    if plat in ("win32", "cygwin"):
        return "Windows"
    if plat == "darwin":
        return "macOS"
    return plat


def _macos_version() -> str:
    """macOS product version ('14.5'), '' when not on a Mac or unknown."""
    return _safe(lambda: platform.mac_ver()[0], "") or ""


def _machine() -> str:
    """Architecture of *this Python process* (x86_64 under Rosetta, arm64 native)."""
    return _safe(platform.machine, "") or "unknown"


@functools.lru_cache(maxsize=1)
def _is_rosetta() -> bool:
    """True when this process is an x86_64 binary translated by Rosetta 2.

    ``sysctl.proc_translated`` is 1 under Rosetta, 0 natively, and missing on
    Intel Macs (then the command fails and we answer False).
    """
    if sys.platform != "darwin":
        return False
    return _run(["sysctl", "-n", "sysctl.proc_translated"]) == "1"


def _mac_chip() -> str | None:
    """'Apple M2 Max' on a Mac (what MPS runs on), None elsewhere or if sysctl fails."""
    if sys.platform != "darwin":
        return None
    return _run(["sysctl", "-n", "machdep.cpu.brand_string"])


@functools.lru_cache(maxsize=1)
def _cpu_brand() -> str:
    """Human CPU name; cached because it is read for every run's tags."""
    brand = _mac_chip()
    if brand:
        return brand
    if sys.platform.startswith("linux"):

        def _read() -> str | None:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    key, _, value = line.partition(":")
                    # x86 says "model name"; some ARM kernels only say "Hardware"/"Model".
                    if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                        return value.strip()
            return None

        brand = _safe(_read, None)
        if brand:
            return brand
    return _safe(platform.processor, "") or _machine()


@functools.lru_cache(maxsize=1)
def _physical_cores() -> int | None:
    """Physical cores: psutil if installed, else /proc/cpuinfo (Linux) or sysctl (mac)."""
    try:
        import psutil  # optional dependency

        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except Exception:  # noqa: BLE001
        pass
    if sys.platform == "darwin":
        out = _run(["sysctl", "-n", "hw.physicalcpu"])
        return int(out) if out and out.isdigit() else None
    if sys.platform.startswith("linux"):

        def _read() -> int | None:
            cores: set[tuple[str, str]] = set()
            phys = core = ""
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    key, _, value = line.partition(":")
                    key = key.strip()
                    if key == "physical id":
                        phys = value.strip()
                    elif key == "core id":
                        core = value.strip()
                    elif not key and (phys or core):
                        cores.add((phys, core))
                        phys = core = ""
            if phys or core:
                cores.add((phys, core))
            return len(cores) or None

        return _safe(_read, None)
    return None


def since_start() -> float | None:
    """Seconds since this process started, to 10 ms (Linux: /proc; elsewhere None): where a short run's
    wall time goes, measured from where the user's wait begins, not from mpsrun's first line."""
    import os
    import time

    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        return round(time.clock_gettime(time.CLOCK_BOOTTIME) - int(after_name[19]) / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
