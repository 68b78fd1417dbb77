"""The non-finite guard: a NaN or infinite loss ends the run FAILED instead of FINISHED.

A learning rate of 1e9 used to end "FINISHED, exit 0" with val_loss 7.6e25. The
guard reads only what the engine already read (the epoch-end losses, or the
`log_every` progress reads), so it adds no host synchronisation to the step loop.
It runs before the checkpointer: a poisoned epoch is never saved, and the last good
checkpoint stays for `mpsrun resume` with other settings (`optimizer.lr=...`).
"""

from __future__ import annotations

import math
from typing import Callable

from mpsrun.train.controls.callbacks import Callback, RunState
from mpsrun.train.loop.engine import Listener

TAG = "mpsrun.nonfinite"


class NonFiniteLoss(RuntimeError):
    """A loss read at an epoch end (or a progress read) was NaN or infinite."""


class NonFiniteGuard(Callback):
    """`on_nonfinite: stop` raises NonFiniteLoss (run FAILED, exit 1); `warn` says so, tags, and goes on."""

    def __init__(self, mode: str = "stop", note: Callable[[str], None] = lambda m: None) -> None:
        self.mode = mode
        self.note = note
        self.warned = False
        self._run: RunState | None = None

    def on_fit_start(self, run: RunState) -> None:
        self._run = run

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        bad = {k: v for k, v in metrics.items() if k.endswith("loss") and not math.isfinite(v)}
        if bad:
            what = ", ".join(f"{k}={v}" for k, v in bad.items())
            self._trip(f"non-finite loss at epoch {epoch + 1} of {run.epochs} (MLflow step {epoch}): {what}")

    def on_step(self, epoch: int, step: int, samples: int, loss: float | None) -> None:
        if loss is not None and not math.isfinite(loss):
            self._trip(f"non-finite loss at epoch {epoch + 1}, step {step} (MLflow step {epoch}): train_loss={loss}")

    @property
    def listener(self) -> Listener:
        """The part that sees `log_every` progress reads (the engine's Listener hook)."""
        guard = self

        class _Steps(Listener):
            def on_step(self, epoch: int, step: int, samples: int, loss: float | None) -> None:
                guard.on_step(epoch, step, samples, loss)

        return _Steps()

    def _trip(self, message: str) -> None:
        if self.mode == "warn":
            if not self.warned:  # once: a diverged run would repeat it every epoch
                self.warned = True
                self.note(f"{message}; going on (on_nonfinite: warn)")
                if self._run is not None:
                    self._run.log.set_tags({TAG: f"{message} (warned)"})
            return
        if self._run is not None:
            self._run.log.set_tags({TAG: message})
        raise NonFiniteLoss(f"{message}; the last good checkpoint is kept (mpsrun resume RUN_ID optimizer.lr=...)")
