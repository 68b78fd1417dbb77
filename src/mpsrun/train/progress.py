"""On-screen progress: a Rich bar over epochs and batches, or one line per epoch.

The bar advances on host-side step counts only; the loss it shows is the last
one the engine read (per epoch, or every `log_every` steps), so drawing it never
forces a device sync.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from mpsrun.train.loop.engine import EpochMetrics, Listener


def quality(m: EpochMetrics) -> str:
    """The task's headline figure: accuracy, or R^2 and MAE for regression."""
    if m.val_accuracy is not None:
        return f"val_acc {m.val_accuracy:.4f}"
    return "  ".join(f"{k} {m.extra[k]:.4g}" for k in ("val_r2", "val_mae") if k in m.extra)


def epoch_line(m: EpochMetrics, epochs: int) -> str:
    return (
        f"epoch {m.epoch + 1}/{epochs}  train_loss {m.train_loss:.4f}  val_loss {m.val_loss:.4f}  "
        f"{quality(m)}  {m.epoch_time_s:.3f} s  {m.train_samples_per_s:,.0f} samples/s"
    )


class QuietProgress(Listener):
    """One line per epoch; for logs, CI and benchmarks."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.epochs = 0

    def on_start(self, epochs: int, train_steps: int, val_steps: int) -> None:
        self.epochs = epochs

    def on_epoch_end(self, m: EpochMetrics) -> None:
        self.console.print(epoch_line(m, self.epochs), highlight=False)

    def on_note(self, message: str, warn: bool = True) -> None:
        """`warn`: a fallback or a skipped optimisation (said as a warning); else how the run was set up (a note)."""
        self.console.print(f"[yellow]warning:[/] {message}" if warn else f"note: {message}")


class BarProgress(QuietProgress):
    """Epoch and batch bars with the latest loss and samples/s."""

    def __init__(self, console: Console) -> None:
        super().__init__(console)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.epoch_task = None
        self.batch_task = None
        self.t0 = 0.0
        self.loss = "-"

    def on_start(self, epochs: int, train_steps: int, val_steps: int) -> None:
        super().on_start(epochs, train_steps, val_steps)
        self.progress.start()
        self.epoch_task = self.progress.add_task("epochs", total=epochs, info="")
        self.batch_task = self.progress.add_task("train", total=train_steps, info="")
        self.t0 = time.perf_counter()

    def on_step(self, epoch: int, step: int, samples: int, loss: float | None) -> None:
        if step == 1 or step <= 0:
            self.t0 = time.perf_counter()
        if loss is not None:
            self.loss = f"{loss:.4f}"
        rate = samples / max(time.perf_counter() - self.t0, 1e-9)
        self.progress.update(
            self.batch_task, completed=step, description=f"train {epoch + 1}", info=f"loss {self.loss}  {rate:,.0f} samples/s"
        )

    def on_validate(self, epoch: int) -> None:
        self.progress.update(self.batch_task, description=f"val {epoch + 1}")

    def on_epoch_end(self, m: EpochMetrics) -> None:
        self.loss = f"{m.train_loss:.4f}"
        self.progress.update(self.epoch_task, advance=1, info=quality(m))
        self.progress.console.print(epoch_line(m, self.epochs), highlight=False)
        self.progress.update(self.batch_task, completed=0)
        if m.epoch + 1 == self.epochs:
            self.stop()

    def stop(self) -> None:
        self.progress.stop()
