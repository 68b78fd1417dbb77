"""Callback plugins: classes (or callables) that return an mpsrun Callback.

Hooks run between epochs, never inside the step loop. `run.log` records on the
run's MLflow run; `run.request_stop(reason)` ends the run after this epoch
(FINISHED, the reason printed). `state_dict` travels in checkpoints.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from mpsrun import Callback, RunState


class BestMetric(Callback):
    """Logs the best value so far of `monitor` as best_<monitor>; stops once it reaches `stop_at`."""

    def __init__(self, monitor: str = "val_accuracy", mode: Literal["min", "max"] = "max", stop_at: Optional[float] = None) -> None:
        self.monitor = monitor
        self.mode = mode
        self.stop_at = stop_at
        self.best: Optional[float] = None

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        value = metrics[self.monitor]
        better = self.best is None or (value > self.best if self.mode == "max" else value < self.best)
        if better:
            self.best = value
        run.log.log_metrics({f"best_{self.monitor}": self.best}, step=epoch)
        reached = self.stop_at is not None and (self.best >= self.stop_at if self.mode == "max" else self.best <= self.stop_at)
        if reached:
            run.request_stop(f"{self.monitor} reached {self.stop_at}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
