"""The training loop: each epoch trains, then validates; timed with the device synchronised.

Reads top to bottom like a hand-written script, with two differences that make it
fast: losses and correct-counts accumulate on the device and are read once per
epoch (no host sync in the step loop), and on CUDA a whole group of training steps
(forward, backward, optimizer) can be captured once as a CUDA graph and replayed,
which removes per-kernel launch cost for small models. The engine never prints:
it reports to a Listener.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from mpsrun.devices import resolve as devices
from mpsrun.train.callbacks import Callback, RunState
from mpsrun.train.data import BatchPlan, ResidentBatches

GRAPH_STEPS = 16  # training steps per CUDA graph replay


@dataclass
class Options:
    """Speed options after `auto` is resolved for the device; all recorded on the run."""

    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    graphs: bool = False
    log_every: int = 0
    cudnn_benchmark: bool = False
    notes: list[str] = field(default_factory=list)  # fallbacks and skipped optimisations

    def as_params(self) -> dict[str, str]:
        return {
            "resolved.precision": self.precision,
            "resolved.channels_last": str(self.channels_last).lower(),
            "resolved.compile": str(self.compile).lower(),
            "resolved.graphs": str(self.graphs).lower(),
            "resolved.cudnn_benchmark": str(self.cudnn_benchmark).lower(),
        }


@dataclass
class EpochMetrics:
    epoch: int
    train_loss: float
    val_loss: float
    val_accuracy: float
    epoch_time_s: float
    train_time_s: float
    val_time_s: float
    train_samples_per_s: float
    memory_bytes: int

    def metrics(self) -> dict[str, float]:
        return {
            "train_loss": self.train_loss,
            "val_loss": self.val_loss,
            "val_accuracy": self.val_accuracy,
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
            "final_val_accuracy": last.val_accuracy,
            "final_val_loss": last.val_loss,
        }


class Listener:
    """Progress hooks; the CLI draws a bar, the tracker logs. All no-ops here."""

    def on_start(self, epochs: int, train_steps: int, val_steps: int) -> None: ...
    def on_step(self, epoch: int, step: int, samples: int, loss: float | None) -> None: ...
    def on_validate(self, epoch: int) -> None: ...
    def on_epoch_end(self, m: EpochMetrics) -> None: ...
    def on_note(self, message: str) -> None: ...


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

    def on_note(self, message: str) -> None:
        for i in self.items:
            i.on_note(message)


# ----------------------------------------------------------------------------- steps


class Trainer:
    """Eager training and validation steps; the reference that graphs must match."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        options: Options,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.options = options
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.precision)
        self.scaler = torch.amp.GradScaler(device.type) if options.precision == "fp16" else None
        self.loss_sum = torch.zeros((), device=device)
        self.correct = torch.zeros((), dtype=torch.long, device=device)
        self.transform = transform  # the dataset's, applied on the device inside the step

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=cache)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            x = self.transform(x)
        if self.options.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def train_step(self, x: torch.Tensor, y: torch.Tensor, cache: bool = True) -> None:
        x = self.prepare(x)
        with self.autocast(cache):
            loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.loss_sum.add_(loss.detach().float(), alpha=y.shape[0])

    def val_step(self, x: torch.Tensor, y: torch.Tensor, cache: bool = True) -> None:
        x = self.prepare(x)
        with self.autocast(cache):
            logits = self.model(x)
        self.loss_sum.add_(F.cross_entropy(logits.float(), y, reduction="sum"))
        self.correct.add_((logits.argmax(dim=1) == y).sum())

    def train_epoch(self, plan: BatchPlan, epoch: int, listener: Listener) -> None:
        self.model.train()
        seen = 0
        every = self.options.log_every
        for step, (x, y) in enumerate(plan.train, start=1):
            self.train_step(x, y)
            seen += y.shape[0]
            loss = self.loss_sum.item() / seen if every and step % every == 0 else None
            listener.on_step(epoch, step, seen, loss)

    @torch.no_grad()
    def val_epoch(self, plan: BatchPlan) -> None:
        self.model.eval()
        for x, y in plan.val:
            self.val_step(x, y)


class GraphTrainer(Trainer):
    """Replays CUDA graphs of GRAPH_STEPS whole training steps over resident data.

    Only for resident batches (static shapes, data already on the device). Batch
    groups that do not fill a graph (the epoch's tail, the last short batch) get
    graphs of their own, so every step replays. Capture needs eager warm-up steps;
    the model and optimizer are restored afterwards so warm-up teaches nothing.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def _graph(self, kind: str, k: int, b: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
        key = (kind, k, b)
        if key in self.graphs:
            return self.graphs[key]
        sx = x[: k * b].reshape(k, b, *x.shape[1:]).clone()
        sy = y[: k * b].reshape(k, b).clone()
        step = self.train_step if kind == "train" else self.val_step
        snapshot = _snapshot(self.model, self.optimizer, (self.loss_sum, self.correct))
        try:
            with torch.no_grad() if kind == "val" else contextlib.nullcontext():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(3):  # warm-up: lazy state (optimizer, cuBLAS) exists before capture
                        step(sx[0], sy[0], cache=False)
                torch.cuda.current_stream(self.device).wait_stream(side)
                self.optimizer.zero_grad(set_to_none=True)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    for j in range(k):
                        step(sx[j], sy[j], cache=False)
                self.pool = g.pool()
        finally:
            _restore(self.model, self.optimizer, snapshot)  # captured kernels did not run
        self.graphs[key] = (g, sx, sy)
        return self.graphs[key]

    def _groups(self, n: int, b: int) -> list[tuple[int, int]]:
        """(steps, batch size) per replay: full groups, then single steps, then the short batch."""
        full = n // b
        groups = [(GRAPH_STEPS, b)] * (full // GRAPH_STEPS) + [(1, b)] * (full % GRAPH_STEPS)
        if n % b:
            groups.append((1, n % b))
        return groups

    def capture(self, plan: BatchPlan) -> None:
        """Build every graph an epoch will replay, from the first batches (undone afterwards)."""
        for kind, batches in (("train", plan.train), ("val", plan.val)):
            assert isinstance(batches, ResidentBatches)
            (self.model.train if kind == "train" else self.model.eval)()
            for k, b in sorted(set(self._groups(batches.n, batches.batch_size)), reverse=True):
                self._graph(kind, k, b, batches.x[: k * b], batches.y[: k * b])
        self.model.train()

    def _replay(self, kind: str, batches: ResidentBatches, x: torch.Tensor, y: torch.Tensor, on_group: Callable[[int], None] | None) -> None:
        i = 0
        for k, bs in self._groups(len(y), batches.batch_size):
            xs, ys = x[i : i + k * bs], y[i : i + k * bs]
            g, sx, sy = self._graph(kind, k, bs, xs, ys)
            sx.copy_(xs.view(sx.shape))
            sy.copy_(ys.view(sy.shape))
            g.replay()
            i += k * bs
            if on_group is not None:
                on_group(i)

    def train_epoch(self, plan: BatchPlan, epoch: int, listener: Listener) -> None:
        assert isinstance(plan.train, ResidentBatches)
        self.model.train()
        x, y = plan.train.epoch_tensors()
        b = plan.train.batch_size

        def report(seen: int) -> None:
            listener.on_step(epoch, -(-seen // b), seen, None)

        self._replay("train", plan.train, x, y, report)

    @torch.no_grad()
    def val_epoch(self, plan: BatchPlan) -> None:
        assert isinstance(plan.val, ResidentBatches)
        self.model.eval()
        x, y = plan.val.epoch_tensors()
        self._replay("val", plan.val, x, y, None)


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, extra: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Values of everything a warm-up step changes: parameters, buffers, optimizer state, sums."""
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": {
            id(p): {k: t.clone() for k, t in st.items() if torch.is_tensor(t)} for p, st in optimizer.state.items()
        },
        "extra": [(t, t.clone()) for t in extra],
    }


@torch.no_grad()
def _restore(model: nn.Module, optimizer: torch.optim.Optimizer, snap: dict[str, Any]) -> None:
    """Undo warm-up in place: graphs keep pointers to these very tensors."""
    for k, v in model.state_dict().items():
        v.copy_(snap["params"][k])
    for p, state in optimizer.state.items():
        saved = snap["state"].get(id(p))
        for k, t in state.items():
            if not torch.is_tensor(t):
                continue
            if saved is not None and k in saved:
                t.copy_(saved[k])
            else:  # created by the warm-up: a fresh optimizer starts from zero
                t.zero_()
    for t, saved in snap["extra"]:
        t.copy_(saved)


# ----------------------------------------------------------------------------- loop


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
) -> TrainResult:
    """Train epochs `start_epoch`..`epochs - 1`, validating after each; returns every epoch's measured figures.

    Callbacks run between epochs (after the listener has the epoch's metrics) and
    may end the run early through `state.request_stop`.
    """
    trainer: Trainer = (GraphTrainer if options.graphs else Trainer)(model, optimizer, device, options, plan.transform)
    listener.on_start(epochs, len(plan.train), len(plan.val))
    callbacks = callbacks or Callback()
    state = state or RunState(model, optimizer, device, epochs)
    n_train = plan.train.samples
    n_val = plan.val.samples
    results: list[EpochMetrics] = []
    devices.reset_peak_memory(device)
    peak = 0
    callbacks.on_fit_start(state)
    for epoch in range(start_epoch, epochs):
        state.epoch = epoch
        callbacks.on_epoch_start(state, epoch)
        trainer.loss_sum.zero_()
        devices.synchronize(device)
        t0 = time.perf_counter()
        if epoch == start_epoch and options.compile:
            _compile_or_eager(trainer, plan, listener)  # compilation counts as warm-up
        if epoch == start_epoch and isinstance(trainer, GraphTrainer):
            trainer = _capture_or_eager(trainer, plan, listener)  # capture counts as warm-up
        trainer.train_epoch(plan, epoch, listener)
        devices.synchronize(device)
        t1 = time.perf_counter()
        train_loss = trainer.loss_sum.item() / n_train  # the epoch's one read of the loss
        listener.on_validate(epoch)
        trainer.loss_sum.zero_()
        trainer.correct.zero_()
        trainer.val_epoch(plan)
        devices.synchronize(device)
        t2 = time.perf_counter()
        val_loss = trainer.loss_sum.item() / n_val
        val_acc = trainer.correct.item() / n_val
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
        )
        results.append(m)
        listener.on_epoch_end(m)
        state.history.append(m.metrics())
        callbacks.on_epoch_end(state, epoch, m.metrics())
        if state.should_stop:
            break
    callbacks.on_fit_end(state)
    return TrainResult(results, state.stop_reason)


def _capture_or_eager(trainer: "GraphTrainer", plan: BatchPlan, listener: Listener) -> Trainer:
    """Capture every graph the epochs need; on failure say so and run eager."""
    try:
        trainer.capture(plan)
        return trainer
    except Exception as e:
        note = f"graphs: CUDA graph capture failed ({type(e).__name__}: {e}); running eager"
        trainer.options.notes.append(note)
        trainer.options.graphs = False
        listener.on_note(note)
        return Trainer(trainer.model, trainer.optimizer, trainer.device, trainer.options, trainer.transform)


def _first_batch(batches: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batches, ResidentBatches):
        return batches.x[: batches.batch_size], batches.y[: batches.batch_size]
    return next(iter(batches))


def _compile_or_eager(trainer: Trainer, plan: BatchPlan, listener: Listener) -> None:
    """torch.compile fails lazily, at the first call: provoke it now, on one step that is undone.

    On failure the original module (same parameters, same optimizer) runs eager,
    and the fallback is said on screen and recorded.
    """
    base = getattr(trainer.model, "_orig_mod", trainer.model)  # same tensors, stable key names
    snapshot = _snapshot(base, trainer.optimizer, (trainer.loss_sum, trainer.correct))
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
        _restore(base, trainer.optimizer, snapshot)
