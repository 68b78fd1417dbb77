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

import functools
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

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

BACKENDS: tuple[str, ...] = ("cpu", "mps", "cuda")

T = TypeVar("T")

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

_SUBPROCESS_TIMEOUT_S = 2.0
_GIB = 1024**3


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


# --------------------------------------------------------------------------- helpers


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


def _mps_built() -> bool:
    return bool(torch.backends.mps.is_built())


def _mps_available() -> bool:
    return bool(torch.backends.mps.is_available())


def mps_min_macos(torch_version: str | None = None) -> tuple[int, int]:
    """Oldest macOS on which this torch's MPS backend initialises (see table above)."""
    tv = _parse_version(torch_version or torch.__version__) or (0, 0)
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
            return f"torch<{_fmt(newer_first)}"
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
        "min_macos": _fmt(min_macos),
        "PYTORCH_ENABLE_MPS_FALLBACK": fallback if fallback is not None else "unset",
    }

    def status(usable: bool, reason: str | None = None, hint: str | None = None) -> BackendStatus:
        return BackendStatus("mps", usable, reason, hint, details)

    built = _safe(_mps_built, False)
    details["built"] = _yn(built)

    if sys.platform != "darwin":
        details["available"] = _yn(_safe(_mps_available, False))
        return status(
            False,
            f"this is {_os_name()}, not macOS; MPS needs an Apple-silicon Mac",
            "run with device=cpu here (or device=cuda on an NVIDIA machine), or add device_fallback to the recipe",
        )

    macos = _macos_version()
    machine = _machine()
    rosetta = _safe(_is_rosetta, False)
    details["macos"] = macos or "unknown"
    details["machine"] = machine
    details["rosetta"] = _yn(rosetta)
    chip = _mac_chip()
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

    available = _safe(_mps_available, False)
    details["available"] = _yn(available)

    mv = _parse_version(macos)
    if mv is not None and mv < min_macos and not available:
        older = _newest_torch_for_macos(mv)
        hint = f"upgrade macOS to {_fmt(min_macos)} or newer"
        if older:
            hint += f", or install {older} which still supports macOS {macos}"
        return status(
            False,
            f"macOS {macos} is older than {_fmt(min_macos)}, the minimum for MPS in torch {tv}",
            hint,
        )
    if mv is not None and mv < min_macos and available:
        # torch is authoritative: a custom build may support an older OS than our table.
        details["note"] = f"macOS below table minimum {_fmt(min_macos)} but torch reports MPS available"

    if not available:
        return status(
            False,
            f"torch.backends.mps.is_available() is False although torch has MPS and "
            f"macOS {macos or '?'} is new enough: no Metal GPU is visible to this process",
            "sandboxes (agent/CI seatbelt sandboxes, VMs, some remote sessions) hide Metal; "
            "run from a normal Terminal session and check `system_profiler SPDisplaysDataType`",
        )

    def _rec_mem() -> str:
        return f"{torch.mps.recommended_max_memory() / _GIB:.1f}"

    rec = _safe(_rec_mem, "")
    if rec:
        details["recommended_max_memory_gib"] = rec
    return status(True)


def _cuda_driver_version() -> str | None:
    """NVIDIA driver version without initialising CUDA when possible."""
    fn = getattr(torch.cuda, "driver_version", None)
    if callable(fn):
        v = _safe(fn, None)
        if v:
            return str(v)

    def _proc() -> str | None:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 ..."
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([0-9][0-9.]+)", fh.read())
        return m.group(1) if m else None

    if sys.platform.startswith("linux"):
        v = _safe(_proc, None)
        if v:
            return v
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def cuda_status() -> BackendStatus:
    """Diagnose CUDA; distinguishes a CPU-only torch, hidden GPUs and a missing driver."""
    tv = torch.__version__
    runtime = _safe(lambda: torch.version.cuda, None)
    hip = _safe(lambda: getattr(torch.version, "hip", None), None)
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
    available = _safe(torch.cuda.is_available, False)
    count = _safe(torch.cuda.device_count, 0)
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

    cudnn = _safe(lambda: torch.backends.cudnn.version(), None)
    details["cudnn"] = str(cudnn) if cudnn else "none"
    for i in range(count):
        props = _safe(lambda i=i: torch.cuda.get_device_properties(i), None)
        if props is None:
            details[f"gpu{i}"] = "unknown"
            continue
        details[f"gpu{i}"] = str(props.name)
        details[f"gpu{i}.capability"] = f"{props.major}.{props.minor}"
        details[f"gpu{i}.memory_gib"] = f"{props.total_memory / _GIB:.1f}"
    return status(True)


def cpu_status() -> BackendStatus:
    """The CPU is always usable; the details explain its speed (cores vs torch threads)."""
    phys = _physical_cores()
    details = {
        "brand": _cpu_brand(),
        "arch": _machine(),
        "cores_logical": str(os.cpu_count() or "unknown"),
        "cores_physical": str(phys) if phys else "unknown",
        "torch_threads": str(_safe(torch.get_num_threads, "unknown")),
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
    if _safe(torch.cuda.is_available, False):
        return torch.device("cuda")
    if _safe(_mps_available, False):
        return torch.device("mps")
    return torch.device("cpu")


def run_tags(device: torch.device | str | None = None) -> dict[str, str]:
    """Namespaced string tags describing where a run executed; never raises.

    ``device`` None means the device mpsrun would pick (cuda > mps > cpu).
    """
    tags: dict[str, str] = {}

    def put(key: str, fn: Callable[[], object]) -> None:
        value = _safe(fn, None)
        tags[key] = "unknown" if value is None else str(value)

    dev = _safe(lambda: torch.device(device) if device is not None else _default_device(), None)
    if dev is None:
        dev = torch.device("cpu")
    dtype = dev.type
    darwin = sys.platform == "darwin"
    cuda_ok = _safe(torch.cuda.is_available, False)

    # cpu.*
    put("cpu.brand", _cpu_brand)
    put("cpu.cores_logical", lambda: os.cpu_count())
    put("cpu.torch_threads", torch.get_num_threads)
    put("cpu.arch", _machine)

    # mps.*
    put("mps.built", lambda: _yn(_mps_built()))
    put("mps.available", lambda: _yn(_mps_available()))
    if darwin:
        put("mps.macos", lambda: _macos_version() or None)

    # cuda.*
    put("cuda.available", lambda: _yn(cuda_ok))
    put("cuda.runtime", lambda: torch.version.cuda or "none")
    put("cuda.device_count", lambda: torch.cuda.device_count() if cuda_ok else 0)

    # device.*
    tags["device.type"] = dtype
    if dtype == "cuda":
        idx = dev.index
        if idx is None:
            idx = _safe(torch.cuda.current_device, 0)
        tags["device.index"] = str(idx)
        props = _safe(lambda: torch.cuda.get_device_properties(idx), None)
        if props is not None:
            tags["device.name"] = str(props.name)
            tags["cuda.capability"] = f"{props.major}.{props.minor}"
            tags["cuda.memory_gib"] = f"{props.total_memory / _GIB:.1f}"
        else:
            tags["device.name"] = "unknown"
        put("cuda.driver", _cuda_driver_version)
    elif dtype == "mps":
        chip = _safe(_mac_chip, None)
        tags["device.name"] = f"Apple GPU ({chip})" if chip else "Apple GPU"
    else:
        tags["device.name"] = tags["cpu.brand"]

    # sw.* and the duplicates kept for the tag contract
    sw = _safe(software_versions, {})
    for key in ("torch", "torchvision", "mlflow", "python", "numpy"):
        tags[f"sw.{key}"] = str(sw.get(key, "unknown"))
    put("os.platform", platform.platform)
    tags["torch.version"] = tags["sw.torch"]
    tags["python.version"] = tags["sw.python"]
    return tags
