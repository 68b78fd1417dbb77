"""Data parallel inside a CUDA graph: each rank's gradients averaged by one NCCL all-reduce in the step.

Why not DDP here: DDP's reducer launches its bucketed all-reduces from autograd hooks
and keeps Python-side state between steps, which a replayed graph does not re-run; a
graph captured around it needs DDP built on a side stream, eleven eager warm-up steps
and its static-graph mode, and still replays DDP's many buckets. A launch-bound step
(batch 64 per GPU) is what DDP handles worst and graphs handle best, so under NCCL with
graphs on, each rank keeps its plain module and averages its gradients with a few
all-reduces over flat copies (DDP-sized buckets, issued on a side stream as backward
fills them, so they overlap the rest of backward), captured with the rest of the step
(NCCL collectives are capturable once the communicator exists; the eager warm-up steps
create it). A small model is one bucket: one collective after backward. The average is DDP's (sum over
ranks / world size), so the trajectory is the single process's, as with DDP.

What DDP did besides, done here too: rank 0's parameters are broadcast once at the start
(identical anyway: every rank seeds the same), and buffers (BatchNorm's running
statistics) are broadcast from rank 0 before each validation, which is what DDP's
broadcast at each forward leaves the evaluation with.

A no-op everywhere else: `sync_grads` and `sync_buffers` do nothing unless `install` ran.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
BUCKET_ENV = "MPSRUN_DDP_BUCKET_MB"  # another size; 0: one all-reduce after backward (no overlap), for measuring
TAIL_BYTES = 2**20  # the first layers' gradients, the last backward yields, in a bucket of their own at most this size
TAIL_ENV = "MPSRUN_DDP_TAIL_MB"  # another size; 0: no tail bucket (the first layers share the last size-filled bucket), for measuring
AVG_ENV = "MPSRUN_DDP_AVG"  # 0: NCCL sums and the bucket is divided after (as before), for measuring
WIRE_ENV = "MPSRUN_DDP_WIRE"  # bf16: gradients all-reduced in bf16 (half the bytes, rounded), for measuring the link only
EARLY_COPY_ENV = "MPSRUN_DDP_EARLY_COPY"  # 0: every bucket copied back after backward (as before), for measuring
VIEWS_ENV = "MPSRUN_DDP_GRAD_VIEWS"  # 0: each bucket's average copied back into the gradients rather than the gradients made views of it


class GradSync:
    """Averages the module's gradients over the ranks, bucket by bucket as backward produces them.

    Buckets hold parameters in reverse order (backward yields the last layers' gradients
    first, as DDP orders them), filled to `bucket_bytes`, except the model's first
    parameters up to `tail_bytes`, which get the last bucket alone: that bucket's
    all-reduce can only start when backward has ended, so it is the one collective every
    step waits for whole; small, it is a latency, and the size-filled bucket before it
    goes out while the first layers' backward still runs (ResNet18: 15 MB after backward
    without the tail, 0.9 MB with it). When a bucket's last gradient is accumulated (a
    post-accumulate-grad hook, run during the eager warm-up and during capture alike),
    its all-reduce is issued on a side stream that waits for the gradients so far, so
    the collective overlaps the rest of backward, inside the graph too; the bucket's
    gradients (they are final) then become views of its average (`views`), or the average
    is copied back into them on that stream, so after backward only the last bucket's
    collective is left to wait for.
    `__call__` (after backward) issues any bucket whose hooks did not all fire (unused
    parameters) and waits for the side stream: every rank issues the same buckets in the
    same order, since every rank runs the same backward.
    """

    def __init__(self, model: nn.Module, world: int, bucket_bytes: int = BUCKET_BYTES, avg: bool = False, early_copy: bool = True,
                 wire_dtype: torch.dtype | None = None, tail_bytes: int = TAIL_BYTES, views: bool = False) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world = world
        self.buckets = buckets(self.params, bucket_bytes, tail_bytes)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.left = [len(b) for b in self.buckets]
        self.issued: list[tuple[torch.Tensor, list[torch.Tensor]] | None] = [None] * len(self.buckets)
        self.stream: torch.cuda.Stream | None = None
        self.armed = False
        self.avg = avg
        self.early_copy = early_copy
        self.wire_dtype = wire_dtype
        self.views = views and wire_dtype is None
        self.kept: list[torch.Tensor] = []  # gradients a side-stream copy still reads, alive until the streams meet
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def arm(self) -> None:
        """Before a backward whose gradients are to be averaged: buckets then go out as they fill."""
        self.left = [len(b) for b in self.buckets]
        self.issued = [None] * len(self.buckets)
        self.armed = True

    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(p)]
        self.left[i] -= 1
        if self.left[i] == 0:
            self._issue(i)

    def _issue(self, i: int) -> None:
        import torch.distributed as dist

        params = [p for p in self.buckets[i] if p.grad is not None]
        grads = [p.grad for p in params]
        if not grads:
            self.issued[i] = (torch.empty(0), [])
            return
        if grads[0].is_cuda:
            cur = torch.cuda.current_stream(grads[0].device)
            if self.stream is None:
                self.stream = torch.cuda.Stream(grads[0].device)
            self.stream.wait_stream(cur)  # the gradients so far are written
            with torch.cuda.stream(self.stream):
                flat = self._average(grads, dist)
                if self.early_copy:  # this bucket's gradients are final: views of it, or back in place while backward goes on
                    if not (self.views and self._adopt(flat, params, grads)):
                        self._copy_back(flat, grads)
                    grads = []
        else:
            flat = self._average(grads, dist)
            if self.views and self._adopt(flat, params, grads):
                grads = []
        self.issued[i] = (flat, grads)

    def _average(self, grads: list[torch.Tensor], dist: Any) -> torch.Tensor:
        """The ranks' mean of these gradients, as one flat tensor (DDP's: the sum over ranks / world size).

        NCCL averages inside the collective (`ReduceOp.AVG`: one pass over the bucket fewer
        than a sum and a division); gloo has no AVG, so there the sum is divided.
        """
        flat = torch.cat([in_memory_order(g) for g in grads])
        if self.wire_dtype is not None:  # measuring only: fewer bytes on the link, rounded gradients
            flat = flat.to(self.wire_dtype)
        if self.avg:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(self.world)
        return flat

    def _adopt(self, flat: torch.Tensor, params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        """Each parameter's gradient made a view of its place in the averaged bucket, in the gradient's own layout.

        Why: the copy back is a read and a write of every gradient each step, on the HBM that backward
        is using (ResNet18: 47 MB each way). The optimizer (captured too) reads the views; the flat
        bucket lives as long as they do, and the next step's `zero_grad(set_to_none=True)` lets it go.
        The replaced gradients are still being read by the side stream's `cat`: kept until the streams
        meet in `__call__`, so their memory is not handed to later kernels of the main stream first.
        Only where every gradient is dense in memory order (else False: copied back as before).
        """
        if any(g.dtype != flat.dtype for g in grads) or not all(in_memory_order(g).data_ptr() == g.data_ptr() for g in grads):
            return False
        off = 0
        for p, g in zip(params, grads):
            p.grad = flat.as_strided(g.size(), g.stride(), flat.storage_offset() + off)
            off += g.numel()
        self.kept.extend(grads)
        return True

    @staticmethod
    def _copy_back(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        dense = [in_memory_order(g) for g in grads]
        if all(d.data_ptr() == g.data_ptr() for d, g in zip(dense, grads)):  # views of the gradients: 1-D copies
            torch._foreach_copy_(dense, list(flat.split([g.numel() for g in grads])))
        else:
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])

    def __call__(self) -> None:
        if not self.armed:  # called without arm (a caller that does not know about buckets): all at once
            self.arm()
        self.armed = False
        for i, done in enumerate(self.issued):
            if done is None:
                self._issue(i)
        if self.stream is not None:
            # The averages were made (and, with early_copy, adopted or copied back) on the side
            # stream; the optimizer reads them on this one. Their memory is only reused by the side stream,
            # whose next work waits for this stream (`_issue`), so no record_stream is needed
            # (and none is issued during a capture).
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.kept.clear()  # freed after the wait: the main stream reuses their memory only after the side stream's reads
        pairs = [x for x in self.issued if x is not None and x[1]]
        for flat, gs in pairs:
            self._copy_back(flat, gs)
        self.issued = [None] * len(self.buckets)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def buckets(params: list[nn.Parameter], bucket_bytes: int, tail_bytes: int) -> list[list[nn.Parameter]]:
    """Parameters in the order their buckets go out: reversed, filled to `bucket_bytes`; the leading ones up to `tail_bytes` last, alone.

    No tail where it would not be smaller than a bucket, or would be the whole model (one bucket, as before).
    """
    def nbytes(p: nn.Parameter) -> int:
        return p.numel() * p.element_size()

    tail: list[nn.Parameter] = []
    if 0 < tail_bytes < bucket_bytes:
        size = 0
        for p in params:
            if size + nbytes(p) > tail_bytes:
                break
            tail.append(p)
            size += nbytes(p)
        if len(tail) == len(params):
            tail = []
    out: list[list[nn.Parameter]] = []
    cur: list[nn.Parameter] = []
    size = 0
    for p in reversed(params[len(tail):]):
        cur.append(p)
        size += nbytes(p)
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    if tail:
        out.append(list(reversed(tail)))
    return out


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as a 1-D view in the order they sit in memory (a copy only for a tensor with gaps).

    Why: a channels_last model's convolution weights (and so their gradients) are not
    contiguous, and `reshape(-1)` of one is a strided copy; the flat bucket and the copy
    back then cost two strided passes over those gradients in every step (about 0.3 ms a
    step of ResNet18's 22 ms on an H100). Read in memory order, both are plain dense copies;
    every rank lays its gradients out alike, so the element-wise average is unchanged.
    """
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)), reverse=True)
    p = t.permute(order)
    return p.view(-1) if p.is_contiguous() else t.reshape(-1)


_sync: GradSync | None = None


def install(model: nn.Module, world: int, bucket_bytes: int = BUCKET_BYTES, tail_bytes: int | None = None) -> nn.Module:
    """The plain module, with rank 0's parameters and buffers, and the gradient average armed.

    `tail_bytes` None: TAIL_BYTES, or MPSRUN_DDP_TAIL_MB where set."""
    global _sync
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    if tail_bytes is None:
        tail_bytes = int(float(os.environ.get(TAIL_ENV, TAIL_BYTES / 2**20)) * 2**20)
    env = os.environ.get(BUCKET_ENV)
    if env is not None:
        mb = float(env)
        bucket_bytes = int(mb * 2**20) if mb > 0 else 2**62
        tail_bytes = tail_bytes if mb > 0 else 0  # one all-reduce after backward means one
    nccl = dist.get_backend() == "nccl"
    avg = nccl and os.environ.get(AVG_ENV, "1") != "0"
    early = os.environ.get(EARLY_COPY_ENV, "1") != "0"
    wire = {"bf16": torch.bfloat16}.get(os.environ.get(WIRE_ENV, ""))
    views = os.environ.get(VIEWS_ENV, "1") != "0"
    _sync = GradSync(model, world, bucket_bytes, avg=avg, early_copy=early, wire_dtype=wire, tail_bytes=tail_bytes, views=views)
    return model


def active() -> bool:
    return _sync is not None


def arm() -> None:
    """Before backward: each bucket's all-reduce then starts as soon as its gradients exist."""
    if _sync is not None:
        _sync.arm()


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
    if _sync is not None:
        _sync.remove()
    _sync = None
