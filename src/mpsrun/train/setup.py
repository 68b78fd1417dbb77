"""What the runner builds from a recipe before the first step, and the two ways set-up and training end badly.

Apart from the runner so the modules the runner drives (record, continuity, the
canary) can read a `Setup` without importing the runner that calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpsrun.devices import resolve as devices
from mpsrun.plugins.contract import DataSplits
from mpsrun.recipe.load import Resolved
from mpsrun.train.controls.callbacks import Callback
from mpsrun.train.loop.data import BatchPlan
from mpsrun.train.loop.objective import Objective
from mpsrun.train.loop.steps import Options


class InputError(Exception):
    """Bad input discovered while setting up (device, data files): exit code 2, nothing logged."""


class OwnerConflict(InputError):
    """Another live process owns the run (track/store/owner.py): exit code 2, the run untouched."""


class RunFailed(Exception):
    """Training failed after the MLflow run started; the run is marked FAILED."""

    def __init__(self, message: str, run_id: str | None) -> None:
        super().__init__(message)
        self.run_id = run_id


@dataclass
class Setup:
    """Everything built from a recipe, before any training step."""

    resolved: Resolved
    choice: devices.DeviceChoice
    splits: DataSplits
    model: nn.Module
    optimizer: torch.optim.Optimizer
    plan: BatchPlan
    options: Options
    notes: list[str] = field(default_factory=list)
    callbacks: list[Callback] = field(default_factory=list)  # called between epochs, in this order
    objective: Objective | None = None  # loss, metrics, clipping, accumulation (train/assemble.py)
    extras: dict = field(default_factory=dict)  # RunState.extras: the scheduler, ... (checkpoints carry them)
    params: dict = field(default_factory=dict)  # params beyond the recipe's (the augmentations as built)
    canary: Any = None  # devices.canary.Report when set-up ran the canary (runner.prepare says when); `guard` records it
