"""Callbacks: code that sees each epoch of a run and may log, save, or ask the run to stop.

Checkpointing and early stopping are built on this same interface, so the public
one is proven by the project's own use. A callback runs between epochs, never
inside the step loop: it costs no host synchronisation in the hot path.

The engine calls the hooks and never knows MLflow; what a callback may log goes
through `RunState.log`, which the runner connects to the run's tracker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


class RunLog(Protocol):
    """What a callback may record on the run (the runner gives the MLflow tracker's methods)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def log_file(self, path: str | Path, folder: str | None = None) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...


class _NoLog:
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def log_file(self, path: str | Path, folder: str | None = None) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...


@dataclass
class RunState:
    """The run as callbacks see it: the live objects, the epoch counters and a way to stop."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    epochs: int  # planned
    log: RunLog = field(default_factory=_NoLog)
    epoch: int = 0  # the epoch running or just finished (0-based)
    history: list[dict[str, float]] = field(default_factory=list)  # every finished epoch's metrics
    extras: dict[str, Any] = field(default_factory=dict)  # scheduler, grad scaler, data order, ... by name
    stop_reason: str | None = None

    @property
    def should_stop(self) -> bool:
        return self.stop_reason is not None

    def request_stop(self, reason: str) -> None:
        """Ask the run to end after this epoch; it ends FINISHED and says why."""
        if self.stop_reason is None:
            self.stop_reason = reason


class Callback:
    """Override what you need; every hook is a no-op here.

    `state_dict`/`load_state_dict` let a callback's own state (a best value, a
    patience counter) travel in checkpoints, so a resumed run continues exactly.
    """

    def on_fit_start(self, run: RunState) -> None: ...
    def on_epoch_start(self, run: RunState, epoch: int) -> None: ...
    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None: ...
    def on_fit_end(self, run: RunState) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Callbacks(Callback):
    """Several callbacks called in order; their states are kept under their position and class."""

    def __init__(self, *items: Callback | None) -> None:
        self.items = [i for i in items if i is not None]

    def on_fit_start(self, run: RunState) -> None:
        for c in self.items:
            c.on_fit_start(run)

    def on_epoch_start(self, run: RunState, epoch: int) -> None:
        for c in self.items:
            c.on_epoch_start(run, epoch)

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        for c in self.items:
            c.on_epoch_end(run, epoch, metrics)

    def on_fit_end(self, run: RunState) -> None:
        for c in self.items:
            c.on_fit_end(run)

    def _key(self, i: int, c: Callback) -> str:
        return f"{i}:{type(c).__name__}"

    def state_dict(self) -> dict[str, Any]:
        return {self._key(i, c): c.state_dict() for i, c in enumerate(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, c in enumerate(self.items):
            saved = state.get(self._key(i, c))
            if saved is not None:
                c.load_state_dict(saved)
