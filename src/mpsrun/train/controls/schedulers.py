"""Learning-rate schedules from the recipe: any torch.optim.lr_scheduler class, warm-up, interval.

Warm-up is torch's own composition (`LinearLR` then the schedule, joined by
`SequentialLR`), so a schedule behaves exactly as the PyTorch documentation says.
An `epoch` schedule steps between epochs (a callback); a `step` schedule steps
after every optimizer step (a hook the eager step calls; no host sync either way).

CUDA graphs bake a float learning rate into the captured kernels, so under graphs
the rate becomes a 1-element tensor on the device that the scheduler fills in
place (torch's schedulers do that for tensor rates) and the replayed kernels read.
Optimizers with `capturable` read a tensor rate natively; plain SGD converts it to
a host number each step (a sync, and an error while capturing), so under graphs on
CUDA SGD is built fused (`fused_sgd`: its one kernel reads the tensor), and elsewhere
its update runs through `TensorLRSGD`, the same arithmetic on foreach kernels with
the rate kept on the device. Others run eager, said and tagged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import lr_scheduler

from mpsrun.plugins import components, registry
from mpsrun.train.controls.callbacks import Callback, RunState


class ScheduleError(ValueError):
    """A schedule the recipe asks for cannot be built (bad input, exit 2)."""


class TensorLRSGD(torch.optim.SGD):
    """torch.optim.SGD's update with a device-tensor learning rate, capturable in a CUDA graph.

    Same rule as torch's SGD (weight decay, momentum, dampening, Nesterov,
    maximize); torch's own foreach path takes the rate as a host scalar.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group["maximize"]:
                grads = torch._foreach_neg(grads)
            if group["weight_decay"]:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            m = group["momentum"]
            if m:
                bufs = []
                for p, g in zip(params, grads):
                    st = self.state[p]
                    if st.get("momentum_buffer") is None:
                        st["momentum_buffer"] = g.detach().clone()
                    else:
                        st["momentum_buffer"].mul_(m).add_(g, alpha=1 - group["dampening"])
                    bufs.append(st["momentum_buffer"])
                grads = torch._foreach_add(grads, bufs, alpha=m) if group["nesterov"] else bufs
            lr = group["lr"]
            if torch.is_tensor(lr):
                torch._foreach_add_(params, torch._foreach_mul(grads, -lr))
            else:
                torch._foreach_add_(params, grads, alpha=-lr)
        return loss


def graph_problem(optimizer_cls: type, interval: str) -> str | None:
    """Why a schedule cannot run under CUDA graphs with this optimizer, or None when it can."""
    if interval == "step":
        return "a per-step schedule changes the rate inside a 16-step graph"
    import inspect

    if "capturable" in inspect.signature(optimizer_cls).parameters or optimizer_cls is torch.optim.SGD:
        return None
    return f"{optimizer_cls.__name__} cannot read a device-tensor learning rate inside a graph"


def tensor_lr(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """Make every group's rate a device tensor the graphs read (before the scheduler records initial_lr).

    A fused SGD (`fused_sgd`, decided when the optimizer is built) reads a tensor rate in
    its one kernel (on the H100 the fashion step: 103 us, against 112 us through
    TensorLRSGD's three; benchmarks/step_kernels_gpu.py); any other plain SGD becomes
    TensorLRSGD. Returns which, for the notes.
    """
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)
    if type(optimizer) is torch.optim.SGD:
        if all(g.get("fused") for g in optimizer.param_groups):
            return "torch's fused SGD reads it"
        optimizer.__class__ = TensorLRSGD
        return "SGD's update runs on foreach kernels that read it"
    return f"{type(optimizer).__name__} reads it (capturable)"


def fused_sgd(cls: type, kwargs: dict[str, Any], params: list[torch.Tensor], device: torch.device, graphs: bool, scheduled: bool) -> bool:
    """Whether to build torch's SGD with `fused=True`: under graphs, with a schedule, on CUDA.

    Same update rule as SGD's default; one kernel that reads a device-tensor rate, where
    the default would run through TensorLRSGD's three. Not with float parameters other
    than float32, `foreach`/`fused`/`differentiable` asked for, or momentum with
    dampening (see late_momentum_buffers).
    """
    if cls is not torch.optim.SGD or not (graphs and scheduled) or device.type != "cuda":
        return False
    if any(k in kwargs for k in ("foreach", "fused", "differentiable")):
        return False
    if kwargs.get("momentum") and kwargs.get("dampening"):
        return False
    return all(p.dtype == torch.float32 for p in params)


def late_momentum_buffers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A step pre-hook for fused SGD: a parameter whose first gradient comes late gets a zero momentum buffer.

    torch's fused SGD treats a step as the first only when no parameter has a buffer, and
    fails on a None buffer otherwise (a head used only on some steps). A zero buffer
    gives what torch's own first step gives, buf = grad, when dampening is 0.
    """
    for g in optimizer.param_groups:
        if not g["momentum"]:
            continue
        grads = [p for p in g["params"] if p.grad is not None]
        missing = [p for p in grads if optimizer.state[p].get("momentum_buffer") is None]
        if missing and len(missing) < len(grads):
            for p in missing:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def build(section: Any, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> tuple[Any, bool]:
    """The scheduler (warm-up composed in) and whether it is a plateau schedule (stepped with a metric)."""
    cls = components.scheduler_class(section.name)
    kwargs, errs = registry.validate_kwargs(cls, section.kwargs, components.SCHEDULER_SKIP)
    if errs:
        raise ScheduleError("; ".join(f"scheduler.{k}: {m}" for k, m in errs))
    plateau = issubclass(cls, lr_scheduler.ReduceLROnPlateau)
    if plateau and section.interval == "step":
        raise ScheduleError("scheduler: ReduceLROnPlateau follows a metric, so its interval must be epoch")
    if plateau and section.warmup_epochs:
        raise ScheduleError("scheduler: warmup_epochs does not combine with ReduceLROnPlateau (SequentialLR cannot chain it)")
    try:
        if not section.warmup_epochs:
            return cls(optimizer, **kwargs), plateau
        iters = section.warmup_epochs * (steps_per_epoch if section.interval == "step" else 1)
        warm = lr_scheduler.LinearLR(optimizer, start_factor=section.warmup_start_factor, end_factor=1.0, total_iters=iters)
        main = cls(optimizer, **kwargs)
        return lr_scheduler.SequentialLR(optimizer, [warm, main], milestones=[iters]), plateau
    except (ValueError, TypeError) as e:
        raise ScheduleError(f"scheduler {cls.__name__}: {e}") from None


class ScheduleCallback(Callback):
    """Steps an epoch-interval schedule after each epoch (the scheduler's own state lives in extras)."""

    def __init__(self, scheduler: Any, plateau: bool, monitor: str) -> None:
        self.scheduler = scheduler
        self.plateau = plateau
        self.monitor = monitor

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        if self.plateau:
            self.scheduler.step(metrics[self.monitor])
        else:
            self.scheduler.step()
