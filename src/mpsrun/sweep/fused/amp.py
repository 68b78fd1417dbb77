"""precision: bf16 in the fused step's own autograd Functions (layers._Linear, packed._GroupedConv)."""

from __future__ import annotations

import torch


def amp_cast(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Input, weight and bias in autocast's dtype where autocast is on for their device (else as they are).

    Why: autocast casts what a matmul or convolution reads (so nn.Linear under bf16 autocast computes
    addmm in bf16 on casts of its fp32 weight and bias); a custom Function's forward sees that, but its
    backward runs outside autocast, so the casts are made here and saved: the backward computes in the
    same dtype, and autograd casts each input's gradient back to that input's own dtype."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return x, w, b
    dt = torch.get_autocast_dtype(dev)
    return x.to(dt), w.to(dt), (b.to(dt) if b is not None else None)
