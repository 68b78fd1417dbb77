"""Early stopping, built as an ordinary callback so the public callback interface carries it.

The run ends FINISHED (it did what was asked: stop when no longer improving), is
tagged `mpsrun.stopped_early` with the last epoch trained (its MLflow step, from 0), and its state (best
value, epochs waited) travels in checkpoints so a resumed run counts on.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from mpsrun.train.controls.callbacks import Callback, RunState


class EarlyStopping(Callback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` epochs."""

    def __init__(self, monitor: str = "val_loss", mode: Literal["min", "max"] = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience}")
        if min_delta < 0:
            raise ValueError(f"min_delta must not be negative, got {min_delta}")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be min or max, not {mode!r}")
        self.monitor = monitor
        self.mode = mode
        self.patience = patience
        self.min_delta = min_delta
        self.best: float | None = None
        self.best_epoch = -1
        self.wait = 0

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return not math.isnan(value)
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise KeyError(f"early_stopping.monitor '{self.monitor}' is not among this run's metrics: {', '.join(sorted(metrics))}")
        value = float(metrics[self.monitor])
        if self._improved(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            run.log.set_tags({"mpsrun.stopped_early": str(epoch), "mpsrun.stopped_early.reason": self.reason()})
            run.request_stop(f"early stopping after epoch {epoch + 1} of {run.epochs} (MLflow step {epoch}): {self.reason()}")

    def reason(self) -> str:
        """Epochs counted from 1 as the screen counts them, with the MLflow step (from 0) beside."""
        return (
            f"{self.monitor} has not improved by more than {self.min_delta} for {self.wait} epochs "
            f"(best {self.best:.6g} at epoch {self.best_epoch + 1}, MLflow step {self.best_epoch})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.best_epoch = int(state.get("best_epoch", -1))
        self.wait = int(state.get("wait", 0))
