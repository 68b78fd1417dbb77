"""Batch-norm statistics of a channels_last tensor as one Triton reduction (opt-in: MPSRUN_FUSED_NORM=1).

Why: in the H100 profile of ResNet18 (bf16, channels_last, batch 256, docs/benchmarks.md) torch's
`batch_norm_collect_statistics_channels_last` took 2.31 ms of a 19.4 ms step, reading its inputs
at about 0.55 TB/s, where the other three batch-norm kernels (normalisation, the backward's
reduction and element-wise pass) run at 1.8-2.2 TB/s. Here a first kernel reduces blocks of rows
to (count, mean, M2) per channel, combined as they go (Chan et al.'s update: no catastrophic
cancellation from sums of squares), and a second combines the blocks; the rest is torch's own
ops, as SyncBatchNorm calls them (`batch_norm_gather_stats_with_counts` for the running
statistics, `batch_norm_elemt`, `batch_norm_backward_reduce`, `batch_norm_backward_elemt`).

Not exact: the mean and variance are summed in another order than torch's Welford kernel, so they
agree to fp32 rounding; `Norms` checks them against `torch.batch_norm_stats` at each new shape
before capture and raises `Mismatch` beyond 1e-4. Off by default: a faster one-GPU step changes the
data-parallel ratio, which is to be measured on two GPUs before this is the default.

Swapped into training-mode `nn.BatchNorm2d` modules only while GraphTrainer warms up and captures,
as fused_pool's max-pools; evaluation uses torch's modules. Triton is imported only here, only on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch
from torch import nn

from mpsrun.train.kernels import swap

ROWS_PER_TILE = 64  # rows a program loads at once
CHANNELS = 64  # channels a program reduces (128 bytes of bf16 a row)
PROGRAMS = 512  # the first kernel's programs to aim for: a few per SM of an H100
FINAL_CHANNELS = 32  # channels per program of the combining kernel
FINAL_ROWS = 64  # partial results it loads at once
TOLERANCE = 1e-4

_kernels: dict[str, Any] = {}


class Mismatch(RuntimeError):
    """The statistics disagreed with torch's on this GPU: the run uses torch's batch-norm (said in its notes)."""


def _build() -> dict[str, Any]:
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def norm_partial(x_ptr, cnt_ptr, mean_ptr, m2_ptr, M, C, rows, BM: tl.constexpr, BC: tl.constexpr):
        pm = tl.program_id(0)
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cc < C
        n_a = tl.zeros((BC,), dtype=tl.float32)
        mean_a = tl.zeros((BC,), dtype=tl.float32)
        m2_a = tl.zeros((BC,), dtype=tl.float32)
        first = pm * rows
        for r in range(0, rows, BM):
            rr = first + r + tl.arange(0, BM)
            rmask = rr < M
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rr[:, None] * C + cc[None, :], mask=m, other=0.0).to(tl.float32)
            n_b = tl.sum(m.to(tl.float32), axis=0)
            mean_b = tl.sum(x, axis=0) / tl.maximum(n_b, 1.0)
            d = tl.where(m, x - mean_b[None, :], 0.0)
            m2_b = tl.sum(d * d, axis=0)
            n = n_a + n_b
            frac = n_b / tl.maximum(n, 1.0)
            delta = mean_b - mean_a
            mean_a = mean_a + delta * frac
            m2_a = m2_a + m2_b + delta * delta * n_a * frac
            n_a = n
        out = pm * C + cc
        tl.store(cnt_ptr + out, n_a, mask=cmask)
        tl.store(mean_ptr + out, mean_a, mask=cmask)
        tl.store(m2_ptr + out, m2_a, mask=cmask)

    @triton.jit
    def norm_final(cnt_ptr, mean_ptr, m2_ptr, out_mean, out_invstd, G, C, eps, BG: tl.constexpr, BC: tl.constexpr):
        cc = tl.program_id(0) * BC + tl.arange(0, BC)
        cmask = cc < C
        total = tl.zeros((BC,), dtype=tl.float32)
        wsum = tl.zeros((BC,), dtype=tl.float32)
        for g0 in range(0, G, BG):
            gg = g0 + tl.arange(0, BG)
            m = (gg[:, None] < G) & cmask[None, :]
            n = tl.load(cnt_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            mu = tl.load(mean_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            total += tl.sum(n, axis=0)
            wsum += tl.sum(n * mu, axis=0)
        mean = wsum / tl.maximum(total, 1.0)
        m2 = tl.zeros((BC,), dtype=tl.float32)
        for g0 in range(0, G, BG):
            gg = g0 + tl.arange(0, BG)
            m = (gg[:, None] < G) & cmask[None, :]
            n = tl.load(cnt_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            mu = tl.load(mean_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            part = tl.load(m2_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            d = mu - mean[None, :]
            m2 += tl.sum(part + n * d * d, axis=0)
        var = m2 / tl.maximum(total, 1.0)
        tl.store(out_mean + cc, mean, mask=cmask)
        tl.store(out_invstd + cc, 1.0 / tl.sqrt(var + eps), mask=cmask)

    _kernels.update(partial=norm_partial, final=norm_final, cdiv=triton.cdiv)
    return _kernels


def fits(x: torch.Tensor) -> bool:
    """A 4-D channels_last CUDA tensor of a float dtype, small enough for 32-bit offsets."""
    return (x.dim() == 4 and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.is_contiguous(memory_format=torch.channels_last) and x.numel() < 2**31 and x.numel() > x.shape[1])


def stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and 1/sqrt(biased variance + eps) of a channels_last tensor, in fp32 (torch.batch_norm_stats')."""
    k = _build()
    c = x.shape[1]
    rows = x.numel() // c
    col_blocks = k["cdiv"](c, CHANNELS)
    per = max(ROWS_PER_TILE, k["cdiv"](k["cdiv"](rows * col_blocks, PROGRAMS), ROWS_PER_TILE) * ROWS_PER_TILE)
    groups = k["cdiv"](rows, per)
    cnt = torch.empty((groups, c), device=x.device, dtype=torch.float32)
    mean_p, m2_p = torch.empty_like(cnt), torch.empty_like(cnt)
    k["partial"][(groups, col_blocks)](x, cnt, mean_p, m2_p, rows, c, per, BM=ROWS_PER_TILE, BC=CHANNELS, num_warps=4)
    mean = torch.empty((c,), device=x.device, dtype=torch.float32)
    invstd = torch.empty_like(mean)
    k["final"][(k["cdiv"](c, FINAL_CHANNELS),)](cnt, mean_p, m2_p, mean, invstd, groups, c, eps, BG=FINAL_ROWS, BC=FINAL_CHANNELS, num_warps=4)
    return mean, invstd


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],  # type: ignore[override]
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: float, eps: float) -> torch.Tensor:
        mean, invstd = stats(x, eps)
        n = x.numel() // x.shape[1]
        if running_mean is not None:
            counts = torch.full((1,), n, dtype=mean.dtype, device=x.device)
            torch.batch_norm_gather_stats_with_counts(x, mean[None], invstd[None], running_mean, running_var, momentum, eps, counts)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.n = n
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:  # type: ignore[override]
        x, weight, mean, invstd = ctx.saved_tensors
        g = g.contiguous(memory_format=torch.channels_last)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        sum_dy, sum_dy_xmu, gw, gb = torch.batch_norm_backward_reduce(g, x, mean, invstd, weight, need_x, need_w and weight is not None, need_b and weight is not None)
        gx = None
        if need_x:
            w = weight.to(mean.dtype) if weight is not None and weight.dtype != mean.dtype else weight
            gx = torch.batch_norm_backward_elemt(g, x, mean, invstd, w, sum_dy, sum_dy_xmu, torch.full((1,), ctx.n, dtype=torch.int32, device=x.device))
        return gx, gw if need_w else None, gb if need_b else None, None, None, None, None


def candidates(model: nn.Module) -> list[nn.BatchNorm2d]:
    """Plain BatchNorm2d modules with a fixed momentum (a cumulative average reads a count on the host) and no hooks."""
    return [m for m in model.modules() if type(m) is nn.BatchNorm2d and m.momentum is not None and not swap.hooked(m)]


class Norms:
    """The model's batch-norms with these statistics, swapped in only while steps are warmed up and captured."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = candidates(model)
        self.checked: set[tuple] = set()

    def swapped(self) -> contextlib.AbstractContextManager:
        """Each batch-norm's forward is `_call` inside the block (torch's own in evaluation mode)."""
        return swap.swapped([(m, functools.partial(self._call, m=m)) for m in self.modules])

    def _call(self, x: torch.Tensor, m: nn.BatchNorm2d) -> torch.Tensor:
        if not (m.training and fits(x)):
            return type(m).forward(m, x)
        key = (tuple(x.shape), x.dtype)
        if key not in self.checked and not torch.cuda.is_current_stream_capturing():
            check(tuple(x.shape), x.dtype, x.device, m.eps)
            self.checked.add(key)
        if m.track_running_stats and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
        rm, rv = (m.running_mean, m.running_var) if m.track_running_stats else (None, None)
        return _BatchNorm.apply(x, m.weight, m.bias, rm, rv, float(m.momentum), m.eps)


def check(shape: tuple, dtype: torch.dtype, device: torch.device, eps: float, reference: Any = None) -> None:
    """These statistics against torch's (`torch.batch_norm_stats`, or `reference`) on an input with a large common
    offset (where sums of squares lose everything); raises Mismatch beyond TOLERANCE of the spread."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(shape, device=device, generator=gen) * 3 + 50).to(dtype).contiguous(memory_format=torch.channels_last)
    mean, invstd = stats(x, eps)
    ref_mean, ref_invstd = (reference or torch.batch_norm_stats)(x, eps)
    spread = 1.0 / ref_invstd
    err_mean = ((mean - ref_mean).abs() / spread).max().item()
    err_inv = ((invstd - ref_invstd).abs() / ref_invstd).max().item()
    if not (err_mean <= TOLERANCE and err_inv <= TOLERANCE):
        raise Mismatch(f"batch-norm statistics {tuple(shape)} {dtype}: mean off by {err_mean:.1e} of the spread, invstd by {err_inv:.1e}")


def plan(model: nn.Module) -> Optional[Norms]:
    norms = Norms(model)
    return norms if norms.modules else None
