"""The training loop: each epoch trains, then validates; timed with the device synchronised.

Reads top to bottom like a hand-written script, with two differences that make it
fast: losses and correct-counts accumulate on the device and are read once per
epoch (no host sync in the step loop), and on CUDA a whole group of training steps
(forward, backward, optimizer) can be captured once as a CUDA graph and replayed,
which removes per-kernel launch cost for small models. The engine never prints:
it reports to a Listener.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from mpsrun.devices import resolve as devices
from mpsrun.train import warm
from mpsrun.train.controls.callbacks import Callback, RunState
from mpsrun.train.loop.data import BatchPlan
from mpsrun.train.loop.events import EpochMetrics, Listener, Listeners, TrainResult
from mpsrun.train.ranks.distributed import rank, reduce_sums
from mpsrun.train.loop.objective import Objective
from mpsrun.train.loop.profile import profiled
from mpsrun.train.loop.steps import GRAPH_STEPS, GraphTrainer, Options, Trainer, restore_state, snapshot_state

__all__ = ["GRAPH_STEPS", "EpochMetrics", "GraphTrainer", "Listener", "Listeners", "Options", "TrainResult", "Trainer", "train"]

# ----------------------------------------------------------------------------- steps


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: BatchPlan,
    device: torch.device,
    epochs: int,
    options: Options,
    listener: Listener,
    callbacks: Callback | None = None,
    state: RunState | None = None,
    start_epoch: int = 0,
    objective: Objective | None = None,
) -> TrainResult:
    """Train epochs `start_epoch`..`epochs - 1`, validating after each; returns every epoch's measured figures.

    Callbacks run between epochs (after the listener has the epoch's metrics) and
    may end the run early through `state.request_stop`.
    """
    warm.wait_triton()  # Triton's cache key, hashed on a thread while the run prepared: done before any step
    trainer: Trainer = (GraphTrainer if options.graphs else Trainer)(model, optimizer, device, options, plan.transform, objective, plan.train_transform)
    listener.on_start(epochs, len(plan.train), len(plan.val))
    callbacks = callbacks or Callback()
    state = state or RunState(model, optimizer, device, epochs)
    if plan.pending is not None:  # resident_max_gb: auto on CUDA: a measured step decides where the data lives
        note = plan.settle(lambda x, y: _measured_step(trainer, x, y), GRAPH_STEPS if isinstance(trainer, GraphTrainer) else 0)
        options.notes.append(note)
        listener.on_note(note, warn=not plan.resident)  # data on the device as asked: a note; on the host: a warning
        getattr(state.log, "set_tags", lambda tags: None)({"data.path": plan.path, "data.path_reason": plan.reason})
    if trainer.scaler is not None:  # fp16: checkpoints carry the grad scaler; a restored one is used
        trainer.scaler = state.extras.setdefault("scaler", trainer.scaler)
    n_train = plan.train.samples
    n_val = plan.val.samples
    results: list[EpochMetrics] = []
    devices.reset_peak_memory(device)
    peak = 0
    callbacks.on_fit_start(state)
    for epoch in range(start_epoch, epochs):
        state.epoch = epoch
        for batches in (plan.train, plan.val):  # data order: a pure function of (seed, epoch), so resume is exact
            getattr(batches, "set_epoch", lambda e: None)(epoch)
        callbacks.on_epoch_start(state, epoch)
        trainer.loss_sum.zero_()
        lr = optimizer.param_groups[0]["lr"]
        lr = float(lr)  # the rate this epoch trains at (a tensor under graphs: read before the clock)
        devices.synchronize(device)
        t0 = time.perf_counter()
        if epoch == start_epoch and options.compile:
            _compile_or_eager(trainer, plan, listener)  # compilation counts as warm-up
        if epoch == start_epoch and isinstance(trainer, GraphTrainer):
            trainer = _capture_or_eager(trainer, plan, listener)  # capture counts as warm-up
        with profiled(epoch, device, rank(), options.notes):  # MPSRUN_PROFILE_EPOCH: a kernel table, for measuring
            trainer.train_epoch(plan, epoch, listener)
            devices.synchronize(device)
        t1 = time.perf_counter()
        reduce_sums(trainer.loss_sum)  # over every rank of a DDP job; a no-op in one process
        train_loss = trainer.loss_sum.item() / n_train  # the epoch's one read of the loss
        extra = {"lr": lr, **trainer.objective.epoch_metrics()}
        listener.on_validate(epoch)
        trainer.loss_sum.zero_()
        trainer.objective.metrics.reset()
        trainer.val_epoch(plan)
        devices.synchronize(device)
        t2 = time.perf_counter()
        reduce_sums(trainer.loss_sum, *trainer.objective.metrics.tensors())  # the whole validation set, across ranks
        val_loss = trainer.loss_sum.item() / n_val
        extra.update(trainer.objective.metrics.compute(n_val))
        val_acc = extra.pop("val_accuracy", None)
        peak = max(peak, devices.memory_bytes(device))
        m = EpochMetrics(
            epoch=epoch,
            train_loss=train_loss,
            val_loss=val_loss,
            val_accuracy=val_acc,
            epoch_time_s=t2 - t0,
            train_time_s=t1 - t0,
            val_time_s=t2 - t1,
            train_samples_per_s=n_train / max(t1 - t0, 1e-9),
            memory_bytes=peak,
            extra=extra,
        )
        results.append(m)
        listener.on_epoch_end(m)
        state.history.append(m.metrics())
        callbacks.on_epoch_end(state, epoch, m.metrics())
        if state.should_stop:
            break
    callbacks.on_fit_end(state)
    return TrainResult(results, state.stop_reason)


# The kernels GraphTrainer captures instead of torch's (train/kernels/), in the order a failed capture gives them up:
# (option, also the train/kernels module whose Mismatch names it; the trainer's attribute that holds them; the note's words)
_KERNELS = (
    ("fused_pool", "pools", "pools: torch's max-pool kernels, not the fused ones"),
    ("fused_norm", "norms", "norms: torch's batch-norm kernels, not the fused ones"),
    ("fused_linear", "fused", "layers: torch's Linear kernels, not the fused ones"),
)


def _capture_or_eager(trainer: "GraphTrainer", plan: BatchPlan, listener: Listener) -> Trainer:
    """Capture every graph the epochs need; on failure say so and run eager."""
    try:
        trainer.capture(plan)
        return trainer
    except Exception as e:
        from mpsrun.devices import graph_rng

        graph_rng.unstick(getattr(trainer, "device", None))  # a broken capture leaves the generators marked as capturing; every graph goes below
        blamed = type(e).__module__.rsplit(".", 1)[-1]  # a kernel's own Mismatch gives up that kernel, not the first in the table
        for flag, holder, what in sorted(_KERNELS, key=lambda k: k[0] != blamed):  # the kernels first, one at a time
            if getattr(trainer.options, flag):
                why = str(e).splitlines()[0][:300] if str(e) else ""
                note = f"{what} ({type(e).__name__} before or during capture: {why})"
                trainer.options.notes.append(note)
                setattr(trainer.options, flag, False)
                listener.on_note(note)
                trainer.graphs.clear()  # before the plan whose counters they write (fused layers)
                trainer.pool = None
                setattr(trainer, holder, None)
                return _capture_or_eager(trainer, plan, listener)
        note = f"graphs: CUDA graph capture failed ({type(e).__name__}: {e}); running eager"
        trainer.options.notes.append(note)
        trainer.options.graphs = False
        listener.on_note(note)
        return Trainer(trainer.model, trainer.optimizer, trainer.device, trainer.options, trainer.transform, trainer.objective, trainer.train_transform)


def _measured_step(trainer: Trainer, x: torch.Tensor, y: torch.Tensor) -> int:
    """One training step on (x, y), undone (weights, optimizer state, sums, random generators, grad scaler):
    its peak bytes above what was allocated before it, with the optimizer's state then in place (CUDA)."""
    base = getattr(trainer.model, "_orig_mod", trainer.model)
    snapshot = snapshot_state(base, trainer.optimizer, trainer.accumulators())
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state(trainer.device))
    scaler = trainer.scaler.state_dict() if trainer.scaler is not None else None
    torch.cuda.synchronize(trainer.device)
    before = torch.cuda.memory_allocated(trainer.device)
    torch.cuda.reset_peak_memory_stats(trainer.device)
    fused, trainer.fused = trainer.fused, None  # torch's own layers: the fused ones are checked before capture, not here
    hooks, trainer.objective.after_step = trainer.objective.after_step, []  # a per-step schedule: the undone step is no step
    try:
        trainer.model.train()
        trainer.train_step(x, y)
        torch.cuda.synchronize(trainer.device)
        return int(torch.cuda.max_memory_allocated(trainer.device) - before)
    finally:
        trainer.fused = fused
        trainer.objective.after_step = hooks
        restore_state(base, trainer.optimizer, snapshot)
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state(rng[1], trainer.device)
        if scaler is not None and trainer.scaler is not None:
            trainer.scaler.load_state_dict(scaler)


def _first_batch(batches: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch on the device: the first rows where the batches have them (resident, host: no epoch started, no
    feeding thread, no disk window read for one batch), else the loader's first batch."""
    if hasattr(batches, "head"):
        return batches.head(batches.batch_size)
    return next(iter(batches))


def _compile_or_eager(trainer: Trainer, plan: BatchPlan, listener: Listener) -> None:
    """torch.compile fails lazily, at the first call: provoke it now, on one step that is undone.

    On failure the original module (same parameters, same optimizer) runs eager,
    and the fallback is said on screen and recorded.
    """
    base = getattr(trainer.model, "_orig_mod", trainer.model)  # same tensors, stable key names
    snapshot = snapshot_state(base, trainer.optimizer, trainer.accumulators())
    try:
        for kind, batches in (("train", plan.train), ("val", plan.val)):
            x, y = _first_batch(batches)
            if kind == "train":
                trainer.model.train()
                trainer.train_step(x, y)
            else:
                trainer.model.eval()
                with torch.no_grad():
                    trainer.val_step(x, y)
    except Exception as e:
        note = f"compile: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:300]}); running eager"
        trainer.options.notes.append(note)
        trainer.options.compile = False
        trainer.model = base
        listener.on_note(note)
    finally:
        trainer.model.train()
        restore_state(base, trainer.optimizer, snapshot)
