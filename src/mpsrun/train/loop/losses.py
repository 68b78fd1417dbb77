"""The training loss: a torch.nn loss by name, or a plugin's, defaulting to the task's usual one.

Every loss here returns the *mean* over the batch; the step multiplies it by the
sample count where it needs sums (epoch losses, exact gradient accumulation), so a
plugin loss only has to follow torch's default `reduction="mean"`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from mpsrun.plugins import components
from mpsrun.plugins import registry

DEFAULT = {"classification": "cross_entropy", "regression": "mse"}
# torch.nn losses that only make sense for one task. The wrong pairing does not always crash:
# cross_entropy on a regression's (N,) float targets reads them as class probabilities and
# trains to a falling, meaningless loss; mse on int labels fails only at the first backward.
# So it is bad input (exit 2, before any run), named with the losses that fit.
ONLY_FOR = {
    "cross_entropy": "classification",
    "nll": "classification",
    "multi_margin": "classification",
    "mse": "regression",
    "l1": "regression",
    "huber": "regression",
    "smooth_l1": "regression",
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TaskLoss(nn.Module):
    """Wraps a loss so regression outputs (N, 1) meet targets (N,) without silent broadcasting."""

    def __init__(self, inner: Callable[..., torch.Tensor], task: str, name: str) -> None:
        super().__init__()
        self.inner = inner
        self.task = task
        self.name = name
        self.fused = False  # cross-entropy in one Triton kernel each way (train/kernels/fused_ce.py), set by `fuse`

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.dtype != torch.float64:  # fp16/bf16 outputs meet the loss in fp32; fp64 (parity's yardstick) stays
            out = out.float()
        if self.task == "regression":
            y = y.to(out.dtype)
            if out.numel() == y.numel():
                out = out.reshape(y.shape)  # (N, 1) vs (N,): mse would broadcast to (N, N)
        return self.inner(out, y)

    def summed(self, out: torch.Tensor, y: torch.Tensor, loss_sum: torch.Tensor) -> torch.Tensor:
        """The mean loss, having added `mean * len(y)` to `loss_sum` (the epoch's sum, on the device).

        One call so that the fused cross-entropy can do both in its one forward kernel.
        """
        if self.fused:
            from mpsrun.train.kernels import fused_ce

            if fused_ce.fits(out, y):
                return fused_ce.cross_entropy(out, y, loss_sum, ignore_index=self.inner.ignore_index)  # type: ignore[attr-defined]
        loss = self(out, y)
        loss_sum.add_(loss.detach().float(), alpha=y.shape[0])
        return loss

    def fuse(self, device: torch.device, batch_size: int, num_classes: int) -> str:
        """Use the fused cross-entropy where it computes exactly what torch's does; the note says when it does not.

        Only cross-entropy on CUDA is a candidate; for any other loss or device there is nothing to say.
        """
        if self.task != "classification" or device.type != "cuda" or not isinstance(self.inner, nn.CrossEntropyLoss):
            return ""
        from mpsrun.train.kernels import fused_ce

        why = fused_ce.why_not(self.inner, device) or fused_ce.too_large(batch_size, num_classes)
        if why is not None:
            return f"loss: torch's cross-entropy kernels, not the fused one ({why})"
        self.fused = True
        return ""


def build_loss(name: str | None, kwargs: dict[str, Any], task: str, device: torch.device) -> TaskLoss:
    """The recipe's `loss:` (checked again here for plugin-produced recipes) or the task's default."""
    name = name or DEFAULT[task]
    only = ONLY_FOR.get(name.lower())
    if only is not None and only != task:
        fits = ", ".join(k for k, t in ONLY_FOR.items() if t == task)
        raise registry.PluginError(
            f"loss '{name}' is a {only} loss, but this dataset's task is {task}; {task} losses: {fits} (or bce_with_logits, or an mpsrun.losses plugin)"
        )
    factory = components.loss_factory(name)
    checked, errs = registry.validate_kwargs(factory, kwargs)
    if errs:
        raise registry.PluginError("; ".join(f"loss.{k}: {m}" for k, m in errs))
    inner = factory(**checked)
    if isinstance(inner, nn.Module):
        inner = inner.to(device)
    if not callable(inner):
        raise registry.PluginError(f"loss '{name}' built {type(inner).__name__}, which is not callable")
    return TaskLoss(inner, task, name)
