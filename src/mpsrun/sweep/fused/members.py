"""A fused group built from its trials' recipes, each member exactly as `mpsrun run` builds it alone.

Per member, in `runner.prepare`'s order: the recipe's seed set, its dataset (built once per
`dataset:` section and seed, as a worker's cache does), the seed set again, its model built
(so its initial weights are its solo run's), the global generator's state then kept as the
member's own (its dropout masks), its optimizer's arguments resolved with torch's defaults,
its loss and metrics. Members then stack (`layers.Stacked`); what cannot stack raises
Unfusable with the reason, and the group's trials run unfused, said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpsrun.recipe.load import Resolved
from mpsrun.sweep.fused import layers, optim


class Unfusable(Exception):
    """This group cannot train fused (the message says why); its trials run one by one, as without fusing."""


@dataclass
class Member:
    trial: Any
    values: dict[str, Any]
    resolved: Resolved
    tags: dict[str, str]
    seed: int = 0
    source: int = 0  # which of the group's datasets (members whose dataset depends on the seed have their own)
    loss: Any = None
    metrics: Any = None
    hyper: optim.Hyper | None = None
    state: str = "RUNNING"  # then COMPLETE, PRUNED or FAILED
    value: float | None = None
    message: str = ""
    run_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    stop_reason: str | None = None  # its early stopping asked to stop (controls.MemberRun): it leaves the group FINISHED
    end_tags: dict[str, str] = field(default_factory=dict)  # tags its controls set (early stopping's), on its run at its end

    @property
    def number(self) -> int:
        return int(self.trial.number)


@dataclass
class Built:
    members: list[Member]
    stacked: layers.Stacked
    opt: optim.FusedOptimizer
    sources: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # (x_train, y_train, x_val, y_val), on the device
    transform: Any
    choice: Any
    device: torch.device
    batch_size: int
    epochs: int
    ce: dict[str, Any] | None  # batched cross-entropy's arguments; None: each member's own loss, one by one
    splits: Any  # the first member's (dataset inputs, data sizes)
    amp: torch.dtype | None = None  # precision bf16: the forward and the losses under autocast to this dtype, as a run's
    schedules: Any = None  # controls.Schedules: each member's lr schedule (None: no member has one)
    clip: Any = None  # controls.Clip: each member's gradient clip (None: the recipe has no grad_clip)
    stopping: Any = None  # controls.Stopping: each member's early stopping (None: no member has one)
    accumulate: int = 1  # micro-batches per optimizer step (the group's `accumulate`, as a run's Objective has it)


def build(members: list[Member], cache: dict[str, Any]) -> Built:
    """Every member built and stacked on the group's device; Unfusable where they cannot be."""
    from mpsrun.devices import resolve as devices
    from mpsrun.plugins import registry as plugins
    from mpsrun.sweep.trial import data_key
    from mpsrun.train import assemble, runner
    from mpsrun.train.loop.data import raw_tensors
    from mpsrun.train.loop.losses import build_loss
    from mpsrun.train.loop.metrics import MetricSet

    r0 = members[0].resolved.recipe
    try:
        choice = devices.resolve(r0.device, r0.device_fallback)
    except devices.DeviceUnavailable as e:
        raise Unfusable(str(e)) from None
    device = choice.device
    devices.make_current(device)
    amp = _amp(r0.precision, device)
    models: list[nn.Module] = []
    gens: list[torch.Generator] = []
    raw: list[tuple] = []
    first_splits = None
    classes: list[tuple[type, dict[str, Any]]] = []  # each member's optimizer class and arguments (its schedule's shadow)
    for m in members:
        r = m.resolved.recipe
        m.seed = r.seed
        key = data_key(m.resolved)
        if key not in cache:
            runner.seed_everything(r.seed)
            cache[key] = runner.build_data(r, m.resolved)
        splits = cache[key]
        first_splits = first_splits or splits
        runner.seed_everything(r.seed)  # the model's initial weights depend on the seed alone (runner.prepare)
        model = runner.build_model(r, splits)
        if device.type == "cpu":
            g = torch.Generator()
            g.set_state(torch.get_rng_state())  # what the solo run's dropout draws from next
        else:
            g = torch.Generator(device=device).manual_seed(r.seed)
        gens.append(g)
        models.append(model.to(device))
        tr, va = raw_tensors(splits.train), raw_tensors(splits.val)
        if tr is None or va is None:
            raise Unfusable("the dataset is not a TensorDataset (the fused step slices raw tensors on the device)")
        m.source = _source(raw, (tr, va))
        task = assemble.task_of(splits)
        loss_name = r.loss.name if r.loss else None
        m.loss = build_loss(loss_name, r.loss.kwargs if r.loss else {}, task, device)
        info = splits.info or {}
        m.metrics = MetricSet(task, device, r.metrics, splits.num_classes, assemble.num_outputs(splits), info.get("target_mean"), info.get("target_std"))
        cls = plugins.optimizer_class(r.optimizer.name)
        kwargs, errs = plugins.validate_kwargs(cls, r.optimizer.kwargs, ("params",))
        if errs:
            raise Unfusable("; ".join(f"optimizer.{k}: {msg}" for k, msg in errs))
        group = optim.resolved_group(cls, kwargs)
        why = optim.why_not(r.optimizer.name, group)
        if why:
            raise Unfusable(why)
        m.hyper = optim.Hyper.of(r.optimizer.name, group)
        classes.append((cls, kwargs))
    why = layers.why_not(models[0])
    if why:
        raise Unfusable(why)
    if len({layers.signature(x) for x in models}) > 1:
        raise Unfusable("the members' models differ in their layers or shapes")
    if len({(len(s[0][1]), len(s[1][1])) for s in raw}) > 1:
        raise Unfusable("the members' datasets differ in size (their seeds split them differently)")
    if len({h.decoupled for h in (m.hyper for m in members) if h}) > 1:
        raise Unfusable("Adam and AdamW members together")
    sources = [(tr[0].to(device), tr[1].to(device), va[0].to(device), va[1].to(device)) for tr, va in raw]
    stacked = layers.Stacked(models, gens)
    del models
    exact = device.type == "cpu"
    opt = optim.FusedOptimizer(r0.optimizer.name, stacked.params, [m.hyper for m in members if m.hyper], exact)
    ce = None if exact else _batched_ce(members)  # the CPU: each member's own loss object, as alone (bit for bit)
    batches = -(-int(sources[0][0].shape[0]) // r0.batch_size)  # a run's len(plan.train)
    steps = -(-batches // r0.accumulate)  # optimizer steps per epoch, as a run counts them for its schedule (assemble.build)
    scheds, clip, stopping = _controls(members, classes, opt, steps, device, exact)
    return Built(members, stacked, opt, sources, first_splits.transform, choice, device, r0.batch_size, r0.epochs, ce, first_splits, amp,
                 scheds, clip, stopping, r0.accumulate)


def _controls(members: list[Member], classes: list[tuple[type, dict[str, Any]]], opt: optim.FusedOptimizer, steps: int,
              device: torch.device, exact: bool) -> tuple[Any, Any, Any]:
    """Each member's schedule, clip and early stopping (sweep/fused/controls.py); Unfusable where its run would refuse
    them, in its run's words (the trials then run alone, and each refuses it as `mpsrun run` does)."""
    from mpsrun.sweep.fused import controls
    from mpsrun.train.assemble import ControlError
    from mpsrun.train.controls.schedulers import ScheduleError

    why = controls.monitor_why_not(members)
    if why:
        raise Unfusable(why)
    try:
        stopping = controls.Stopping.build(members, members[0].resolved.recipe.epochs)
    except ControlError as e:
        raise Unfusable(str(e)) from None
    try:
        scheds = controls.Schedules.build(members, classes, opt, steps)
    except ScheduleError as e:
        raise Unfusable(str(e)) from None
    clips = [m.resolved.recipe.grad_clip for m in members]
    clip = controls.Clip([c.max_norm for c in clips], device, exact) if clips[0] is not None else None
    return scheds, clip, stopping


def _amp(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `precision` on this device (None: fp32), as a run resolves it (train/precision.py);
    where a run would say why not and use fp32, the trials run unfused, each run saying it."""
    from mpsrun.train.precision import resolve_precision

    resolved, why = resolve_precision(precision, device)
    if why and precision == "bf16":
        raise Unfusable(why)
    return torch.bfloat16 if resolved == "bf16" else None


def _source(raw: list[tuple], data: tuple) -> int:
    """The index of this dataset among the group's (the same tensors, or equal ones, share one)."""
    for i, (tr, va) in enumerate(raw):
        if (tr[0] is data[0][0] and va[0] is data[1][0]) or (
                tr[0].shape == data[0][0].shape and va[0].shape == data[1][0].shape and torch.equal(tr[0], data[0][0])
                and torch.equal(tr[1], data[0][1]) and torch.equal(va[0], data[1][0]) and torch.equal(va[1], data[1][1])):
            return i
    raw.append(data)
    return len(raw) - 1


def _batched_ce(members: list[Member]) -> dict[str, Any] | None:
    """One cross-entropy over all members where every member's loss is the same plain one; else None (one by one)."""
    seen = set()
    for m in members:
        inner = m.loss.inner
        if m.loss.task != "classification" or type(inner) is not nn.CrossEntropyLoss or inner.weight is not None or inner.reduction != "mean":
            return None
        if any(n not in ("accuracy", "top5_accuracy") for n in m.metrics.names):
            return None
        seen.add((inner.ignore_index, inner.label_smoothing))
    if len(seen) != 1:
        return None
    ignore, smooth = seen.pop()
    return {"ignore_index": ignore, "label_smoothing": smooth}


def member_bytes(model: nn.Module, batch_size: int, sample: torch.Tensor) -> int:
    """About one member's memory: parameters, gradients and two optimizer states, and its activations (with their gradients)."""
    params = sum(p.numel() for p in model.parameters()) * 4 * 4
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda mod, i, o: sizes.append(o.numel())) for m in layers.flat_layers(model)]
    try:
        with torch.no_grad():
            model.eval()
            model(sample.unsqueeze(0).float())
    except Exception:  # noqa: BLE001 - a rough estimate: parameters only
        pass
    finally:
        for h in hooks:
            h.remove()
        model.train()
    return params + sum(sizes) * batch_size * 4 * 3
