"""Devices: which one runs, how to wait for it, and how much memory it used.

Every clock read in the runner goes through `synchronize` here, so timings are
of finished device work, not of queued kernels.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field

import torch

from mpsrun.devices import sysinfo

AUTO_ORDER = ("cuda", "mps", "cpu")


class DeviceUnavailable(Exception):
    """The requested device cannot run here and no fallback allows another: exit 2."""


@dataclass
class DeviceChoice:
    """The device that runs, and the story of how it was chosen (recorded on the run)."""

    requested: str
    device: torch.device
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (device, why unusable)

    @property
    def fell_back(self) -> bool:
        return bool(self.skipped) and self.requested != "auto"

    def warning(self) -> str | None:
        if not self.fell_back:
            return None
        why = "; ".join(f"{d}: {r}" for d, r in self.skipped)
        return f"device '{self.requested}' is unusable ({why}); falling back to '{self.device}'"


def unusable_reason(name: str) -> str | None:
    """None when `name` (cpu, mps, cuda, cuda:N) can run here, else why not."""
    kind, _, index = name.partition(":")
    status = sysinfo.backend_status(kind)
    if not status.usable:
        return status.reason or f"{kind} is unusable"
    if kind == "cuda" and index:
        count = torch.cuda.device_count()
        if int(index) >= count:
            return f"cuda:{index} does not exist; this machine has {count} CUDA device(s)"
    return None


def resolve(requested: str, fallback: list[str] | None = None) -> DeviceChoice:
    """Pick the device: `auto` tries cuda, mps, cpu; else the request, then each fallback."""
    if requested == "auto":
        skipped = []
        for name in AUTO_ORDER:
            why = unusable_reason(name)
            if why is None:
                return DeviceChoice("auto", torch.device(name), skipped)
            skipped.append((name, why))
        raise DeviceUnavailable("no usable device")  # cpu is always usable; defensive
    skipped = []
    for name in [requested, *(fallback or [])]:
        if name == "auto":
            return resolve("auto")
        why = unusable_reason(name)
        if why is None:
            return DeviceChoice(requested, torch.device(name), skipped)
        skipped.append((name, why))
    lines = [f"device '{d}' is unusable: {r}" for d, r in skipped]
    hint = "" if fallback else " Add `device_fallback: [cpu]` to the recipe, or run with device=cpu."
    raise DeviceUnavailable("; ".join(lines) + "." + hint)


def make_current(device: torch.device) -> None:
    """`cuda:N` made this process's current CUDA device (a no-op elsewhere, and for plain `cuda`).

    Why: Triton launches its kernels, and `torch.cuda.graph` captures, on the current device,
    not the tensors' own. A run on `cuda:1` (a sweep's second worker on a 2-GPU host, or
    `device=cuda:1`) otherwise handed Triton pointers from another GPU ("cannot be accessed
    from Triton") and captured empty graphs; found on 2x H100. A process trains on one device.
    """
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    """Wait until all queued work on `device` is done; a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_bytes(device: torch.device) -> int:
    """Peak (CUDA: max allocated; CPU: process peak RSS) or current (MPS: driver allocated) bytes.

    MPS exposes no peak counter, so callers sample it at epoch ends and keep the max.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def memory_kind(device: torch.device) -> str:
    return {"cuda": "max_allocated", "mps": "driver_allocated"}.get(device.type, "peak_rss")


def free_memory_bytes(device: torch.device) -> int | None:
    """Room left for a device-resident dataset; None when unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        try:
            return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
        except Exception:
            return None
    return None


def choice_tags(choice: DeviceChoice) -> dict[str, str]:
    """Tags of the requested and actual device plus what it ran on."""
    tags = sysinfo.run_tags(choice.device)
    tags["device.requested"] = choice.requested
    tags["device.actual"] = str(choice.device)
    tags["device.fallback"] = "true" if choice.fell_back else "false"
    if choice.skipped:
        tags["device.skipped"] = "; ".join(f"{d}: {r}" for d, r in choice.skipped)[:4000]
    return tags
