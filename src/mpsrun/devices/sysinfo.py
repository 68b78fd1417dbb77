"""Facts about the compute backends (CPU, Apple MPS, NVIDIA CUDA) and the software stack.

Used by ``mpsrun doctor`` to explain *why* a backend cannot be used, and by the
tracker to stamp every MLflow run with the hardware/software it ran on, so that
numbers from different machines are never compared blindly.

Everything here is a cheap probe: no tensors are allocated, mlflow is never
imported (only its installed version is read), and subprocesses are short and
time-limited. Each probe is wrapped so that a broken driver or an odd platform
degrades to "unknown" instead of crashing a training run.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable

import torch

from mpsrun.devices import backends, host
from mpsrun.devices.backends import (  # noqa: F401 - the public face of device facts
    BACKENDS,
    BackendStatus,
    backend_status,
    cpu_status,
    cuda_status,
    mps_min_macos,
    mps_status,
)

__all__ = [
    "BackendStatus",
    "mps_status",
    "cuda_status",
    "cpu_status",
    "backend_status",
    "software_versions",
    "run_tags",
    "mps_min_macos",
    "BACKENDS",
]


# --------------------------------------------------------------------------- software & tags


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - broken metadata
            continue
    return "absent"


def software_versions() -> dict[str, str]:
    """Installed versions; mlflow is read from metadata so it is never imported."""
    # torch.__version__ keeps the local label (+cu130 / +cpu) that the wheel metadata may drop.
    torch_v = str(getattr(torch, "__version__", "")) or _dist_version("torch")
    return {
        "python": platform.python_version(),
        "torch": torch_v,
        "torchvision": _dist_version("torchvision"),
        "mlflow": _dist_version("mlflow", "mlflow-skinny"),
        "numpy": _dist_version("numpy"),
    }


def _default_device() -> torch.device:
    if host._safe(torch.cuda.is_available, False):
        return torch.device("cuda")
    if host._safe(backends._mps_available, False):
        return torch.device("mps")
    return torch.device("cpu")


def run_tags(device: torch.device | str | None = None) -> dict[str, str]:
    """Namespaced string tags describing where a run executed; never raises.

    ``device`` None means the device mpsrun would pick (cuda > mps > cpu).
    """
    tags: dict[str, str] = {}

    def put(key: str, fn: Callable[[], object]) -> None:
        value = host._safe(fn, None)
        tags[key] = "unknown" if value is None else str(value)

    dev = host._safe(lambda: torch.device(device) if device is not None else _default_device(), None)
    if dev is None:
        dev = torch.device("cpu")
    dtype = dev.type
    darwin = sys.platform == "darwin"
    cuda_ok = host._safe(torch.cuda.is_available, False)

    # cpu.*
    put("cpu.brand", host._cpu_brand)
    put("cpu.cores_logical", lambda: os.cpu_count())
    put("cpu.torch_threads", torch.get_num_threads)
    put("cpu.arch", host._machine)

    # mps.*
    put("mps.built", lambda: host._yn(backends._mps_built()))
    put("mps.available", lambda: host._yn(backends._mps_available()))
    if darwin:
        put("mps.macos", lambda: host._macos_version() or None)

    # cuda.*
    put("cuda.available", lambda: host._yn(cuda_ok))
    put("cuda.runtime", lambda: torch.version.cuda or "none")
    put("cuda.device_count", lambda: torch.cuda.device_count() if cuda_ok else 0)

    # device.*
    tags["device.type"] = dtype
    if dtype == "cuda":
        idx = dev.index
        if idx is None:
            idx = host._safe(torch.cuda.current_device, 0)
        tags["device.index"] = str(idx)
        props = host._safe(lambda: torch.cuda.get_device_properties(idx), None)
        if props is not None:
            tags["device.name"] = str(props.name)
            tags["cuda.capability"] = f"{props.major}.{props.minor}"
            tags["cuda.memory_gib"] = f"{props.total_memory / host._GIB:.1f}"
        else:
            tags["device.name"] = "unknown"
        put("cuda.driver", backends._cuda_driver_version)
    elif dtype == "mps":
        chip = host._safe(host._mac_chip, None)
        tags["device.name"] = f"Apple GPU ({chip})" if chip else "Apple GPU"
    else:
        tags["device.name"] = tags["cpu.brand"]

    # sw.* and the duplicates kept for the tag contract
    sw = host._safe(software_versions, {})
    for key in ("torch", "torchvision", "mlflow", "python", "numpy"):
        tags[f"sw.{key}"] = str(sw.get(key, "unknown"))
    put("os.platform", platform.platform)
    tags["torch.version"] = tags["sw.torch"]
    tags["python.version"] = tags["sw.python"]
    return tags
