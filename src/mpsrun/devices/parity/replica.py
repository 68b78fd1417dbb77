"""One device's copy of the model and optimizer, and everything built before the first step.

The model is built once on the CPU; each replica gets a copy of the same initial
weights and sees the same batches in the same order. A third replica, the yardstick,
runs on the CPU in higher precision to measure the precision's own noise.
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mpsrun.devices import resolve as devices
from mpsrun.devices.parity.tolerance import FLOORS, NOISE_CAPS, NOISE_FACTOR, Tolerance, _host
from mpsrun.plugins.registry import PluginError
from mpsrun.recipe.load import Resolved
from mpsrun.recipe.model import DEVICE_PATTERN
from mpsrun.train import runner
from mpsrun.train.loop.losses import TaskLoss, build_loss

DEFAULT_STEPS = 20
PROBE_SIZE = 128
# precision -> (precision, dtype) of the yardstick replica: higher precision, on the CPU
YARDSTICK = {"fp32": ("fp32", torch.float64), "bf16": ("fp32", torch.float32), "fp16": ("fp32", torch.float32)}


class Replica:
    """One device's copy of the model and optimizer, stepped as the engine steps."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        resolved: Resolved,
        precision: str,
        channels_last: bool,
        transform: Callable[[torch.Tensor], torch.Tensor] | None,
        dtype: torch.dtype = torch.float32,
        task: str = "classification",
    ) -> None:
        self.device = device
        self.task = task
        self.loss_fn = recipe_loss(resolved, task, device)
        clip = resolved.recipe.grad_clip
        self.clip = (clip.max_norm, clip.norm_type) if clip is not None else None
        self.dtype = dtype
        self.model = copy.deepcopy(model).to(device=device, dtype=dtype)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.channels_last = channels_last
        self.optimizer = runner.build_optimizer(resolved.recipe, self.model, graphs=False)
        self.transform = transform
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        if self.transform is not None:
            x = self.transform(x)
        if x.is_floating_point() and x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One training step (as engine.Trainer.train_step); returns (loss, pre-clip gradient norm).

        The recipe's own loss for its task (mse on a regression recipe, label smoothing where
        asked) and its grad_clip: parity compares the training the recipe asks for.
        """
        self.model.train()
        _dropout_off(self.model)
        x, y = self._input(x), y.to(self.device)
        with self._autocast():
            loss = self.loss_fn(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)  # the norm of the true gradient
            norm = _grad_norm(self.model)
            self._clip()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            norm = _grad_norm(self.model)
            self._clip()
            self.optimizer.step()
        return float(_host(loss)), float(_host(norm))

    def _clip(self) -> None:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip[0], self.clip[1])

    @torch.no_grad()
    def probe(self, x: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        with self._autocast():
            out = self.model(self._input(x))
        return _host(out)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k: _host(v) for k, v in self.model.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}


def recipe_loss(resolved: Resolved, task: str, device: torch.device) -> TaskLoss:
    """The recipe's `loss:` (or the task's default: cross_entropy, mse); bad input is an InputError."""
    section = resolved.recipe.loss
    try:
        return build_loss(section.name if section else None, section.kwargs if section else {}, task, device)
    except PluginError as e:
        raise runner.InputError(str(e)) from None


def _dropout_off(model: nn.Module) -> None:
    """Dropout in eval mode: devices' random generators differ, so their masks would too."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()


def _grad_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]  # in the params' dtype
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def batches(ds: Dataset, batch_size: int, seed: int, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` raw CPU batches in one seeded shuffled order, epoch after epoch as needed."""
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    if len(loader) == 0:
        return
    n = 0
    while True:
        for x, y in loader:
            yield x, y
            n += 1
            if n == steps:
                return


def parse_devices(text: str) -> tuple[str, str]:
    """`cpu,cuda` -> ('cpu', 'cuda'); a bad list is an InputError (exit 2)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise runner.InputError(f"--devices takes two devices separated by a comma, e.g. cpu,cuda (got '{text}')")
    for p in parts:
        if not re.match(DEVICE_PATTERN, p):
            raise runner.InputError(f"'{p}' is not a device (expected auto, cpu, mps, cuda or cuda:N)")
    return parts[0], parts[1]


def _device(name: str) -> torch.device:
    try:
        return devices.resolve(name).device
    except devices.DeviceUnavailable as e:
        raise runner.InputError(str(e)) from None


def _precision(resolved: Resolved, device: torch.device, model: nn.Module) -> tuple[str, bool, list[str]]:
    """The engine's own choice of precision and channels_last for this device."""
    plan = types.SimpleNamespace(graphable=False)  # only the graphs choice reads it; parity runs eager
    opts = runner.resolve_options(resolved.recipe, device, model, plan)  # type: ignore[arg-type]
    notes = [n for n in opts.notes if n.startswith("precision")]
    return opts.precision, opts.channels_last, notes


@dataclass
class Prepared:
    """Everything built before the first step: bad input shows up here, before any MLflow run."""

    resolved: Resolved
    devices: tuple[torch.device, torch.device]
    model: nn.Module
    splits: Any  # DataSplits
    precision: str
    channels_last: tuple[bool, bool]
    tolerance: Tolerance
    steps: int
    probe_x: torch.Tensor
    notes: list[str]
    task: str = "classification"  # regression: the probe compares predictions, no argmax agreement


def prepare(
    resolved: Resolved,
    device_names: tuple[str, str],
    steps: int = DEFAULT_STEPS,
    atol: float | None = None,
    rtol: float | None = None,
    noise_factor: float | None = None,
) -> Prepared:
    """Devices, data, the one model, precision and tolerances; raises runner.InputError."""
    if steps < 1:
        raise runner.InputError(f"--steps must be at least 1 (got {steps})")
    for name, v in (("--atol", atol), ("--rtol", rtol), ("--noise-factor", noise_factor)):
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise runner.InputError(f"{name} must be a finite number >= 0 (got {v})")
    recipe = resolved.recipe
    devs = (_device(device_names[0]), _device(device_names[1]))
    runner.seed_everything(recipe.seed)
    splits = runner.build_data(recipe, resolved)
    runner.seed_everything(recipe.seed)
    model = runner.build_model(recipe, splits)  # built once; each device gets a copy of this state
    notes: list[str] = []
    prec_a, cl_a, notes_a = _precision(resolved, devs[0], model)
    prec_b, cl_b, notes_b = _precision(resolved, devs[1], model)
    notes += notes_a + [n for n in notes_b if n not in notes_a]
    if prec_a != prec_b:
        raise runner.InputError(
            f"precision differs between the devices ({devs[0]}: {prec_a}, {devs[1]}: {prec_b}; "
            + "; ".join(notes)
            + "); compare with a precision both support, e.g. precision=fp32"
        )
    floor_atol, floor_rtol = FLOORS[prec_a]
    tol = Tolerance(
        floor_atol if atol is None else atol,
        floor_rtol if rtol is None else rtol,
        NOISE_FACTOR if noise_factor is None else noise_factor,
        dict(NOISE_CAPS[prec_a]),
    )
    if recipe.compile is True or recipe.graphs is True:
        notes.append("parity runs eager steps: torch.compile and CUDA graphs are not used")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        notes.append("dropout is off during parity: the devices' random generators differ, so would their masks")
    if len(splits.train) == 0:
        raise runner.InputError("the training split is empty")
    try:
        probe_x = next(iter(DataLoader(splits.val, batch_size=PROBE_SIZE, shuffle=False)))[0]
    except StopIteration:
        raise runner.InputError("the validation split is empty: parity needs its first samples as a probe batch") from None
    task = getattr(splits, "task", "classification")
    recipe_loss(resolved, task, devs[0])  # a loss that cannot be built: exit 2 before any MLflow run
    return Prepared(resolved, devs, model, splits, prec_a, (cl_a, cl_b), tol, steps, probe_x, notes, task)


def replicas(
    prep: Prepared,
    dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    precisions: tuple[str, str] | None = None,
) -> tuple[Replica, Replica]:
    """The two devices' copies of the one model. Differing dtypes or precisions are
    for calibrating tolerances only (benchmarks/parity_calibrate.py)."""
    transform = prep.splits.transform
    precisions = precisions or (prep.precision, prep.precision)
    a, b = (
        Replica(prep.model, d, prep.resolved, pr, cl, transform, dt, prep.task)
        for d, cl, dt, pr in zip(prep.devices, prep.channels_last, dtypes, precisions)
    )
    return a, b


def yardstick(prep: Prepared) -> Replica | None:
    """The higher-precision CPU replica that measures the precision's own noise."""
    if prep.tolerance.noise_factor == 0:
        return None
    precision, dtype = YARDSTICK[prep.precision]
    return Replica(prep.model, torch.device("cpu"), prep.resolved, precision, False, prep.splits.transform, dtype, prep.task)
