"""Gradient clipping in two kernels on CUDA, for steps where kernel latency is the cost.

With torch's SGD the clip goes further, into the optimizer's own kernel (clip_sgd.py);
this is the path for every other optimizer, and the state and reference both share.

Why not just `torch.nn.utils.clip_grad_norm_`: in a CUDA-graphed step of a small
model each kernel costs about 4 us of latency, and torch's clip puts some nine of
them in a row between backward and the optimizer (per-tensor norms in two, stack,
total, epsilon, coefficient, clamp, multiply, and our running max): the fashion
MLP's step went from 102 to 130 us on the H100 (benchmarks/step_kernels_gpu.py).
Tried and dropped, measured there: norms taken by backward hooks on a side stream
(144 us: the cross-stream dependencies cost more than the kernels they hide), and
handing the scale to fused SGD as its `grad_scale` (130 us: slower than a multiply).

What this does, with torch's arithmetic (2-norm): one Triton kernel (clip_kernels.py)
writes fixed-order partial sums of squares and, in its last program, the norm's
running max and `inv = min(max_norm / norm, 1)`; then one foreach multiply by `inv`.
The sums run in a fixed order (no float atomics): a replay gives the same bits.
The update equals torch's clip up to its 1e-6 epsilon (coef = max_norm / (norm + 1e-6)).

Used only where it is exact: CUDA, float32 dense gradients, norm_type 2, one process
(DDP averages gradients after backward) and no fp16 GradScaler (scaled gradients).
Everywhere else `Objective.clip` calls torch's clip, and the run's notes say which.
`TorchKernels` does the kernel's arithmetic with torch ops: the tests check the
wrapper with it, and the kernel against it in Triton's CPU interpreter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SLOTS = 8  # gradients per partial-sum launch
PROGRAMS = 256  # programs per launch (partial sums each launch writes): enough that each reads
# only a few blocks of the largest gradient, since a program's loop is latency-bound
BLOCK = 1024


class TorchKernels:
    """The kernel's arithmetic in torch ops: the reference the Triton kernel must match."""

    def clip_norm(self, grads: list[torch.Tensor], partials: torch.Tensor, counter: torch.Tensor, peak: torch.Tensor, inv: torch.Tensor, max_norm: float) -> None:
        total = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
        torch.maximum(peak, total, out=peak)
        torch.reciprocal(torch.clamp(total / max_norm, min=1.0), out=inv)

    def clip_sgd(self, state: "SGDState", params: list[torch.Tensor], bufs: list[torch.Tensor] | None, group: dict[str, Any], **_: Any) -> None:
        grads = [p.grad for p in params]
        self.clip_norm(grads, state.partials, state.counters, state.peak, state.inv, state.max_norm)  # type: ignore[arg-type]
        lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
        for i, (p, g) in enumerate(zip(params, grads)):
            d = g * state.inv  # type: ignore[operator]
            if group["maximize"]:
                d = -d
            if wd:
                d = d + wd * p
            if bufs is not None:
                b = bufs[i].mul_(m).add_(d)
                d = d + m * b if group["nesterov"] else b
            p.sub_(lr * d)


class SGDState:
    """What the clip-and-SGD kernel keeps between steps (train/controls/clip_sgd.py)."""

    def __init__(self, max_norm: float, peak: torch.Tensor, programs: int) -> None:
        device = peak.device
        self.max_norm = max_norm
        self.peak = peak  # Objective.grad_norm: the epoch's largest pre-clip norm
        self.partials = torch.zeros(programs, device=device)
        self.counters = torch.zeros(2, dtype=torch.int32, device=device)  # arrivals, departures
        self.inv = torch.ones((), device=device)
        self.programs = programs  # the most programs one launch may have


def cooperative_launch() -> dict[str, bool]:
    """Launch the one-pass clip_sgd as a cooperative grid where Triton can: CUDA then guarantees every
    program is resident at once (what its grid-wide wait needs), even beside other processes' kernels
    on a shared GPU; without it, one program per SM is what makes them resident."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {}):
            return {"launch_cooperative_grid": True}
    except Exception:  # noqa: BLE001 - an older or non-NVIDIA Triton
        pass
    return {}


class TritonKernels:
    """The norm, its running max and 1/scale in one Triton kernel per 8 gradients (clip_kernels.py)."""

    def __init__(self) -> None:
        from mpsrun.train.controls import clip_kernels  # imports triton: CUDA machines only, and only when clipping

        self._kernel = clip_kernels.clip_norm
        self._sgd = clip_kernels.clip_sgd
        self._cooperative = cooperative_launch()

    def clip_norm(self, grads: list[torch.Tensor], partials: torch.Tensor, counter: torch.Tensor, peak: torch.Tensor, inv: torch.Tensor, max_norm: float) -> None:
        launches = -(-len(grads) // SLOTS)
        total = launches * PROGRAMS
        for c in range(launches):
            chunk = grads[c * SLOTS : (c + 1) * SLOTS]
            args: list[Any] = []
            for j in range(SLOTS):
                g = chunk[j] if j < len(chunk) else chunk[0]
                args += [g, g.numel() if j < len(chunk) else 0]
            self._kernel[(PROGRAMS,)](
                partials, counter, peak, inv, max_norm, c * PROGRAMS, *args,
                TOTAL=total, BLOCK=BLOCK, PBLOCK=max(16, 1 << (total - 1).bit_length()),
            )

    def clip_sgd(self, state: SGDState, params: list[torch.Tensor], bufs: list[torch.Tensor] | None, group: dict[str, Any], mode: int = 0, block: int = 2048) -> None:
        """Clip and SGD in one launch (mode 0) or two (1 then 2: the interpreter's way); see clip_kernels.clip_sgd."""
        sizes = [p.numel() for p in params]
        blocks = [-(-n // block) for n in sizes]
        programs = max(1, min(state.programs, sum(blocks)))
        starts = [sum(blocks[:k]) % programs for k in range(SLOTS)]
        args: list[Any] = []
        for k in range(SLOTS):
            if k < len(params):
                p = params[k]
                args += [p, p.grad, bufs[k] if bufs is not None else p, sizes[k]]
            else:
                args += [params[0], params[0], params[0], 0]
        lr = group["lr"]
        lr_ptr = torch.is_tensor(lr)
        flags = dict(
            P=programs, BLOCK=block, PBLOCK=max(16, 1 << (programs - 1).bit_length()), LR_PTR=lr_ptr,
            HAS_MOMENTUM=bufs is not None, NESTEROV=bool(group["nesterov"]), MAXIMIZE=bool(group["maximize"]),
            HAS_WD=bool(group["weight_decay"]), num_warps=4 if block <= 1024 else 8,
        )
        head = [state.partials, state.counters, state.peak, state.inv, state.max_norm,
                lr if lr_ptr else state.inv, 0.0 if lr_ptr else float(lr), float(group["momentum"]), float(group["weight_decay"])]
        for m in ((0,) if mode == 0 else (1, 2)):
            extra = self._cooperative if m == 0 else {}
            self._sgd[(programs,)](*head, *args, *starts[1:], MODE=m, **flags, **extra)


class FastClip:
    """Clip by global 2-norm: one kernel for the norm (per 8 gradients), one foreach multiply."""

    def __init__(self, model: nn.Module, max_norm: float, peak: torch.Tensor, kernels: Any = None) -> None:
        """`peak`: the 0-d device tensor that keeps the epoch's largest pre-clip norm (Objective.grad_norm)."""
        device = peak.device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_norm = float(max_norm)
        self.kernels = kernels if kernels is not None else TritonKernels()
        self.partials = torch.zeros(-(-len(self.params) // SLOTS) * PROGRAMS, device=device)
        self.counter = torch.zeros((), dtype=torch.int32, device=device)
        self.peak = peak
        self.inv = torch.ones((), device=device)  # min(max_norm / norm, 1)
        self.folded = False  # clip_sgd.fold: the optimizer's step clips, in its own kernel

    def clip(self) -> None:
        """After backward, before the optimizer step."""
        if self.folded:
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        self.kernels.clip_norm(grads, self.partials, self.counter, self.peak, self.inv, self.max_norm)
        torch._foreach_mul_(grads, self.inv)


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
