"""What one training step optimises and measures: loss, metrics, gradient clipping, accumulation.

The step (train/loop/steps.py) asks this object for the loss, hands it the gradients
before the optimizer steps, and feeds it validation outputs; all of it stays on
the device, so it adds no host synchronisation and is capturable in a CUDA graph.

Exact accumulation. With `accumulate: N` the optimizer steps once per N
micro-batches and each micro-batch's mean loss is weighted by its share of the
group's samples, so the summed gradient is the gradient of the group's mean loss,
exactly what one batch of the group's size gives; a short last group (an epoch
that does not divide evenly) is weighted by its own sample count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from mpsrun.train.controls import clip_sgd
from mpsrun.train.controls.clipping import FastClip, usable
from mpsrun.train.loop.losses import TaskLoss
from mpsrun.train.loop.metrics import MetricSet


@dataclass
class Objective:
    task: str
    loss: TaskLoss
    metrics: MetricSet
    max_norm: float | None = None  # grad_clip.max_norm
    norm_type: float = 2.0
    accumulate: int = 1
    grad_norm: torch.Tensor | None = None  # the epoch's largest pre-clip norm, on the device
    after_step: list[Callable[[], None]] = field(default_factory=list)  # per optimizer step, eager only (a per-step LR schedule)
    clipper: FastClip | None = None  # the Triton clip (train/controls/clipping.py), where exact; keeps its max in grad_norm

    def attach(self, model: nn.Module, device: torch.device, fp16_scaler: bool, world_size: int, kernels: Any = None, optimizer: torch.optim.Optimizer | None = None) -> str:
        """Choose how to clip and say which, for the run's notes.

        Where exact: torch's SGD clips inside its own step, in one Triton kernel
        (clip_sgd.py); other optimizers get one Triton kernel for the norm and one
        multiply (clipping.py); elsewhere torch's clip. `kernels` replaces the Triton
        kernels (the tests pass clipping.TorchKernels to check the arithmetic on a
        machine without a GPU). Call before a scheduler is built on `optimizer`.
        """
        if self.max_norm is None or self.clipper is not None:
            return ""
        why = None if kernels is not None else usable(model, device, self.norm_type, fp16_scaler, world_size)
        if why is not None:
            return f"grad_clip: torch.nn.utils.clip_grad_norm_ ({why})"
        assert self.grad_norm is not None
        self.clipper = FastClip(model, self.max_norm, self.grad_norm, kernels)
        if optimizer is not None:
            why_not = clip_sgd.fold(optimizer, self.clipper)
            if why_not is None:
                return "grad_clip: the global norm and the SGD update in one Triton kernel (the clip folded into the optimizer's step)"
            return f"grad_clip: global norm in one Triton kernel, then one foreach multiply (not folded into the optimizer: {why_not})"
        return "grad_clip: global norm in one Triton kernel, then one foreach multiply"

    @classmethod
    def default(cls, device: torch.device) -> "Objective":
        """Cross-entropy classification: what the engine did before recipes could say otherwise."""
        return cls("classification", TaskLoss(nn.CrossEntropyLoss(), "classification", "cross_entropy"), MetricSet("classification", device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        extra = (self.grad_norm,) if self.grad_norm is not None else ()
        return (*self.metrics.tensors(), *extra)

    def clip(self, model: nn.Module) -> None:
        """Clip the global gradient norm in place (foreach kernels where the device has them); keep the max."""
        if self.max_norm is None:
            return
        if self.clipper is not None:
            self.clipper.clip()
            return
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm, norm_type=self.norm_type)
        assert self.grad_norm is not None
        torch.maximum(self.grad_norm, total.detach().float(), out=self.grad_norm)

    def epoch_metrics(self) -> dict[str, float]:
        """The training-side figures of an epoch (read once, at its end) and reset for the next."""
        if self.grad_norm is None:
            return {}
        value = self.grad_norm.item()
        self.grad_norm.zero_()
        return {"grad_norm": value}


def micro_batches(n: int, batch_size: int, accumulate: int) -> Iterator[tuple[float, bool, bool]]:
    """(loss weight, first of its group, last of its group) for each batch of an epoch of n samples."""
    batches = -(-n // batch_size)
    for start in range(0, batches, accumulate):
        group = range(start, min(start + accumulate, batches))
        sizes = [min(batch_size, n - i * batch_size) for i in group]
        total = sum(sizes)
        for j, size in enumerate(sizes):
            yield size / total, j == 0, j == len(sizes) - 1
