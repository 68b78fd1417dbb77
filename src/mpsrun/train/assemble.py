"""From the recipe's training controls to live objects: loss, metrics, clipping, accumulation,
schedule, early stopping and plugin callbacks.

The runner calls `adjust_options` before the optimizer is built (what CUDA graphs can
carry decides `capturable`) and `build` after; both raise `ControlError` for bad
input, which the runner reports as such (exit 2) before any MLflow run starts.
Everything skipped or switched off comes back as a note: printed and tagged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from mpsrun.plugins import registry
from mpsrun.plugins.components import METRICS
from mpsrun.plugins.contract import DataSplits
from mpsrun.recipe.model import Recipe
from mpsrun.recipe.problems import did_you_mean
from mpsrun.train.ranks import distributed
from mpsrun.train.controls import schedulers
from mpsrun.train.controls.callbacks import Callback
from mpsrun.train.loop.data import BatchPlan
from mpsrun.train.loop.losses import build_loss
from mpsrun.train.loop.metrics import MetricSet
from mpsrun.train.loop.objective import Objective
from mpsrun.train.loop.steps import Options
from mpsrun.train.controls.stopping import EarlyStopping

TASKS = ("classification", "regression")
# Figures every epoch logs whatever the task (engine.EpochMetrics), which early stopping may follow.
ALWAYS = ("train_loss", "val_loss", "lr", "epoch_time_s", "train_time_s", "val_time_s", "train_samples_per_s")


class ControlError(ValueError):
    """A training control the recipe asks for does not fit this run (bad input, exit 2)."""


@dataclass
class Controls:
    objective: Objective
    callbacks: list[Callback] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)  # scheduler (and scaler): checkpoints carry them
    notes: list[str] = field(default_factory=list)


def task_of(splits: DataSplits) -> str:
    task = getattr(splits, "task", "classification")
    if task not in TASKS:
        raise ControlError(f"dataset returned task '{task}'{did_you_mean(task, TASKS)}; expected classification or regression")
    return task


def num_outputs(splits: DataSplits) -> int:
    """Classification: num_classes. Regression: the target's width k ((N,) is 1, (N, k) is k)."""
    if task_of(splits) == "classification":
        return splits.num_classes
    y = _targets(splits.train)
    return 1 if y is None or y.dim() == 1 else int(y[0].numel())


def _targets(ds: Any) -> torch.Tensor | None:
    tensors = getattr(ds, "tensors", None)
    if isinstance(tensors, (tuple, list)) and len(tensors) == 2:
        return tensors[1]
    try:
        return torch.as_tensor(ds[0][1]).unsqueeze(0)
    except Exception:
        return None


def adjust_options(recipe: Recipe, options: Options) -> None:
    """Switch CUDA graphs off, with the reason, for what a captured 16-step graph cannot carry."""
    if not options.graphs:
        return
    why = None
    if recipe.accumulate > 1:
        why = f"accumulate: {recipe.accumulate} steps the optimizer every {recipe.accumulate} micro-batches, which the 16-step graphs do not model"
    elif recipe.scheduler is not None:
        why = schedulers.graph_problem(registry.optimizer_class(recipe.optimizer.name), recipe.scheduler.interval)
        why = f"scheduler: {why}" if why else None
    if why:
        options.graphs = False
        options.notes.append(f"graphs: {why}; running eager")


def build(recipe: Recipe, splits: DataSplits, model: nn.Module, optimizer: torch.optim.Optimizer, plan: BatchPlan, options: Options, device: torch.device) -> Controls:
    task = task_of(splits)
    for m in recipe.metrics:
        if m not in METRICS[task]:
            raise ControlError(f"metrics: '{m}' is not a {task} metric; {task} metrics: {', '.join(METRICS[task])}")
    info = splits.info or {}
    try:
        loss = build_loss(recipe.loss.name if recipe.loss else None, recipe.loss.kwargs if recipe.loss else {}, task, device)
    except registry.PluginError as e:
        raise ControlError(str(e)) from None
    metrics = MetricSet(task, device, recipe.metrics, splits.num_classes, num_outputs(splits), info.get("target_mean"), info.get("target_std"))
    clip = recipe.grad_clip
    objective = Objective(
        task,
        loss,
        metrics,
        max_norm=clip.max_norm if clip else None,
        norm_type=clip.norm_type if clip else 2.0,
        accumulate=recipe.accumulate,
        grad_norm=torch.zeros((), device=device) if clip else None,
    )
    out = Controls(objective)
    note = loss.fuse(device, recipe.batch_size, splits.num_classes)  # CUDA cross-entropy: one kernel each way
    if note:
        out.notes.append(note)
    note = _fuse_layers(model, device, options, recipe.batch_size)
    if note:
        out.notes.append(note)
    note = _fuse_pools(model, device, options)
    if note:
        out.notes.append(note)
    note = _fuse_norms(model, device, options)
    if note:
        out.notes.append(note)
    if recipe.scheduler is not None and options.graphs:
        how = schedulers.tensor_lr(optimizer, device)
        out.notes.append(f"scheduler: the learning rate is a device tensor the CUDA graphs read; {how}")
    if clip is not None:  # before the scheduler: it may change the optimizer's class, whose step a scheduler binds
        note = objective.attach(model, device, options.precision == "fp16", distributed.world_size(), optimizer=optimizer)
        out.notes.append(note)
    if recipe.scheduler is not None:
        steps = -(-len(plan.train) // recipe.accumulate)  # optimizer steps per epoch
        try:
            sched, plateau = schedulers.build(recipe.scheduler, optimizer, steps)
        except schedulers.ScheduleError as e:
            raise ControlError(str(e)) from None
        out.extras["scheduler"] = sched
        if recipe.scheduler.interval == "step":
            objective.after_step.append(sched.step)
        else:
            if plateau:
                check_monitor("scheduler.monitor", recipe.scheduler.monitor, objective)
            out.callbacks.append(schedulers.ScheduleCallback(sched, plateau, recipe.scheduler.monitor))
    stopping = early_stopping(recipe, objective)
    if stopping is not None:
        out.callbacks.append(stopping)
    for i, section in enumerate(recipe.callbacks):
        try:
            cb = registry.build("callback", section.name, section.kwargs, {})
        except registry.PluginError as e:
            raise ControlError(f"callbacks.{i}: {e}") from None
        if not all(callable(getattr(cb, h, None)) for h in ("on_epoch_start", "on_epoch_end")):
            raise ControlError(f"callbacks.{i}: '{section.name}' built {type(cb).__name__}, not an mpsrun Callback (subclass mpsrun.Callback)")
        out.callbacks.append(cb)
    return out


def early_stopping(recipe: Recipe, objective: Objective) -> EarlyStopping | None:
    """The recipe's early stopping, its monitor checked against what the run logs (ControlError: bad input).
    A fused sweep builds each member's with this too (sweep/fused/controls.py), so both stop alike."""
    es = recipe.early_stopping
    if es is None:
        return None
    check_monitor("early_stopping.monitor", es.monitor, objective)
    return EarlyStopping(es.monitor, es.mode, es.patience, es.min_delta)


def metric_names(objective: Objective) -> list[str]:
    names = list(ALWAYS) + [f"val_{m}" for m in objective.metrics.names]
    return names + (["grad_norm"] if objective.grad_norm is not None else [])


def _kernel_why_not(options: Options, env: str) -> Optional[str]:
    """Why the Triton kernels captured in place of a module's (max-pool, batch-norm) stay off for this run, or None."""
    if not options.graphs:
        return "CUDA graphs are off (the kernels run where steps are replayed)"
    if not options.channels_last:
        return "channels_last is off (the kernels are for channels_last tensors)"
    from mpsrun.train.kernels import kernels_off

    return kernels_off(env)


def _fuse_pools(model: nn.Module, device: torch.device, options: Options) -> str:
    """Turn on the max-pool kernels where they apply; the note says why not on a CUDA run whose model has max-pools."""
    if device.type != "cuda":
        return ""
    from mpsrun.train.kernels import fused_pool

    if not fused_pool.candidates(model):
        return ""
    why = _kernel_why_not(options, "MPSRUN_FUSED_POOL")
    options.fused_pool = why is None
    return "" if why is None else f"pools: torch's max-pool kernels, not the fused ones ({why})"


def _fuse_norms(model: nn.Module, device: torch.device, options: Options) -> str:
    """Turn on the batch-norm kernels where they apply; the note says why not on a CUDA run whose model has batch-norms."""
    if device.type != "cuda":
        return ""
    from mpsrun.train.kernels import fused_norm

    if not fused_norm.candidates(model):
        return ""
    why = _kernel_why_not(options, "MPSRUN_FUSED_NORM")
    options.fused_norm = why is None
    return "" if why is None else f"norms: torch's batch-norm kernels, not the fused ones ({why})"


def check_monitor(where: str, name: str, objective: Objective) -> None:
    """ControlError (bad input) when a control's `monitor` is not a metric this run logs (a fused group asks the same)."""
    names = metric_names(objective)
    if name not in names:
        raise ControlError(f"{where}: '{name}' is not a metric of this run{did_you_mean(name, names)}; available: {', '.join(names)}")


def layers_why_not(model: nn.Module, device: torch.device, options: Options, batch_size: int) -> Optional[str]:
    """None where the run's Linear (+ ReLU) layers will be the fused kernels; else why not ("" where there is nothing to say)."""
    if device.type != "cuda":
        return ""
    from mpsrun.train.kernels import fused_linear, switched_off

    why = fused_linear.why_not(model, device, options.precision, options.graphs, options.compile, batch_size)
    if why is None and switched_off("MPSRUN_FUSED_LINEAR"):
        why = "MPSRUN_FUSED_LINEAR=0"
    return why


def _fuse_layers(model: nn.Module, device: torch.device, options: Options, batch_size: int) -> str:
    """Turn on the fused Linear (+ ReLU) kernels where they apply; the note says why not where a user would expect them."""
    why = layers_why_not(model, device, options, batch_size)
    if why is None:
        options.fused_linear = True
        return ""
    if not why:  # nothing a user would expect fused here (no Linear to fuse, a model of its own forward)
        return ""
    return f"layers: torch's Linear kernels, not the fused ones ({why})"
