"""Each member's learning-rate schedule, gradient clip and early stopping in the fused step, with the single run's code.

Schedules: every member gets a shadow optimizer (its own torch.optim class and param group, one dummy
parameter) on which `train/controls/schedulers.build` builds the member's scheduler, exactly as a run builds
it on its optimizer (warm-up composed in, any torch.optim.lr_scheduler class). It is stepped when the run
would step it (after each optimizer step for `interval: step`, after the epoch's metrics for `epoch`,
ReduceLROnPlateau fed the monitored metric), and the shadow's rate is copied into the fused optimizer
(`FusedOptimizer.set_lr`): a member's rates are its run's, float for float.

Clipping: each member's gradients scaled by its own total 2-norm with clip_grad_norm_'s arithmetic
(coef = max_norm / (norm + 1e-6), clamped to 1). On the CPU each member's norm is torch's own
`get_total_norm` over that member's gradient slices (the run's clip_grad_norm_, bit for bit); on devices
one batched norm per parameter (no host sync: capturable in the group's CUDA graphs).

Early stopping: every member gets the `EarlyStopping` callback its run builds (`assemble.early_stopping`), called
after each epoch with a `MemberRun` (what the callback reads of a run): its tags go on the member's run at its end,
its request to stop makes the member leave the group (engine.py), FINISHED, as its run would stop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import lr_scheduler

from mpsrun.sweep.fused.optim import FusedOptimizer
from mpsrun.train.controls.callbacks import Callback

IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")  # how a solo optimizer steps, not what its group holds


class Schedules:
    """The active members' schedulers (None for a member without one), in the group's member order."""

    def __init__(self, shadows: list[tuple[torch.optim.Optimizer, Any, bool, Any] | None], opt: FusedOptimizer) -> None:
        self.shadows = shadows  # per member: (shadow optimizer, scheduler, plateau, its scheduler section)
        self.opt = opt
        self.per_step = any(s is not None and s[3].interval == "step" for s in shadows)
        self.sync()

    @classmethod
    def build(cls, members: list[Any], classes: list[tuple[type, dict[str, Any]]], opt: FusedOptimizer, steps_per_epoch: int) -> "Schedules | None":
        """Each member's scheduler as its run builds it (`schedulers.build`); None when no member has one.
        Raises schedulers.ScheduleError where a run would refuse the schedule (the trials then run alone and say it)."""
        from mpsrun.train.controls import schedulers

        shadows: list[tuple[torch.optim.Optimizer, Any, bool, Any] | None] = []
        for m, (ocls, kwargs) in zip(members, classes):
            section = m.resolved.recipe.scheduler
            if section is None:
                shadows.append(None)
                continue
            group = {k: v for k, v in kwargs.items() if k not in IMPLEMENTATION}
            shadow = ocls([torch.zeros(1, requires_grad=True)], **group)
            sched, plateau = schedulers.build(section, shadow, steps_per_epoch)
            shadow._opt_called = True  # type: ignore[attr-defined] - the fused update is its step: torch's order warning is not ours
            shadows.append((shadow, sched, plateau, section))
        return cls(shadows, opt) if any(s is not None for s in shadows) else None

    def lrs(self) -> list[float]:
        return [float(s[0].param_groups[0]["lr"]) if s is not None else h.lr for s, h in zip(self.shadows, self.opt.hypers)]

    def sync(self) -> None:
        """The shadows' rates into the fused optimizer."""
        self.opt.set_lr(self.lrs())

    def after_step(self) -> None:
        """After each optimizer step: the `interval: step` schedules (a run's `Objective.after_step`)."""
        if not self.per_step:
            return
        for s in self.shadows:
            if s is not None and s[3].interval == "step":
                s[1].step()
        self.sync()

    def after_epoch(self, metrics: list[dict[str, float]]) -> None:
        """After the epoch's metrics: the `interval: epoch` schedules (a run's ScheduleCallback), each member's own."""
        for s, mt in zip(self.shadows, metrics):
            if s is None or s[3].interval != "epoch":
                continue
            if s[2]:
                s[1].step(mt[s[3].monitor])
            else:
                s[1].step()
        self.sync()

    def keep(self, idx: list[int]) -> None:
        """Only these members go on (after the optimizer's own `keep`): their schedulers with them."""
        self.shadows = [self.shadows[j] for j in idx]
        self.per_step = any(s is not None and s[3].interval == "step" for s in self.shadows)


class Clip:
    """Per member: clip its gradients by its own total 2-norm; keep the epoch's largest pre-clip norm (grad_norm)."""

    def __init__(self, max_norms: list[float], device: torch.device, exact: bool) -> None:
        self.max_norms = max_norms
        self.exact = exact
        self.device = device
        self._tensors()

    def _tensors(self) -> None:
        self.max_norm = torch.tensor(self.max_norms, dtype=torch.float32, device=self.device)
        self.peak = torch.zeros(len(self.max_norms), device=self.device)  # each member's largest pre-clip norm this epoch

    @torch.no_grad()
    def norms(self, params: list[torch.Tensor]) -> torch.Tensor:
        """Each member's total gradient 2-norm [M]."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.exact:  # torch's own, per member, over its gradients' slices: what its run's clip_grad_norm_ computes
            return torch.stack([torch.nn.utils.get_total_norm([g[j] for g in grads], 2.0) for j in range(len(self.max_norms))])
        per = torch.stack([torch.linalg.vector_norm(g.flatten(1).float(), 2.0, dim=1) for g in grads], 1)  # [M, tensors]
        return torch.linalg.vector_norm(per, 2.0, dim=1)

    @torch.no_grad()
    def clip(self, params: list[torch.Tensor]) -> None:
        """After backward, before the optimizer's step."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        total = self.norms(params)
        if self.exact:  # clip_grad_norm_'s expressions per member (a float over a 0-d tensor is torch's reciprocal-multiply)
            coef = torch.stack([torch.clamp(mx / (total[j] + 1e-6), max=1.0) for j, mx in enumerate(self.max_norms)])
        else:
            coef = torch.clamp((total + 1e-6).reciprocal() * self.max_norm, max=1.0)  # as `max_norm / tensor` computes it
        torch.maximum(self.peak, total.float(), out=self.peak)
        for g in grads:
            g.mul_(coef.to(g.dtype).view(-1, *([1] * (g.dim() - 1))))

    def epoch_values(self) -> list[float]:
        """Each member's grad_norm for the epoch (the epoch's one read), reset for the next."""
        out = self.peak.tolist()
        self.peak.zero_()
        return out

    def keep(self, idx: list[int]) -> None:
        self.max_norms = [self.max_norms[j] for j in idx]
        self._tensors()


class MemberRun:
    """One member's run as a callback sees it: the part of a run's RunState (train/controls/callbacks.py) that
    EarlyStopping reads. `log.set_tags` collects into `member.end_tags` (written on its run when it ends, record.end);
    `request_stop` keeps the first reason in `member.stop_reason`, as RunState keeps it."""

    def __init__(self, member: Any, epochs: int) -> None:
        self.member = member
        self.epochs = epochs  # planned
        self.log = self

    def set_tags(self, tags: dict[str, str]) -> None:
        self.member.end_tags.update(tags)

    def request_stop(self, reason: str) -> None:
        if self.member.stop_reason is None:
            self.member.stop_reason = reason

    @property
    def should_stop(self) -> bool:
        return self.member.stop_reason is not None


class Stopping:
    """The active members' early stopping (None for a member without), in the group's member order."""

    def __init__(self, items: list[tuple[Callback | None, MemberRun]]) -> None:
        self.items = items

    @classmethod
    def build(cls, members: list[Any], epochs: int) -> "Stopping | None":
        """Each member's EarlyStopping as its run builds it; None when no member has one. Raises ControlError where
        its run would refuse it (a monitor that is not a metric of the run), with the run's words."""
        from mpsrun.train.assemble import early_stopping

        items = [(early_stopping(m.resolved.recipe, types_objective(m)), MemberRun(m, epochs)) for m in members]
        return cls(items) if any(es is not None for es, _ in items) else None

    def after_epoch(self, j: int, epoch: int, metrics: dict[str, float]) -> None:
        """Member j's epoch to its early stopping (a run's callback, before the trial's pruner); a stop it asks for
        is the member's `stop_reason`, which the engine ends it by."""
        es, run = self.items[j]
        if es is not None:
            es.on_epoch_end(run, epoch, metrics)  # type: ignore[arg-type] - a MemberRun: what EarlyStopping reads of a run

    def keep(self, idx: list[int]) -> None:
        self.items = [self.items[j] for j in idx]


def types_objective(m: Any) -> Any:
    """What `assemble.metric_names` reads of an objective: its metrics and whether it clips (then it logs grad_norm)."""
    import types

    return types.SimpleNamespace(metrics=m.metrics, grad_norm=True if m.resolved.recipe.grad_clip is not None else None)


def monitor_why_not(members: list[Any]) -> str | None:
    """Why a member's ReduceLROnPlateau monitor is not a metric its run logs, in the run's own words (its check,
    `assemble.check_monitor`, refuses it), or None. Early stopping's is checked as it is built (Stopping.build)."""
    from mpsrun.plugins import components
    from mpsrun.train.assemble import ControlError, check_monitor

    for m in members:
        s = m.resolved.recipe.scheduler
        if s is not None and issubclass(components.scheduler_class(s.name), lr_scheduler.ReduceLROnPlateau):
            try:
                check_monitor("scheduler.monitor", s.monitor, types_objective(m))
            except ControlError as e:
                return str(e)
    return None
