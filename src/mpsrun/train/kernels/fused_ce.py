"""Cross-entropy as one kernel forward and one backward, with the epoch's loss sum folded in.

Why: on a small model inside a CUDA graph the step's time is its kernel count, not its
arithmetic. torch's cross-entropy is log_softmax + nll_loss forward and three kernels
backward, and the step adds the loss to the epoch's sum with one more; here the forward
kernel computes the mean loss, adds `mean * batch` to the sum (what the eager step adds)
and writes the logits' gradient, (softmax - onehot) / n, while the rows are in registers;
backward only scales it by the incoming gradient.

One program walks the whole batch in row blocks, in a fixed order: the sum is the same
bits on every replay and every rank (no atomics). So it is for batches whose logits are
small (batch x classes up to LIMIT elements); larger ones, soft labels, class weights,
label smoothing or another reduction stay with torch, and the run's notes say why.
Triton is imported only here, only on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

LIMIT = 1 << 18  # batch x padded classes handled by one program; beyond it torch's kernels win
MAX_CLASSES = 4096


def why_not(inner: Any, device: torch.device) -> str | None:
    """None when the fused kernels compute exactly what `inner` would; else the reason, for the notes."""
    if device.type != "cuda":
        return "not a CUDA device"
    if not isinstance(inner, nn.CrossEntropyLoss):
        return "the loss is not torch's CrossEntropyLoss"
    if inner.weight is not None or inner.label_smoothing != 0.0 or inner.reduction != "mean":
        return "class weights, label smoothing or a reduction other than mean"
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - CUDA torch ships triton
        return f"triton is not importable ({type(e).__name__})"
    return None


def fits(logits: torch.Tensor, y: torch.Tensor) -> bool:
    """Shapes the one-program kernel takes: (N, C) logits, (N,) integer class labels."""
    if logits.dim() != 2 or y.dim() != 1 or y.dtype not in (torch.int64, torch.int32) or not logits.is_cuda:
        return False
    n, c = logits.shape
    return 0 < c <= MAX_CLASSES and n * _pow2(c) <= LIMIT


def too_large(batch_size: int, num_classes: int) -> str | None:
    """Why batches of this size take torch's kernels (None: they fit the one-program kernel)."""
    if num_classes > MAX_CLASSES or batch_size * _pow2(max(1, num_classes)) > LIMIT:
        return f"batch {batch_size} x {num_classes} classes is above the one-program kernel's {LIMIT:,} logits"
    return None


def _pow2(c: int) -> int:
    return 1 << max(0, (c - 1).bit_length())


_kernels: dict[str, Any] = {}


def _forward_kernel() -> Any:
    if "fwd" in _kernels:
        return _kernels["fwd"]
    import triton
    import triton.language as tl

    @triton.jit
    def ce_forward(x_ptr, y_ptr, g_ptr, loss_ptr, sum_ptr, n_rows, n_cols, stride, ignore, alpha,
                   WRITE_GRAD: tl.constexpr, ADD_SUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        cols = tl.arange(0, BLOCK_C)
        cmask = cols < n_cols
        total = tl.zeros((BLOCK_R,), dtype=tl.float32)
        count = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for start in range(0, n_rows, BLOCK_R):  # pass 1: per-row loss, summed in a fixed order
            rows = start + tl.arange(0, BLOCK_R)
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            y = tl.load(y_ptr + rows, mask=rmask, other=ignore)
            valid = rmask & (y != ignore)
            m = tl.max(x, axis=1)
            m = tl.where(rmask, m, 0.0)
            e = tl.where(mask, tl.exp(x - m[:, None]), 0.0)
            s = tl.sum(e, axis=1)
            s = tl.where(rmask, s, 1.0)
            xy = tl.sum(tl.where((cols[None, :] == y[:, None]) & mask, x, 0.0), axis=1)
            total += tl.where(valid, m + tl.log(s) - xy, 0.0)
            count += tl.where(valid, 1.0, 0.0)
        n = tl.sum(count, axis=0)
        mean = tl.sum(total, axis=0) / n
        tl.store(loss_ptr, mean)
        if ADD_SUM:
            tl.store(sum_ptr, tl.load(sum_ptr) + mean * alpha)
        if WRITE_GRAD:
            for start in range(0, n_rows, BLOCK_R):  # pass 2: (softmax - onehot) / n, zero for ignored rows
                rows = start + tl.arange(0, BLOCK_R)
                rmask = rows < n_rows
                mask = rmask[:, None] & cmask[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
                y = tl.load(y_ptr + rows, mask=rmask, other=ignore)
                valid = rmask & (y != ignore)
                m = tl.max(x, axis=1)
                m = tl.where(rmask, m, 0.0)
                e = tl.where(mask, tl.exp(x - m[:, None]), 0.0)
                s = tl.sum(e, axis=1)
                s = tl.where(rmask, s, 1.0)
                g = e / s[:, None] - tl.where(cols[None, :] == y[:, None], 1.0, 0.0)
                g = tl.where(valid[:, None], g / n, 0.0)
                tl.store(g_ptr + rows[:, None] * n_cols + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)

    _kernels["fwd"] = ce_forward
    return ce_forward


def _launch(logits: torch.Tensor, y: torch.Tensor, ignore: int, loss_sum: torch.Tensor | None, alpha: float, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, c = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    loss = torch.empty((), device=logits.device, dtype=torch.float32)
    g = torch.empty((n, c), device=logits.device, dtype=logits.dtype) if grad else None
    block_c = max(16, _pow2(c))
    block_r = max(1, min(64, 8192 // block_c))
    add = loss_sum is not None
    _forward_kernel()[(1,)](
        logits, y, g if g is not None else loss, loss, loss_sum if add else loss, n, c, logits.stride(0), ignore, float(alpha),
        WRITE_GRAD=grad, ADD_SUM=add, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )
    return loss, g


class _FusedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, y: torch.Tensor, ignore: int, loss_sum: torch.Tensor | None, alpha: float) -> torch.Tensor:  # type: ignore[override]
        loss, g = _launch(logits, y, ignore, loss_sum, alpha, grad=ctx.needs_input_grad[0])
        ctx.save_for_backward(g if g is not None else loss)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:  # type: ignore[override]
        (g,) = ctx.saved_tensors
        return g * grad_out.to(g.dtype), None, None, None, None


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, loss_sum: torch.Tensor | None = None, alpha: float | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of (N, C) logits; adds `mean * alpha` (default N) to `loss_sum` in the same kernel."""
    return _FusedCE.apply(logits, y, ignore_index, loss_sum, float(len(y) if alpha is None else alpha))
