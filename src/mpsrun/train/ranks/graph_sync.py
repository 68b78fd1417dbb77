"""Data parallel inside a CUDA graph: each rank's gradients averaged by one NCCL all-reduce in the step.

Why not DDP here: DDP's reducer launches its bucketed all-reduces from autograd hooks
and keeps Python-side state between steps, which a replayed graph does not re-run; a
graph captured around it needs DDP built on a side stream, eleven eager warm-up steps
and its static-graph mode, and still replays DDP's many buckets. A launch-bound step
(batch 64 per GPU) is what DDP handles worst and graphs handle best, so under NCCL with
graphs on, each rank keeps its plain module and, after backward, averages every
gradient with ONE all-reduce over a flat copy: three kernels and one collective,
captured with the rest of the step (NCCL collectives are capturable once the
communicator exists; the eager warm-up steps create it). The average is DDP's (sum over
ranks / world size), so the trajectory is the single process's, as with DDP.

What DDP did besides, done here too: rank 0's parameters are broadcast once at the start
(identical anyway: every rank seeds the same), and buffers (BatchNorm's running
statistics) are broadcast from rank 0 before each validation, which is what DDP's
broadcast at each forward leaves the evaluation with.

A no-op everywhere else: `sync_grads` and `sync_buffers` do nothing unless `install` ran.
"""

from __future__ import annotations

import torch
from torch import nn


class GradSync:
    """Averages the module's gradients over the ranks with one flat all-reduce (graph-capturable)."""

    def __init__(self, model: nn.Module, world: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world = world

    def __call__(self) -> None:
        import torch.distributed as dist

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(self.world)
        views = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
        torch._foreach_copy_(grads, views)


_sync: GradSync | None = None


def install(model: nn.Module, world: int) -> nn.Module:
    """The plain module, with rank 0's parameters and buffers, and the gradient average armed."""
    global _sync
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    _sync = GradSync(model, world)
    return model


def active() -> bool:
    return _sync is not None


def sync_grads() -> None:
    """After backward, before clipping and the optimizer: every rank then holds the average gradient."""
    if _sync is not None:
        _sync()


def sync_buffers(model: nn.Module) -> None:
    """Rank 0's buffers on every rank (validation then agrees with what DDP would evaluate)."""
    if _sync is None:
        return
    import torch.distributed as dist

    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point() or b.dtype in (torch.int64, torch.int32):
                dist.broadcast(b.data, src=0)


def reset() -> None:
    """Disarm (a rank's job is over; tests run several jobs in one process)."""
    global _sync
    _sync = None
