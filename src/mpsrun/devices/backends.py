"""Can cpu / mps / cuda train here, and if not, the first blocking cause and what to do.

Used by `mpsrun doctor` and by device resolution; no tensors are allocated.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mpsrun.devices import host

BACKENDS: tuple[str, ...] = ("cpu", "mps", "cuda")

# Minimum macOS for the MPS backend, keyed on the first torch (major, minor) that
# requires it; the newest matching row wins.
#
# Sources:
# * 12.3: MPS launch requirement (torch 1.12), PyTorch docs "MPS backend"
#   (https://pytorch.org/docs/stable/notes/mps.html) and Apple's
#   https://developer.apple.com/metal/pytorch/ ("macOS 12.3 or later").
# * 13.0 from torch 2.5: pytorch/pytorch#133141 ("[MPS][BE] Delete MacOS-12.3
#   specific checks", merged 2024-08 for 2.5) made MPS unavailable before Ventura;
#   confirmed by pytorch/pytorch#139425 (2.5.1 finds no MPS device on macOS 12.7.6,
#   maintainer: "it should have say that you need MacOS 13.0"), and #141182 docs
#   "MPS support needs Ventura+".
# * 14.0 from torch 2.9: pytorch/pytorch#162921 ("in 2.9+ MPS is only supported
#   on MacOS Sonoma+"), #163515 ("PyTorch needs MacOS-14 or newer to use MPS"),
#   #164943 (2.10 nightly unavailable on macOS 13.7.4); the ATen error text became
#   "The MPS backend is supported on MacOS 14.0+", and Apple's page lists
#   "macOS 14.0 or later" for torch 2.11.
_MPS_MIN_MACOS: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = (
    ((2, 9), (14, 0)),
    ((2, 5), (13, 0)),
    ((0, 0), (12, 3)),
)


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend can run training here, and if not, the one thing to fix."""

    name: str
    usable: bool
    reason: str | None = None
    hint: str | None = None
    details: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict, for ``doctor --json``."""
        return asdict(self)



def _mps_built() -> bool:
    return bool(torch.backends.mps.is_built())


def _mps_available() -> bool:
    return bool(torch.backends.mps.is_available())


def mps_min_macos(torch_version: str | None = None) -> tuple[int, int]:
    """Oldest macOS on which this torch's MPS backend initialises (see table above)."""
    tv = host._parse_version(torch_version or torch.__version__) or (0, 0)
    for first_torch, min_macos in _MPS_MIN_MACOS:
        if tv >= first_torch:
            return min_macos
    return _MPS_MIN_MACOS[-1][1]


def _newest_torch_for_macos(macos: tuple[int, ...]) -> str | None:
    """'torch<2.9' style pin that still supports ``macos``, or None if none does."""
    for idx, (first_torch, min_macos) in enumerate(_MPS_MIN_MACOS):
        if macos >= min_macos:
            if idx == 0:
                return None  # the newest torch already supports it
            newer_first = _MPS_MIN_MACOS[idx - 1][0]
            return f"torch<{host._fmt(newer_first)}"
    return None


# --------------------------------------------------------------------------- backends


def mps_status() -> BackendStatus:
    """Diagnose Apple MPS, naming the first blocking cause rather than a generic 'unavailable'."""
    tv = torch.__version__
    min_macos = mps_min_macos(tv)
    fallback = os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK")
    details: dict[str, str] = {
        "platform": sys.platform,
        "torch": tv,
        "min_macos": host._fmt(min_macos),
        "PYTORCH_ENABLE_MPS_FALLBACK": fallback if fallback is not None else "unset",
    }

    def status(usable: bool, reason: str | None = None, hint: str | None = None) -> BackendStatus:
        return BackendStatus("mps", usable, reason, hint, details)

    built = host._safe(_mps_built, False)
    details["built"] = host._yn(built)

    if sys.platform != "darwin":
        details["available"] = host._yn(host._safe(_mps_available, False))
        return status(
            False,
            f"this is {host._os_name()}, not macOS; MPS needs an Apple-silicon Mac",
            "run with device=cpu here (or device=cuda on an NVIDIA machine), or add device_fallback to the recipe",
        )

    macos = host._macos_version()
    machine = host._machine()
    rosetta = host._safe(host._is_rosetta, False)
    details["macos"] = macos or "unknown"
    details["machine"] = machine
    details["rosetta"] = host._yn(rosetta)
    chip = host._mac_chip()
    if chip:
        details["chip"] = chip

    if not built:
        return status(
            False,
            f"this torch {tv} was built without MPS support",
            "install the official macOS arm64 wheel (`pip install -U torch`) "
            "in a native arm64 Python",
        )

    if rosetta:
        return status(
            False,
            "Python is an x86_64 binary running under Rosetta 2; "
            "MPS needs a native arm64 Python",
            "install an arm64 Python (python.org universal2, Homebrew in /opt/homebrew, "
            "or uv), recreate the venv and reinstall torch; check with "
            "`python -c 'import platform; print(platform.machine())'` -> arm64",
        )
    if machine == "x86_64":
        return status(
            False,
            "Python reports an x86_64 machine on macOS (an Intel Mac or an x86_64 Python); "
            "PyTorch's MPS backend supports Apple silicon only",
            "on an Apple-silicon Mac use a native arm64 Python; on an Intel Mac run with device=cpu",
        )

    available = host._safe(_mps_available, False)
    details["available"] = host._yn(available)

    mv = host._parse_version(macos)
    if mv is not None and mv < min_macos and not available:
        older = _newest_torch_for_macos(mv)
        hint = f"upgrade macOS to {host._fmt(min_macos)} or newer"
        if older:
            hint += f", or install {older} which still supports macOS {macos}"
        return status(
            False,
            f"macOS {macos} is older than {host._fmt(min_macos)}, the minimum for MPS in torch {tv}",
            hint,
        )
    if mv is not None and mv < min_macos and available:
        # torch is authoritative: a custom build may support an older OS than our table.
        details["note"] = f"macOS below table minimum {host._fmt(min_macos)} but torch reports MPS available"

    if not available:
        return status(
            False,
            f"torch.backends.mps.is_available() is False although torch has MPS and "
            f"macOS {macos or '?'} is new enough: no Metal GPU is visible to this process",
            "sandboxes (agent/CI seatbelt sandboxes, VMs, some remote sessions) hide Metal; "
            "run from a normal Terminal session and check `system_profiler SPDisplaysDataType`",
        )

    def _rec_mem() -> str:
        return f"{torch.mps.recommended_max_memory() / host._GIB:.1f}"

    rec = host._safe(_rec_mem, "")
    if rec:
        details["recommended_max_memory_gib"] = rec
    return status(True)


def _cuda_driver_version() -> str | None:
    """NVIDIA driver version without initialising CUDA when possible."""
    fn = getattr(torch.cuda, "driver_version", None)
    if callable(fn):
        v = host._safe(fn, None)
        if v:
            return str(v)

    def _proc() -> str | None:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 ..."
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]+)", fh.read())
        return m.group(1) if m else None

    if sys.platform.startswith("linux"):
        v = host._safe(_proc, None)
        if v:
            return v
    out = host._run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def cuda_status() -> BackendStatus:
    """Diagnose CUDA; distinguishes a CPU-only torch, hidden GPUs and a missing driver."""
    tv = torch.__version__
    runtime = host._safe(lambda: torch.version.cuda, None)
    hip = host._safe(lambda: getattr(torch.version, "hip", None), None)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    details: dict[str, str] = {
        "torch": tv,
        "runtime": runtime or ("hip " + hip if hip else "none"),
    }
    if visible is not None:
        details["CUDA_VISIBLE_DEVICES"] = visible

    def status(usable: bool, reason: str | None = None, hint: str | None = None) -> BackendStatus:
        return BackendStatus("cuda", usable, reason, hint, details)

    if runtime is None and not hip:
        details["device_count"] = "0"
        return status(
            False,
            f"this torch {tv} was built without CUDA (torch.version.cuda is None)",
            "install a CUDA wheel, e.g. `pip install torch --index-url "
            "https://download.pytorch.org/whl/cu128`, on a machine with an NVIDIA GPU",
        )

    driver = _cuda_driver_version()
    details["driver"] = driver or "not found"
    available = host._safe(torch.cuda.is_available, False)
    count = host._safe(torch.cuda.device_count, 0)
    details["device_count"] = str(count)

    if not available:
        if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
            return status(
                False,
                f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from this process",
                "unset CUDA_VISIBLE_DEVICES or set it to a GPU index, e.g. CUDA_VISIBLE_DEVICES=0",
            )
        if driver is None:
            return status(
                False,
                f"no NVIDIA driver or GPU found (torch.cuda.is_available() is False, "
                f"device_count={count}); torch is built for CUDA {runtime}",
                "on a machine with an NVIDIA GPU install the NVIDIA driver (check `nvidia-smi`); "
                "otherwise run with device=cpu",
            )
        return status(
            False,
            f"NVIDIA driver {driver} is present but torch.cuda.is_available() is False "
            f"(device_count={count}); the driver may be too old for CUDA {runtime} "
            "or the GPU is not exposed to this process",
            "run `nvidia-smi`; update the driver or install a torch wheel for an older CUDA "
            "(https://pytorch.org/get-started/locally/)",
        )

    cudnn = host._safe(lambda: torch.backends.cudnn.version(), None)
    details["cudnn"] = str(cudnn) if cudnn else "none"
    for i in range(count):
        props = host._safe(lambda i=i: torch.cuda.get_device_properties(i), None)
        if props is None:
            details[f"gpu{i}"] = "unknown"
            continue
        details[f"gpu{i}"] = str(props.name)
        details[f"gpu{i}.capability"] = f"{props.major}.{props.minor}"
        details[f"gpu{i}.memory_gib"] = f"{props.total_memory / host._GIB:.1f}"
    return status(True)


def cpu_status() -> BackendStatus:
    """The CPU is always usable; the details explain its speed (cores vs torch threads)."""
    phys = host._physical_cores()
    details = {
        "brand": host._cpu_brand(),
        "arch": host._machine(),
        "cores_logical": str(os.cpu_count() or "unknown"),
        "cores_physical": str(phys) if phys else "unknown",
        "torch_threads": str(host._safe(torch.get_num_threads, "unknown")),
    }
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp is not None:
        details["OMP_NUM_THREADS"] = omp
    return BackendStatus("cpu", True, None, None, details)


def backend_status(device_type: str) -> BackendStatus:
    """Status for 'cpu' / 'mps' / 'cuda' (an index suffix like 'cuda:1' is ignored)."""
    kind = str(device_type).split(":", 1)[0].strip().lower()
    if kind == "cpu":
        return cpu_status()
    if kind == "mps":
        return mps_status()
    if kind == "cuda":
        return cuda_status()
    return BackendStatus(
        kind or str(device_type),
        False,
        f"unknown device type {device_type!r}",
        "use one of: cpu, mps, cuda",
        {},
    )
