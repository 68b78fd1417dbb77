"""One training step and one validation step, eager or replayed as CUDA graphs.

Apart from the loop (engine.py) so the loop reads as a script and the step, where
the speed lives, can grow (losses, clipping, accumulation) in a room of its own.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from mpsrun.train.ranks import distributed, graph_sync
from mpsrun.train.loop.data import BatchPlan, ResidentBatches
from mpsrun.train.loop.events import Listener
from mpsrun.train.loop.objective import Objective, micro_batches

if TYPE_CHECKING:
    from mpsrun.train.kernels.fused_linear import Planned
    from mpsrun.train.kernels.fused_norm import Norms
    from mpsrun.train.kernels.fused_pool import Pools

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
    fused_linear: bool = False  # an MLP's Linear (+ ReLU) layers as Triton kernels inside the graphs (fused_linear.py)
    fused_pool: bool = False  # channels_last max-pools as Triton kernels inside the graphs (fused_pool.py)
    fused_norm: bool = False  # batch-norm (+ ReLU/ReLU6/SiLU, + residual add) as Triton kernels inside the graphs (fused_norm.py)
    notes: list[str] = field(default_factory=list)  # fallbacks and skipped optimisations

    def as_params(self) -> dict[str, str]:
        return {
            "resolved.precision": self.precision,
            "resolved.channels_last": str(self.channels_last).lower(),
            "resolved.compile": str(self.compile).lower(),
            "resolved.graphs": str(self.graphs).lower(),
            "resolved.cudnn_benchmark": str(self.cudnn_benchmark).lower(),
            "resolved.fused_linear": str(self.fused_linear).lower(),
            "resolved.fused_pool": str(self.fused_pool).lower(),
            "resolved.fused_norm": str(self.fused_norm).lower(),
        }


class Trainer:
    """Eager training and validation steps; the reference that graphs must match."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        options: Options,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        objective: Objective | None = None,
        train_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.fused: Planned | None = None  # GraphTrainer's fused layers (fused_linear.py), held as long as graphs captured through them
        self.optimizer = optimizer
        self.device = device
        self.options = options
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(options.precision)
        self.scaler = torch.amp.GradScaler(device.type) if options.precision == "fp16" else None
        self.loss_sum = torch.zeros((), device=device)
        self.transform = transform  # the dataset's, applied on the device inside the step
        self.train_transform = train_transform  # training batches only (augmentation); None: `transform`
        self.objective = objective or Objective.default(device)  # loss, metrics, clipping, accumulation
        self.correct = self.objective.metrics.correct  # classification's correct-count (kept by name)

    @property
    def forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The training step's forward: the fused layers' plan where there is one, else the model (as it is now:
        a fallback from compile swaps the model, and must not leave a stale forward behind)."""
        return self.fused if self.fused is not None else self.model

    def accumulators(self) -> tuple[torch.Tensor, ...]:
        """Every device-side sum a step adds to (warm-up and compile probes restore them)."""
        return (self.loss_sum, *self.objective.tensors())

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=cache)

    def prepare(self, x: torch.Tensor, train: bool = False) -> torch.Tensor:
        transform = self.train_transform if train and self.train_transform is not None else self.transform
        if transform is not None:
            x = transform(x)
        if self.options.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def train_step(self, x: torch.Tensor, y: torch.Tensor, cache: bool = True, weight: float = 1.0, first: bool = True, last: bool = True) -> None:
        """One micro-batch; the optimizer steps on the `last` of an accumulation group (see objective.py)."""
        x = self.prepare(x, train=True)
        with self.autocast(cache):
            loss = self.objective.loss.summed(self.forward(x), y, self.loss_sum)  # the epoch's sum gets mean * len(y)
        if first:
            self.optimizer.zero_grad(set_to_none=True)
        scaled = loss if weight == 1.0 else loss * weight
        if last:
            graph_sync.arm()  # data parallel under graphs: buckets all-reduce as backward fills them (a no-op otherwise)
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
            if last:
                graph_sync.sync_grads()  # data parallel under graphs: the ranks' average (a no-op otherwise)
                self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
                self.objective.clip(self.model)
                self.scaler.step(self.optimizer)
                self.scaler.update()
        else:
            scaled.backward()
            if last:
                graph_sync.sync_grads()
                self.objective.clip(self.model)
                self.optimizer.step()
        if last:
            for hook in self.objective.after_step:
                hook()

    def val_step(self, x: torch.Tensor, y: torch.Tensor, cache: bool = True) -> None:
        x = self.prepare(x)
        with self.autocast(cache):
            logits = self.model(x)
        self.objective.loss.summed(logits, y, self.loss_sum)
        self.objective.metrics.update(logits, y)

    def train_epoch(self, plan: BatchPlan, epoch: int, listener: Listener) -> None:
        self.model.train()
        seen = 0
        every = self.options.log_every
        share = getattr(plan.train, "weight", None)  # a DDP rank: its share's loss weight per step (train/loop/shards.py)
        if self.objective.accumulate > 1:  # groups of global batches, as one process makes them
            bs = getattr(plan.train, "global_batch", None) or getattr(plan.train, "batch_size", None) or plan.train.loader.batch_size  # type: ignore[union-attr]
            groups: Any = micro_batches(plan.train.samples, bs, self.objective.accumulate)
        else:
            groups = itertools.repeat((1.0, True, True))
        for step, ((x, y), (weight, first, last)) in enumerate(zip(plan.train, groups), start=1):
            if share is not None:
                weight *= share.value  # set by the batches' iterator for this very step
            with distributed.no_sync(self.model, skip=not last):  # DDP all-reduces once per optimizer step
                self.train_step(x, y, weight=weight, first=first, last=last)
            seen += y.shape[0]
            loss = self.loss_sum.item() / seen if every and step % every == 0 else None
            listener.on_step(epoch, step, seen, loss)

    @torch.no_grad()
    def val_epoch(self, plan: BatchPlan) -> None:
        self.model.eval()
        graph_sync.sync_buffers(self.model)  # rank 0's running statistics, as DDP would evaluate with
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
        if self.options.fused_linear:  # fused layers only where they are replayed: a Triton launch from Python costs more
            from mpsrun.train.kernels import fused_linear

            self.fused = fused_linear.plan(self.model)
        self.pools: Pools | None = None
        if self.options.fused_pool:  # swapped in for warm-up and capture only: the replays run them
            from mpsrun.train.kernels import fused_pool

            self.pools = fused_pool.plan(self.model)
        self.norms: Norms | None = None
        if self.options.fused_norm:
            from mpsrun.train.kernels import fused_norm

            self.norms = fused_norm.plan(self.model)
        self.graphs: dict[tuple[str, int, int, float], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None

    def _graph(self, kind: str, k: int, b: int, x: torch.Tensor, y: torch.Tensor, w: float = 1.0) -> tuple:
        key = (kind, k, b, w)
        if key in self.graphs:
            return self.graphs[key]
        sx = x[: k * b].reshape(k, b, *x.shape[1:]).to(self.device, copy=True)  # host batches: their first rows, copied over
        sy = y[: k * b].reshape(k, b).to(self.device, copy=True)
        step = functools.partial(self.train_step, weight=w) if kind == "train" else self.val_step
        if kind == "train" and self.fused is not None:
            self.fused.check(b)  # fused layers: the same answers as torch's at this batch size, or Mismatch (torch's kernels then)
        snapshot = snapshot_state(self.model, self.optimizer, self.accumulators())
        pools = self.pools.swapped() if self.pools is not None else contextlib.nullcontext()
        norms = self.norms.swapped() if self.norms is not None else contextlib.nullcontext()
        try:
            with pools, norms, torch.no_grad() if kind == "val" else contextlib.nullcontext():
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(3):  # warm-up: lazy state (optimizer, cuBLAS, NCCL's communicator) exists before capture
                        step(sx[0], sy[0], cache=False)
                torch.cuda.current_stream(self.device).wait_stream(side)
                self.optimizer.zero_grad(set_to_none=True)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    for j in range(k):
                        step(sx[j], sy[j], cache=False)
                self.pool = g.pool()
        finally:
            restore_state(self.model, self.optimizer, snapshot)  # captured kernels did not run
        self.graphs[key] = (g, sx, sy)
        return self.graphs[key]

    def _groups(self, batches: ResidentBatches, n: int) -> list[tuple[int, int, float]]:
        """(steps, batch size, loss weight) per replay: full groups, then single steps, then the short batch.

        A data-parallel rank's share (train/loop/shards.py) says its steps and their weights
        itself: its last step may weigh other than 1 even at full size, and every rank must
        replay the same number of steps (each holds an all-reduce).
        """
        b = batches.batch_size
        lay = getattr(batches, "lay", None)
        if lay is not None and n == batches.n:
            full = sum(1 for s, w in zip(lay.steps, lay.weights) if s == b and w == 1.0)
            tail = [(1, s, w) for s, w in zip(lay.steps[full:], lay.weights[full:])]
        else:
            full, tail = n // b, ([(1, n % b, 1.0)] if n % b else [])
        return [(GRAPH_STEPS, b, 1.0)] * (full // GRAPH_STEPS) + [(1, b, 1.0)] * (full % GRAPH_STEPS) + tail

    def capture(self, plan: BatchPlan) -> None:
        """Build every graph an epoch will replay, from the first batches (undone afterwards).

        The same order on every rank of a job (sorted keys): warm-up and capture hold collectives.
        """
        for kind, batches in (("train", plan.train), ("val", plan.val)):
            assert hasattr(batches, "feeder"), "graphs need resident or host batches (train/loop/data.py)"
            if hasattr(batches, "ahead"):  # host batches: device slots for two replays' worth, copied while one runs
                batches.ahead = max(batches.ahead, 2 * GRAPH_STEPS + 2)
            (self.model.train if kind == "train" else self.model.eval)()
            for k, b, w in sorted(set(self._groups(batches, batches.n)), reverse=True):
                if kind == "train":
                    _place_share(batches, b, w)
                self._graph(kind, k, b, *batches.head(k * b), w)
        self.model.train()

    def _replay(self, kind: str, batches: Any, on_group: Callable[[int], None] | None) -> None:
        """Each group's samples into its graph's static input, then the replay: slices of the epoch's device
        tensors (resident), or batches copied from pinned host buffers on a side stream meanwhile (host)."""
        i = 0
        feed = batches.feeder()
        try:
            for k, bs, w in self._groups(batches, batches.n):
                if kind == "train":
                    _place_share(batches, bs, w)  # for a graph captured here, on first use
                key = (kind, k, bs, w)
                g, sx, sy = self.graphs[key] if key in self.graphs else self._graph(kind, k, bs, *batches.head(k * bs), w)
                feed.into(sx, sy)
                g.replay()
                i += k * bs
                if on_group is not None:
                    on_group(i)
        finally:
            feed.close()

    def train_epoch(self, plan: BatchPlan, epoch: int, listener: Listener) -> None:
        self.model.train()
        b = plan.train.batch_size  # type: ignore[union-attr]

        def report(seen: int) -> None:
            listener.on_step(epoch, -(-seen // b), seen, None)

        self._replay("train", plan.train, report)

    @torch.no_grad()
    def val_epoch(self, plan: BatchPlan) -> None:
        self.model.eval()
        graph_sync.sync_buffers(self.model)
        self._replay("val", plan.val, None)


def _place_share(batches: Any, b: int, w: float) -> None:
    """A rank's step of size `b` and weight `w`: where its share sits in the global batch, for the augmentation
    (`augment.DeviceAugment.share`), which reads it while the step is captured. The graphs replay without the
    batches' iterator, which sets it on the eager path. A full step and the tail differ in size or weight."""
    lay, share = getattr(batches, "lay", None), getattr(batches, "weight", None)
    if lay is None or share is None:
        return
    for size, weight, start, total in zip(lay.steps, lay.weights, lay.starts, lay.totals):
        if size == b and weight == w:
            share.start, share.total = start, total
            return


def snapshot_state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Values of everything a warm-up step changes: parameters, buffers, optimizer state, sums."""
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "state": {
            id(p): {k: t.clone() for k, t in st.items() if torch.is_tensor(t)} for p, st in optimizer.state.items()
        },
        "extra": [(t, t.clone()) for t in extra],
    }


@torch.no_grad()
def restore_state(model: nn.Module, optimizer: torch.optim.Optimizer, snap: dict[str, Any]) -> None:
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
