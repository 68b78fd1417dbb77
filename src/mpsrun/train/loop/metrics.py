"""Validation metrics per task, accumulated on the device and read once per evaluation.

Hand-written, not torchmetrics, by measurement and by rule (see docs/guides/recipes.md,
"Training controls"): every update here is a handful of fixed-shape tensor ops
with no Python-side state, so it runs inside a captured CUDA graph and never
synchronises with the host. torchmetrics' `Metric.update` also bumps Python
counters (`_update_count`, `_computed`) that a graph replay does not re-run, and its
classification metrics validate their inputs (a host sync) unless told not to;
importing it also costs start-up time on every run. The sums below are the
textbook definitions, and tests check them against scikit-learn.

Classification: `accuracy` (and `top5_accuracy` with more than 10 classes).
Regression: `mae`, `rmse`, `r2` (and `mse` on request), in the target's own
units: a dataset that standardised its target for training says so with
`info["target_mean"]`/`info["target_std"]`, and the errors are scaled back here.
R^2 is invariant to that scaling; with several outputs each is averaged uniformly.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    import numpy as np

DEFAULTS = {"classification": ("accuracy",), "regression": ("mae", "rmse", "r2")}


class MetricSet:
    """Device-side sums for one evaluation pass; `compute` turns them into named floats."""

    def __init__(
        self,
        task: str,
        device: torch.device,
        names: Sequence[str] = (),
        num_classes: int = 0,
        num_outputs: int = 1,
        target_mean: Sequence[float] | float | None = None,
        target_std: Sequence[float] | float | None = None,
    ) -> None:
        self.task = task
        wanted = list(DEFAULTS[task])
        if task == "classification" and num_classes > 10:
            wanted.append("top5_accuracy")
        self.names = list(dict.fromkeys(wanted + list(names)))
        self.k = max(1, num_outputs)
        self.std = _per_output(target_std, self.k, 1.0)
        del target_mean  # the mean cancels out of every error and of R^2; kept in the signature for clarity
        z = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.correct = z(dtype=torch.long)
        self.top5 = z(dtype=torch.long)
        self.abs_err = z(self.k)
        self.sq_err = z(self.k)
        self.y_sum = z(self.k)
        self.y_sq = z(self.k)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every accumulator (graph capture snapshots and restores them)."""
        return (self.correct, self.top5, self.abs_err, self.sq_err, self.y_sum, self.y_sq)

    def reset(self) -> None:
        for t in self.tensors():
            t.zero_()

    def update(self, out: torch.Tensor, y: torch.Tensor) -> None:
        """Fixed-shape device ops only: no `.item()`, no data-dependent shapes."""
        if self.task == "classification":
            self.correct.add_((out.argmax(dim=1) == y).sum())
            if "top5_accuracy" in self.names:
                self.top5.add_((out.topk(min(5, out.shape[1]), dim=1).indices == y.unsqueeze(1)).any(dim=1).sum())
            return
        o = out.float().reshape(len(y), -1)
        t = y.float().reshape(len(y), -1)
        err = o - t
        self.abs_err.add_(err.abs().sum(0))
        self.sq_err.add_(err.square().sum(0))
        self.y_sum.add_(t.sum(0))
        self.y_sq.add_(t.square().sum(0))

    def compute(self, n: int, prefix: str = "val_") -> dict[str, float]:
        """Read the sums (once, at the end of a pass) and name the results."""
        if n <= 0:
            return {}
        out: dict[str, float] = {}
        if self.task == "classification":
            if "accuracy" in self.names:
                out["accuracy"] = self.correct.item() / n
            if "top5_accuracy" in self.names:
                out["top5_accuracy"] = self.top5.item() / n
        else:
            abs_err, sq_err, y_sum, y_sq = (t.detach().cpu().double().tolist() for t in (self.abs_err, self.sq_err, self.y_sum, self.y_sq))
            mae, mse, r2 = [], [], []
            for j in range(self.k):
                s = self.std[j]
                mae.append(abs_err[j] / n * s)
                mse.append(sq_err[j] / n * s * s)
                sst = y_sq[j] - y_sum[j] ** 2 / n
                r2.append(1.0 - sq_err[j] / sst if sst > 0 else float("nan"))
            values = {"mae": _mean(mae), "mse": _mean(mse), "rmse": _mean([math.sqrt(m) for m in mse]), "r2": _mean(r2)}
            out = {k: v for k, v in values.items() if k in self.names}
        return {f"{prefix}{k}": v for k, v in out.items()}


def _per_output(v: Sequence[float] | float | None, k: int, default: float) -> list[float]:
    if v is None:
        return [default] * k
    if isinstance(v, (int, float)):
        return [float(v)] * k
    vals = [float(x) for x in v]
    return vals if len(vals) == k else [vals[0]] * k


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def target_units(y: np.ndarray, out: np.ndarray, info: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Regression targets and predictions back in the target's own units, for the figures.

    The logged model predicts the standardised target it was trained on; the dataset's
    `target_mean`/`target_std` (also in the run's data_info.json) undo that.
    """
    import numpy as np

    mean, std = info.get("target_mean"), info.get("target_std")
    if mean is None or std is None:
        return y, out
    m, s = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    pred = out.astype(np.float64).reshape(y.shape)
    return y.astype(np.float64) * s + m, pred * s + m
