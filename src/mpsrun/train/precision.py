"""The precision a run uses on its device: one decision for a run's options and a fused sweep group's autocast."""

from __future__ import annotations

import torch


def resolve_precision(precision: str, device: torch.device) -> tuple[str, str]:
    """The precision a run uses on this device (`auto` is fp32) and, where bf16 cannot be had there, why not
    (the run then says so and uses fp32; a fused sweep group runs its trials unfused instead)."""
    precision = "fp32" if precision == "auto" else precision
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "fp32", "precision bf16 is not supported by this GPU; using fp32"
    if precision == "bf16" and device.type == "mps" and not _mps_macos_at_least(14):
        return "fp32", "precision bf16 on MPS needs macOS 14 or newer; using fp32"
    return precision, ""


def _mps_macos_at_least(major: int) -> bool:
    try:
        return bool(torch.backends.mps.is_macos_or_newer(major, 0))
    except Exception:
        return False
