"""The fused group's epochs: each member's data order, one forward and backward for all, one update.

Per epoch, like the solo engine (train/loop/engine.py): each member's shuffle is its solo run's
(`torch.randperm` with the generator seeded `epoch_seed(seed, epoch)`, the resident path's),
members with the same seed and dataset share each batch (gathered once), the training loss
and validation sums accumulate on the device and are read once at the epoch's end. Then each
member's epoch goes to its early stopping, then to `on_epoch` (its run, the pruner, the non-finite
guard), in a run's callback order; either may end it: a member that ends leaves the group at once
(every stacked tensor narrowed to the others). With `accumulate: k` the optimizer steps once per k
micro-batches, each weighted by its share of its group's samples, as a run's step does (objective.py).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from mpsrun.sweep.fused.members import Built, Member
from mpsrun.train.loop.objective import micro_batches

# on_epoch(member, epoch, metrics) -> None to go on, or the member's end: ("PRUNED" | "FAILED", message). Called after
# the member's early stopping (which sets member.stop_reason): None for a member that asked to stop ends it COMPLETE.
OnEpoch = Callable[[Member, int, dict[str, float]], "tuple[str, str] | None"]


class Group:
    def __init__(self, b: Built) -> None:
        self.b = b
        self.active: list[Member] = list(b.members)
        self.ntr = int(b.sources[0][1].shape[0])
        self.nva = int(b.sources[0][3].shape[0])
        dev = b.device
        self.loss_sum = torch.zeros(len(self.active), device=dev)

    # -- data
    def _streams(self) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        """The distinct (dataset, seed) pairs among the active members, and each member's index among them (None: one pair)."""
        pairs: list[tuple[int, int]] = []
        which = []
        for m in self.active:
            key = (m.source, m.seed)
            if key not in pairs:
                pairs.append(key)
            which.append(pairs.index(key))
        return pairs, (torch.tensor(which, device=self.b.device) if len(pairs) > 1 else None)

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """The dataset's transform on the device, over [K, B, ...] as one batch of K*B."""
        if self.b.transform is None:
            return x.float() if not x.is_floating_point() else x
        k, n = x.shape[0], x.shape[1]
        y = self.b.transform(x.reshape(k * n, *x.shape[2:]))
        return y.reshape(k, n, *y.shape[1:])

    def _gather(self, pairs: list[tuple[int, int]], idx: torch.Tensor, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per stream the rows `idx` [S, n] of its dataset's split (`part` 0: train, 2: validation): [S, n, ...].

        Streams of one dataset (members that differ in seed only) gather in one `index_select`."""
        srcs = self.b.sources
        s, n = idx.shape
        if len({src for src, _ in pairs}) == 1:
            x, y = srcs[pairs[0][0]][part], srcs[pairs[0][0]][part + 1]
            flat = idx.reshape(-1)
            return x.index_select(0, flat).view(s, n, *x.shape[1:]), y.index_select(0, flat).view(s, n, *y.shape[1:])
        xs = [srcs[src][part].index_select(0, idx[k]) for k, (src, _) in enumerate(pairs)]
        ys = [srcs[src][part + 1].index_select(0, idx[k]) for k, (src, _) in enumerate(pairs)]
        return torch.stack(xs), torch.stack(ys)

    def _batch(self, x: torch.Tensor, y: torch.Tensor, which: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per stream its batch [S, B, ...], prepared, then per member its stream's: [M, B, ...] (a view where all share one)."""
        x = self._prepare(x)
        m = len(self.active)
        if which is None:
            return x.expand(m, *x.shape[1:]), y.expand(m, *y.shape[1:])
        return x.index_select(0, which), y.index_select(0, which)

    # -- the epochs
    def run(self, on_epoch: OnEpoch, listen: Callable[[int, float], None] | None = None) -> None:
        from mpsrun.devices import resolve as devices
        from mpsrun.train.loop.data import epoch_seed

        b = self.b
        for epoch in range(b.epochs):
            if not self.active:
                return
            pairs, which = self._streams()
            perms = [torch.randperm(self.ntr, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch))).to(b.device) for _, seed in pairs]
            devices.synchronize(b.device)
            t0 = time.perf_counter()
            self.loss_sum.zero_()
            lrs = [m.hyper.lr if m.hyper else float("nan") for m in self.active]  # the rates this epoch trains at (a run logs them)
            b.stacked.train()
            self._train_epoch(pairs, which, torch.stack(perms))
            devices.synchronize(b.device)
            t1 = time.perf_counter()
            train_loss = [v / self.ntr for v in self.loss_sum.tolist()]  # the epoch's one read
            val = self._validate(pairs, which)
            devices.synchronize(b.device)
            t2 = time.perf_counter()
            mem = devices.memory_bytes(b.device)
            norms = b.clip.epoch_values() if b.clip is not None else None
            ended: list[int] = []
            every: list[dict[str, float]] = []
            for j, m in enumerate(list(self.active)):
                metrics = {"train_loss": train_loss[j], **val[j], "lr": lrs[j], **({"grad_norm": norms[j]} if norms else {}),
                           "epoch_time_s": t2 - t0, "train_time_s": t1 - t0, "val_time_s": t2 - t1,
                           "train_samples_per_s": self.ntr / max(t1 - t0, 1e-9), "memory_bytes": float(mem)}
                m.history.append(metrics)
                every.append(metrics)
                if b.stopping is not None and nonfinite(metrics, epoch, b.epochs) is None:  # a run's guard stops it before
                    b.stopping.after_epoch(j, epoch, metrics)  # its callbacks: early stopping, then the trial's pruner
                verdict = on_epoch(m, epoch, metrics)
                if verdict is None and m.stop_reason is not None:  # stopped early: FINISHED, its trial COMPLETE (as alone)
                    verdict = ("COMPLETE", m.stop_reason)
                if verdict is not None:
                    m.state, m.message = verdict
                    ended.append(j)
            if b.schedules is not None:  # a run's ScheduleCallback: after the epoch's metrics, each member's own
                b.schedules.after_epoch(every)
            if listen is not None:
                listen(epoch, t2 - t0)
            if ended:
                self._leave(ended)
        for m in self.active:
            m.state = "COMPLETE" if m.state == "RUNNING" else m.state

    def _train_epoch(self, pairs: list[tuple[int, int]], which: torch.Tensor | None, perm: torch.Tensor) -> None:
        """The epoch's steps, eager: `perm` [S, n] each stream's order (graphed.py replays them instead).
        With accumulate > 1 the micro-batches' weights and groups are a run's (objective.micro_batches)."""
        bs = self.b.batch_size
        sched = self.b.schedules if self.b.schedules is not None and self.b.schedules.per_step else None
        acc = self.b.accumulate
        groups = micro_batches(self.ntr, bs, acc) if acc > 1 else itertools.repeat((1.0, True, True))
        for i, (weight, first, last) in zip(range(0, self.ntr, bs), groups):
            x, y = self._batch(*self._gather(pairs, perm[:, i : i + bs], 0), which)
            self._train_step(x, y, weight, first, last)
            if last and sched is not None:
                sched.after_step()  # `interval: step` schedules, after each optimizer step (a run's Objective.after_step)

    def amp(self) -> contextlib.AbstractContextManager:
        """precision bf16: the forward and the losses under autocast, as a run's step has them (train/loop/steps.py);
        its cast cache off, as under a run's capture (graphs hold the casts' outputs, not a cache)."""
        if self.b.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.b.device.type, dtype=self.b.amp, cache_enabled=False)

    def _train_step(self, x: torch.Tensor, y: torch.Tensor, weight: float = 1.0, first: bool = True, last: bool = True) -> None:
        """One micro-batch of every member: gradients cleared on the `first` of an accumulation group, each member's
        loss scaled by `weight` (its share of the group's samples), the clip and the update on the `last` (a run's
        Trainer.train_step)."""
        b = self.b
        with self.amp():
            out = b.stacked(x)
            if b.ce is not None:
                m, n = out.shape[0], out.shape[1]
                per = F.cross_entropy(out.reshape(m * n, -1).float(), y.reshape(m * n), reduction="none", **b.ce)
                losses = per.view(m, n).mean(1)
            else:
                losses = torch.stack([mem.loss(out[j], y[j]) for j, mem in enumerate(self.active)])
        self.loss_sum.add_(losses.detach().float(), alpha=y.shape[1])  # the epoch's sum gets mean * len(y), as alone
        if first:
            b.opt.zero_grad()
        scaled = losses if weight == 1.0 else losses * weight  # a run's `loss * weight`, member by member
        scaled.sum().backward()  # each member's loss has gradient `weight`: its parameters get its own gradients
        if not last:
            return
        if b.clip is not None:
            b.clip.clip(b.stacked.params)  # each member by its own norm, as its run's Objective.clip
        b.opt.step()

    @torch.no_grad()
    def _validate(self, pairs: list[tuple[int, int]], which: torch.Tensor | None) -> list[dict[str, float]]:
        b = self.b
        b.stacked.eval()
        bs, mcount = b.batch_size, len(self.active)
        sums = (torch.zeros(mcount, device=b.device), torch.zeros(mcount, dtype=torch.long, device=b.device),
                torch.zeros(mcount, dtype=torch.long, device=b.device))  # loss sum, correct, top-5 correct
        if b.ce is None:
            for mem in self.active:
                mem.metrics.reset()
        for i in range(0, self.nva, bs):
            xs = [b.sources[s][2][i : i + bs] for s, _ in pairs]
            ys = [b.sources[s][3][i : i + bs] for s, _ in pairs]
            x, y = self._batch(torch.stack(xs), torch.stack(ys), which)
            with self.amp():
                out = b.stacked(x)
                if b.ce is not None:
                    self._val_sums(out, y, *sums)
                else:
                    for j, mem in enumerate(self.active):
                        mem.loss.summed(out[j], y[j], sums[0][j])
                        mem.metrics.update(out[j], y[j])
        if b.ce is None:
            losses = [v / self.nva for v in sums[0].tolist()]
            return [{"val_loss": losses[j], **mem.metrics.compute(self.nva)} for j, mem in enumerate(self.active)]
        return self._val_metrics(*sums)

    def _val_sums(self, out: torch.Tensor, y: torch.Tensor, vsum: torch.Tensor, correct: torch.Tensor, top5: torch.Tensor) -> None:
        """One validation batch of every member into the device-side sums (batched cross-entropy)."""
        m, n = out.shape[0], y.shape[1]
        per = F.cross_entropy(out.reshape(m * n, -1).float(), y.reshape(m * n), reduction="none", **self.b.ce)  # type: ignore[arg-type]
        vsum.add_(per.view(m, n).mean(1), alpha=n)
        correct.add_((out.argmax(-1) == y).sum(1))
        if out.shape[-1] > 10:
            top5.add_((out.topk(5, dim=-1).indices == y.unsqueeze(-1)).any(-1).sum(1))

    def _val_metrics(self, vsum: torch.Tensor, correct: torch.Tensor, top5: torch.Tensor) -> list[dict[str, float]]:
        """The epoch's one read of the sums: each member's validation metrics."""
        losses = [v / self.nva for v in vsum.tolist()]
        acc, t5 = correct.tolist(), top5.tolist()
        out_metrics = []
        for j, mem in enumerate(self.active):
            d = {"val_loss": losses[j], "val_accuracy": acc[j] / self.nva}
            if "top5_accuracy" in mem.metrics.names:
                d["val_top5_accuracy"] = t5[j] / self.nva
            out_metrics.append(d)
        return out_metrics

    def _leave(self, ended: list[int]) -> None:
        """The ended members leave the group now: the others' stacked parameters, state and data go on without them."""
        keep = [j for j in range(len(self.active)) if j not in ended]
        self.active = [self.active[j] for j in keep]
        if not keep:
            return
        self.loss_sum = torch.zeros(len(keep), device=self.b.device)
        self.b.stacked.keep(keep)
        self.b.opt.keep(keep, self.b.stacked.params)
        for control in (self.b.schedules, self.b.clip, self.b.stopping):  # their schedules, clips and stopping leave with them
            if control is not None:
                control.keep(keep)


def nonfinite(metrics: dict[str, float], epoch: int, epochs: int) -> str | None:
    """The non-finite guard's words (train/keep/guard.py) for a member whose loss went NaN or infinite."""
    bad = {k: v for k, v in metrics.items() if k.endswith("loss") and not math.isfinite(v)}
    if not bad:
        return None
    what = ", ".join(f"{k}={v}" for k, v in bad.items())
    return f"NonFiniteLoss: non-finite loss at epoch {epoch + 1} of {epochs} (MLflow step {epoch}): {what}; this member left its fused group, the others went on"
