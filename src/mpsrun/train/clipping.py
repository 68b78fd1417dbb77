"""Gradient clipping in two kernels on CUDA, for steps where kernel latency is the cost.

Why not just `torch.nn.utils.clip_grad_norm_`: in a CUDA-graphed step of a small
model each kernel costs about 3 us of latency, and torch's clip puts some nine of
them in a row between backward and the optimizer (per-tensor norms in two, stack,
total, epsilon, coefficient, clamp, multiply, and our running max): the fashion
MLP's step went from 102 to 130 us on the H100 (benchmarks/step_kernels_gpu.py).
Norms taken by backward hooks on a side stream were slower still (144 us): the
cross-stream dependencies cost more than the kernels they hide.

What this does, with the same arithmetic (2-norm):
1. one Triton kernel per 8 gradients writes fixed-order partial sums of squares;
2. one single-program Triton kernel adds them up, keeps the epoch's largest norm and
   writes `scale = max(norm / max_norm, 1)`;
3. a fused optimizer (torch's `fused=True` SGD/Adam/AdamW...; `fuse_sgd` in
   schedulers.py switches plain SGD to it) takes `scale` as its `grad_scale` and
   divides the gradients as it reads them, so applying the clip costs nothing. Any
   other optimizer gets one foreach multiply by 1/scale.
The sums run in a fixed order (no atomics), so a replay gives the same bits each time.
The update equals torch's clip up to its 1e-6 epsilon (coef = max_norm / (norm + 1e-6)).
With a fused optimizer the `.grad` tensors stay unclipped; callbacks see backward's.

Used only where it is exact: CUDA, float32 dense gradients, norm_type 2, one process
(DDP averages gradients after backward) and no fp16 GradScaler (scaled gradients).
Everywhere else `Objective.clip` calls torch's clip, and the run's notes say which.
`TorchKernels` runs the same two stages with torch ops: the tests check the wrapper's
arithmetic with it on machines without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SLOTS = 8  # gradients per partial-sum launch
PROGRAMS = 64  # programs per launch: the partial sums each launch writes
BLOCK = 1024


class TorchKernels:
    """The two stages in torch ops: the reference the Triton kernels must match."""

    def partials(self, grads: list[torch.Tensor], out: torch.Tensor) -> None:
        out.zero_()
        out[0] = torch.stack([g.float().pow(2).sum() for g in grads]).sum()

    def finalize(self, partials: torch.Tensor, peak: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor, max_norm: float) -> None:
        total = partials.sum().sqrt()
        torch.maximum(peak, total, out=peak)
        torch.clamp(total / max_norm, min=1.0, out=scale)
        torch.reciprocal(scale, out=inv)


class TritonKernels:
    """The two stages as Triton kernels (compiled once per machine, then from Triton's cache)."""

    def __init__(self) -> None:
        from mpsrun.train import clip_kernels  # imports triton: CUDA machines only, and only when clipping

        self._sumsq, self._finalize = clip_kernels.sumsq, clip_kernels.finalize

    def partials(self, grads: list[torch.Tensor], out: torch.Tensor) -> None:
        for c in range(0, len(grads), SLOTS):
            chunk = grads[c : c + SLOTS]
            args: list[Any] = []
            for j in range(SLOTS):
                g = chunk[j] if j < len(chunk) else chunk[0]
                args += [g, g.numel() if j < len(chunk) else 0]
            self._sumsq[(PROGRAMS,)](out[(c // SLOTS) * PROGRAMS :], *args, BLOCK=BLOCK)

    def finalize(self, partials: torch.Tensor, peak: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor, max_norm: float) -> None:
        n = partials.numel()
        self._finalize[(1,)](partials, n, peak, scale, inv, max_norm, BLOCK=max(16, 1 << (n - 1).bit_length()))


class FastClip:
    """Clip by global 2-norm in two kernels; the scale goes to a fused optimizer where there is one."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, device: torch.device, kernels: Any = None) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_norm = float(max_norm)
        self.kernels = kernels if kernels is not None else TritonKernels()
        launches = -(-len(self.params) // SLOTS)
        self.partial = torch.zeros(launches * PROGRAMS, device=device)
        self.peak = torch.zeros((), device=device)  # the epoch's largest pre-clip norm
        self.scale = torch.ones((), device=device)
        self.inv = torch.ones((), device=device)
        self.optimizer = optimizer
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(g.get("fused") for g in optimizer.param_groups)
        if self.fused:
            optimizer.grad_scale = self.scale  # type: ignore[attr-defined]  # read by torch's fused step

    def clip(self) -> None:
        """After backward, before the optimizer step."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        self.kernels.partials(grads, self.partial)
        self.kernels.finalize(self.partial, self.peak, self.scale, self.inv, self.max_norm)
        if not self.fused:
            torch._foreach_mul_(grads, self.inv)

    def read_peak(self) -> float:
        """The epoch's largest pre-clip norm; resets it."""
        value = self.peak.item()
        self.peak.zero_()
        return value

    def remove(self) -> None:
        if self.fused and getattr(self.optimizer, "grad_scale", None) is self.scale:
            del self.optimizer.grad_scale  # type: ignore[attr-defined]


def usable(model: nn.Module, device: torch.device, norm_type: float, fp16_scaler: bool, world_size: int) -> str | None:
    """Why the two-kernel clip cannot be exact (or cannot run) here, or None when it can."""
    if device.type != "cuda":
        return "off CUDA a kernel's latency is not the cost"
    if norm_type != 2.0:
        return f"norm_type {norm_type:g}: the two-kernel clip does the 2-norm only"
    if world_size > 1:
        return "DDP averages gradients after backward"
    if fp16_scaler:
        return "fp16 gradients stay scaled until unscale_"
    for p in model.parameters():
        if p.requires_grad and (p.dtype != torch.float32 or not (p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last)))):
            return "parameters that are not dense float32"
    try:
        import triton  # noqa: F401
    except Exception as e:  # torch's Linux CUDA wheels ship it; other builds may not
        return f"Triton is not importable ({type(e).__name__})"
    return None
