"""The test split, evaluated once after training with the weights the run logs.

Called after the fit-end callbacks, so a callback that restores the best weights
(checkpoint's `model_from: best`) has done so: the test figures describe the
model a user downloads. Eager, batch by batch, with the run's own loss and
metrics (prefixed `test_`), on the device, read once at the end.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mpsrun.train.loop.data import raw_tensors
from mpsrun.train.loop.steps import Options, Trainer


def _batches(ds: Dataset, batch_size: int, device: torch.device) -> Any:
    raw = raw_tensors(ds)
    if raw is not None:
        x, y = raw
        for i in range(0, len(y), batch_size):
            yield x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)
        return
    for x, y in DataLoader(ds, batch_size=batch_size, shuffle=False):
        yield x.to(device), y.to(device)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    objective: Any,
    test: Dataset,
    batch_size: int,
    device: torch.device,
    options: Options,
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> dict[str, float]:
    """`test_loss` and the task's metrics as `test_*`."""
    trainer = Trainer(model, optimizer, device, options, transform, objective)
    objective.metrics.reset()
    model.eval()
    n = 0
    for x, y in _batches(test, batch_size, device):
        trainer.val_step(x, y)
        n += len(y)
    if n == 0:
        return {}
    out = {"test_loss": trainer.loss_sum.item() / n, **objective.metrics.compute(n, prefix="test_"), "test_size": float(n)}
    objective.metrics.reset()
    return out
