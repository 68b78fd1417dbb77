"""What the loop reports: an epoch's metrics, the run's result, and the listeners that hear them.

Apart from the engine so the step (steps.py), the progress bar and the runner can
take the listener contract without importing the loop that calls it: the protocol
lives below both its caller and its implementers, so nothing imports upward.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class EpochMetrics:
    epoch: int
    train_loss: float
    val_loss: float
    val_accuracy: float | None  # None for regression, whose metrics are in `extra`
    epoch_time_s: float
    train_time_s: float
    val_time_s: float
    train_samples_per_s: float
    memory_bytes: int
    extra: dict[str, float] = field(default_factory=dict)  # the task's other metrics, lr, grad_norm

    def metrics(self) -> dict[str, float]:
        return {
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            **({"val_accuracy": self.val_accuracy} if self.val_accuracy is not None else {}),
            **self.extra,
            "epoch_time_s": self.epoch_time_s,
            "train_time_s": self.train_time_s,
            "val_time_s": self.val_time_s,
            "train_samples_per_s": self.train_samples_per_s,
            "memory_bytes": float(self.memory_bytes),
        }


@dataclass
class TrainResult:
    epochs: list[EpochMetrics]
    stop_reason: str | None = None  # set when a callback ended the run early (e.g. early stopping)

    @property
    def first_epoch_time_s(self) -> float:
        return self.epochs[0].epoch_time_s

    @property
    def steady_epoch_time_s(self) -> float:
        """Median of the epochs after the first (warm-up, compilation, graph capture)."""
        rest = [e.epoch_time_s for e in self.epochs[1:]] or [self.epochs[0].epoch_time_s]
        return statistics.median(rest)

    @property
    def total_time_s(self) -> float:
        return sum(e.epoch_time_s for e in self.epochs)

    @property
    def peak_memory_bytes(self) -> int:
        return max(e.memory_bytes for e in self.epochs)

    def summary(self) -> dict[str, float]:
        last = self.epochs[-1]
        return {
            "first_epoch_time_s": self.first_epoch_time_s,
            "steady_epoch_time_s": self.steady_epoch_time_s,
            "total_train_time_s": self.total_time_s,
            "steady_train_samples_per_s": statistics.median(
                [e.train_samples_per_s for e in self.epochs[1:]] or [last.train_samples_per_s]
            ),
            "peak_memory_bytes": float(self.peak_memory_bytes),
            **({"final_val_accuracy": last.val_accuracy} if last.val_accuracy is not None else {}),
            **{f"final_{k}": last.extra[k] for k in ("val_r2", "val_mae", "val_rmse") if k in last.extra},  # regression's headline
            "final_val_loss": last.val_loss,
        }


class Listener:
    """Progress hooks; the CLI draws a bar, the tracker logs. All no-ops here."""

    def on_start(self, epochs: int, train_steps: int, val_steps: int) -> None: ...
    def on_step(self, epoch: int, step: int, samples: int, loss: float | None) -> None: ...
    def on_validate(self, epoch: int) -> None: ...
    def on_epoch_end(self, m: EpochMetrics) -> None: ...
    def on_note(self, message: str, warn: bool = True) -> None: ...


class Listeners(Listener):
    """Fans each hook out to several listeners."""

    def __init__(self, *items: Listener | None) -> None:
        self.items = [i for i in items if i is not None]

    def on_start(self, epochs: int, train_steps: int, val_steps: int) -> None:
        for i in self.items:
            i.on_start(epochs, train_steps, val_steps)

    def on_step(self, epoch: int, step: int, samples: int, loss: float | None) -> None:
        for i in self.items:
            i.on_step(epoch, step, samples, loss)

    def on_validate(self, epoch: int) -> None:
        for i in self.items:
            i.on_validate(epoch)

    def on_epoch_end(self, m: EpochMetrics) -> None:
        for i in self.items:
            i.on_epoch_end(m)

    def on_note(self, message: str, warn: bool = True) -> None:
        for i in self.items:
            i.on_note(message, warn)
