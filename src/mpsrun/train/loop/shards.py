"""A global batch -> this rank's share, so N ranks follow the single-process trajectory.

`batch_size` in a recipe is the GLOBAL batch. Every rank draws the SAME seeded order
as a single process would (same generator, same calls), cuts it into the same global
batches, and keeps its contiguous share of each: rank r of N takes samples
[r*B/N, (r+1)*B/N) of every global batch of B. DDP averages the ranks' gradients, and
the average of N equal-size batch means is the global batch's mean: the same step a
single process takes, up to float rounding.

The epoch's last, short batch of t samples is shared as evenly as it goes (shares
differ by at most one). Unequal shares would make DDP's plain average weight the
ranks wrongly, so on that step each rank's loss is weighted by share * N / t before
its backward (`StepWeight`, which the step reads): DDP's own C++ all-reduce then
averages to the global batch's mean gradient. (Not a Python communication hook: its
callbacks run on gloo's worker threads and need the GIL there, every step and at
exit; see train/ranks/teardown.py.) A tail smaller than the world size cannot give every
rank a sample, and every rank must take every step (each step is a collective): it
is dropped, said and recorded.

Validation needs no lock-step: each rank takes a contiguous slice of the validation
set and the engine sums loss and correct counts over ranks (`distributed.reduce_sums`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, Subset

from mpsrun.train.ranks import distributed
from mpsrun.train.loop.data import BatchPlan, LoaderBatches, ResidentBatches


@dataclass
class StepWeight:
    """This step's loss weight (share * world / global batch); 1.0 for every full batch. Set by the batches' iterator."""

    value: float = 1.0
    world: int = 1
    start: int = 0  # where this rank's share begins in the step's global batch (the augmentation draws for all of it)
    total: int = 0  # the step's global batch size; 0 outside a sharded epoch


def share_bounds(n: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous near-equal split of n items: [start, end) of `rank`."""
    return n * rank // world, n * (rank + 1) // world


@dataclass
class Layout:
    """Where this rank's samples sit in a global epoch order, and each step's weight."""

    positions: torch.Tensor  # indices into the epoch's global order
    steps: list[int]  # this rank's batch size per step
    starts: list[int]  # where this rank's share begins in each step's global batch
    totals: list[int]  # each step's global batch size
    weights: list[float]  # all-reduce weight per step
    global_samples: int  # samples every rank's steps cover together
    dropped: int  # tail samples nobody takes (tail < world size)


def layout(n: int, batch: int, world: int, rank: int) -> Layout:
    b = batch // world
    full, tail = divmod(n, batch)
    pos: list[torch.Tensor] = []
    if full:
        starts = torch.arange(full) * batch + rank * b
        pos.append((starts[:, None] + torch.arange(b)[None, :]).reshape(-1))
    steps, weights, starts, totals = [b] * full, [1.0] * full, [rank * b] * full, [batch] * full
    dropped = 0
    if tail >= world:
        s, e = share_bounds(tail, world, rank)
        pos.append(torch.arange(full * batch + s, full * batch + e))
        steps.append(e - s)
        weights.append((e - s) * world / tail)
        starts.append(s)
        totals.append(tail)
    else:
        dropped = tail
    positions = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long)
    return Layout(positions, steps, starts=starts, totals=totals, weights=weights, global_samples=n - dropped, dropped=dropped)


class ShardResidentBatches(ResidentBatches):
    """This rank's share of every global batch, sliced from the whole dataset resident on its device.

    The whole dataset stays on every rank's device (one copy each) because the order
    changes every epoch; the gather of the rank's samples is one kernel, as before.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, device: torch.device, seed: int, world: int, rank: int, weight: StepWeight) -> None:
        super().__init__(x, y, batch_size // world, device, True, seed)
        self.global_n = self.n
        self.lay = layout(self.global_n, batch_size, world, rank)
        self.pos = self.lay.positions
        self.n = len(self.pos)  # this rank's samples per epoch (the graph path slices by it)
        self.samples = self.lay.global_samples  # what the metrics divide by: the job's samples
        self.global_batch = batch_size  # accumulation groups global batches, as one process would
        self.weight = weight

    def __len__(self) -> int:
        return len(self.lay.steps)

    def epoch_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        perm = torch.randperm(self.global_n, generator=self._gen)  # the single process's draw
        idx = perm[self.pos].to(self.device, non_blocking=True)
        return self.x.index_select(0, idx), self.y.index_select(0, idx)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.epoch_tensors()
        i = 0
        for size, w, start, total in zip(self.lay.steps, self.lay.weights, self.lay.starts, self.lay.totals):
            self.weight.value, self.weight.start, self.weight.total = w, start, total
            yield x[i : i + size], y[i : i + size]
            i += size


class _ShareSampler(Sampler[list[int]]):
    """The single process's batches (RandomSampler over the loader's generator), this rank's share of each."""

    def __init__(self, n: int, batch: int, world: int, rank: int, generator: torch.Generator) -> None:
        self.n, self.batch, self.world, self.rank = n, batch, world, rank
        self.sampler = RandomSampler(range(n), generator=generator)
        self.lay = layout(n, batch, world, rank)

    def __len__(self) -> int:
        return len(self.lay.steps)

    def __iter__(self) -> Iterator[list[int]]:
        for idx in BatchSampler(self.sampler, self.batch, drop_last=False):
            if len(idx) == self.batch:
                s, e = self.rank * (self.batch // self.world), (self.rank + 1) * (self.batch // self.world)
            elif len(idx) >= self.world:
                s, e = share_bounds(len(idx), self.world, self.rank)
            else:
                continue  # a tail smaller than the world: dropped (noted at setup)
            yield idx[s:e]


class ShardLoaderBatches(LoaderBatches):
    """The DataLoader path with this rank's share of every global batch (workers, pinning as configured)."""

    def __init__(self, base: LoaderBatches, batch_size: int, world: int, rank: int, seed: int, weight: StepWeight) -> None:
        old = base.loader
        gen = torch.Generator().manual_seed(seed)  # one generator for worker seeds and order, as DataLoader(shuffle=True) uses it
        sampler = _ShareSampler(len(old.dataset), batch_size, world, rank, gen)  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {}
        if old.num_workers > 0:
            kwargs["persistent_workers"] = old.persistent_workers
            if old.multiprocessing_context is not None:
                kwargs["multiprocessing_context"] = old.multiprocessing_context
        self.loader = DataLoader(old.dataset, batch_sampler=sampler, generator=gen, num_workers=old.num_workers, pin_memory=old.pin_memory, **kwargs)
        self.lay = sampler.lay
        self.samples = self.lay.global_samples
        self.global_batch = batch_size
        self.device = base.device
        self.non_blocking = base.non_blocking
        self.weight = weight

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for (xb, yb), w, start, total in zip(super().__iter__(), self.lay.weights, self.lay.starts, self.lay.totals):
            self.weight.value, self.weight.start, self.weight.total = w, start, total
            yield xb, yb


def _val_share(val: Any, batch: int, world: int, rank: int) -> Any:
    """A contiguous slice of the validation set; `samples` stays the whole set (the metrics' divisor)."""
    if isinstance(val, ResidentBatches):
        s, e = share_bounds(val.n, world, rank)
        part = ResidentBatches(val.x[s:e], val.y[s:e], max(batch // world, 1), val.device, False, 0)
    else:
        old = val.loader
        s, e = share_bounds(len(old.dataset), world, rank)
        part = LoaderBatches(Subset(old.dataset, range(s, e)), max(batch // world, 1), val.device, False, 0, num_workers=old.num_workers, pin_memory=old.pin_memory)
    part.samples = val.samples
    part.whole = val  # the unshared batches, for rank 0's end-of-run figures
    return part


AUTO_RANK_CAP = 2 * 2**30  # auto's cap on a data-parallel rank: every rank must take the same path, decided before any step


def _place_now(plan: BatchPlan) -> BatchPlan:
    """`resident_max_gb: auto` on a rank of a job: the former rule (2 GiB, and half the free memory), alike on every rank
    of a job of equal GPUs; no rank measures a step of its own, whose peak could differ and split the ranks' paths."""
    p = plan.pending
    assert p is not None
    device = plan.train.device
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else AUTO_RANK_CAP * 2
    room = min(AUTO_RANK_CAP, free // 2)
    if p.total <= room:
        plan.place_pending(True, f"resident_max_gb auto on a rank of a job: {p.total / 2**20:.1f} MiB of raw tensors on the device")
    else:
        plan.place_pending(False, f"resident_max_gb auto on a rank of a job: {p.total / 2**20:.1f} MiB exceeds {room / 2**20:.1f} MiB; "
                           "batches gathered from host memory")
    return plan


def share(plan: BatchPlan, batch_size: int, seed: int) -> tuple[BatchPlan, list[str]]:
    """This rank's plan (unchanged in a single process), and notes to record."""
    ctx = distributed.context()
    if ctx is None:
        return plan, []
    world, rank = ctx.world_size, ctx.rank
    weight = StepWeight(1.0, world)
    if plan.pending is not None:
        plan = _place_now(plan)
    if isinstance(plan.train, ResidentBatches):
        train: Any = ShardResidentBatches(plan.train.x, plan.train.y, batch_size, plan.train.device, seed, world, rank, weight)
    else:
        train = ShardLoaderBatches(plan.train, batch_size, world, rank, seed, weight)
    notes = []
    if train.lay.dropped:
        notes.append(
            f"distributed: the last batch of each epoch ({train.lay.dropped} samples) is smaller than the {world} ranks "
            "and is dropped (every rank must take every step); the trajectory differs from one process there"
        )
    if hasattr(plan.train_transform, "share"):  # device augmentation: parameters drawn for the global batch, sliced
        plan.train_transform.share = weight
    val = _val_share(plan.val, batch_size, world, rank)
    return BatchPlan(train, val, plan.resident, plan.reason + f"; rank {rank}'s share of each global batch of {batch_size}", plan.transform, plan.train_transform), notes
