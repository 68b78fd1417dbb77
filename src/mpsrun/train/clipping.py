"""Gradient clipping that stays off the step's critical path on CUDA.

Why not just `torch.nn.utils.clip_grad_norm_`: in a CUDA-graphed step of a small
model every kernel costs a few microseconds of latency, and torch's clip adds about
eight of them in a row between backward and the optimizer (per-tensor norms, stack,
total norm, coefficient, clamp, multiply, plus our running max): on the H100 the
fashion MLP's step went from 103 to 130 us (benchmarks/step_kernels_gpu.py).

What this does instead, with the same arithmetic:
- each parameter's norm is taken by a post-accumulate-grad hook as soon as backward
  produces its gradient, on a side stream, so it overlaps the rest of backward;
  the norms are kept divided by `max_norm`;
- after backward only two small kernels remain in line: the total of those norms and
  `scale = max(total / max_norm, 1)`;
- a fused optimizer (torch's `fused=True` SGD/Adam/AdamW...) takes `scale` as its
  `grad_scale` and divides the gradients inside its own kernel, so the multiply costs
  nothing; any other optimizer gets one foreach multiply;
- the epoch's largest norm is kept on the side stream, in units of `max_norm`.

The update equals torch's clip up to its 1e-6 epsilon (torch: coef = max_norm /
(total + 1e-6)). With the fused path the `.grad` tensors stay unclipped (the
optimizer divides them as it reads them); callbacks see the gradients backward made.

Used only where it is exact: one process (DDP averages the gradients after these
hooks fire) and no fp16 GradScaler (its gradients are scaled until `unscale_`).
Everywhere else `Objective.clip` calls torch's clip. The streams are CUDA's; on other
devices the same hooks run in line (that is how the tests check the arithmetic).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class HookedClip:
    """Norms gathered during backward; `clip` finishes them and applies the scale."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float, device: torch.device) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type)
        self.device = device
        n = len(self.params)
        self.norms = torch.zeros(n, device=device)  # each parameter's norm / max_norm, filled by the hooks
        self.total = torch.zeros((), device=device)
        self.scale = torch.ones((), device=device)
        self.peak = torch.zeros((), device=device)  # the epoch's largest total / max_norm
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.optimizer = optimizer
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(g.get("fused") for g in optimizer.param_groups)
        if self.fused:
            optimizer.grad_scale = self.scale  # type: ignore[attr-defined]  # read by torch's fused step
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, i: int) -> Any:
        slot = self.norms[i]

        def hook(p: torch.Tensor) -> None:
            if self.side is None:
                torch.linalg.vector_norm(p.grad, self.norm_type, out=slot)
                slot.div_(self.max_norm)
                return
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                torch.linalg.vector_norm(p.grad, self.norm_type, out=slot)
                slot.div_(self.max_norm)

        return hook

    def clip(self) -> None:
        """After backward, before the optimizer: the scale in line, the bookkeeping beside it."""
        main = torch.cuda.current_stream(self.device) if self.side is not None else None
        if main is not None:
            main.wait_stream(self.side)
        torch.linalg.vector_norm(self.norms, self.norm_type, out=self.total)
        torch.clamp(self.total, min=1.0, out=self.scale)
        if not self.fused:
            grads = [p.grad for p in self.params if p.grad is not None]
            torch._foreach_mul_(grads, torch.reciprocal(self.scale))
        if main is not None:
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self._bookkeep()
        else:
            self._bookkeep()

    def _bookkeep(self) -> None:
        torch.maximum(self.peak, self.total, out=self.peak)
        self.norms.zero_()  # a parameter without a gradient next step counts as zero, as in torch's clip

    def join(self) -> None:
        """End of the step: the main stream waits for the side stream (a CUDA graph needs it joined)."""
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)

    def read_peak(self) -> float:
        """The epoch's largest pre-clip norm, in the gradient's own units; resets it."""
        self.join()
        value = self.peak.item() * self.max_norm
        self.peak.zero_()
        return value

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if self.fused and getattr(self.optimizer, "grad_scale", None) is self.scale:
            del self.optimizer.grad_scale  # type: ignore[attr-defined]


def usable(model: nn.Module, optimizer: torch.optim.Optimizer, fp16_scaler: bool, world_size: int) -> str | None:
    """Why the hooked clip cannot be exact here, or None when it can."""
    if world_size > 1:
        return "DDP averages gradients after backward's hooks"
    if fp16_scaler:
        return "fp16 gradients stay scaled until unscale_"
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        return "this torch has no post-accumulate-grad hooks"
    if any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
        return "parameters that are not float32"
    return None
