"""What the screen shows is in MLflow: an epoch's line is printed after its records are handed over.

The engine tells its listeners about an epoch (the progress line, the metric logger)
and then its callbacks (the checkpointer last). Printed first, a line could be on the
screen when SIGTERM arrived before the epoch's metrics and checkpoint were queued: the
run ended KILLED without the epoch the user saw. `ShownAfterRecord` holds the screen's
epoch line back until every callback has run: by then the epoch's metrics are with
the tracker and its checkpoint is queued, and the stop path (train/keep/interrupt.py,
`Continuity.interrupted`) waits for both before the run is marked KILLED. A stop in
between loses the line, never the record. A failure (a non-finite loss the guard
stops on) shows the held line first, as evidence.
"""

from __future__ import annotations

from mpsrun.train.controls.callbacks import Callback, RunState
from mpsrun.train.loop.events import EpochMetrics, Listener


class ShownAfterRecord(Listener):
    """Wraps the screen's listener; `as_callback()` is put after the checkpointer and lets the line out."""

    def __init__(self, screen: Listener | None) -> None:
        self.screen = screen or Listener()
        self.held: EpochMetrics | None = None

    # -- as the screen's listener: everything passes at once but the epoch's line
    def on_start(self, epochs: int, train_steps: int, val_steps: int) -> None:
        self.screen.on_start(epochs, train_steps, val_steps)

    def on_step(self, epoch: int, step: int, samples: int, loss: float | None) -> None:
        self.screen.on_step(epoch, step, samples, loss)

    def on_validate(self, epoch: int) -> None:
        self.screen.on_validate(epoch)

    def on_epoch_end(self, m: EpochMetrics) -> None:
        self.held = m

    def on_note(self, message: str, warn: bool = True) -> None:
        self.screen.on_note(message, warn)

    # -- as the last callback: the epoch is recorded (metrics handed over, checkpoint queued)
    def on_epoch_end_recorded(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            self.screen.on_epoch_end(held)

    def show_held(self) -> None:
        """A failure: the epoch that caused it is shown before the failure is said."""
        self.on_epoch_end_recorded()

    def drop_held(self) -> None:
        """A stop before the epoch was recorded: its line is not shown."""
        self.held = None

    def as_callback(self) -> Callback:
        shown = self

        class _Recorded(Callback):
            def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
                shown.on_epoch_end_recorded()

        return _Recorded()
