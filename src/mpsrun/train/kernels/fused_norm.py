"""Training-mode batch-norm of a channels_last tensor as Triton kernels, with the activation (and the residual add) after it folded in.

Why: in the H100 profile of ResNet18 (bf16, channels_last, batch 256, docs/benchmarks.md) batch-norm
took 6.8 ms of a 19.4 ms step in four torch kernels (statistics at about 0.55 TB/s; normalisation,
the backward's reduction and its element-wise pass at 1.8-2.2 TB/s), and the ReLUs, their
backward and the residual additions around it about 3 ms more: each a pass over tensors that
batch-norm had just read or written. Here a layer is three kernels each way, each tensor read
once per pass:

- forward: statistics (blocks of rows summed around a shift, the block's first row, then combined
  with Chan's update: no catastrophic cancellation from sums of squares), whose combining kernel
  also moves the running statistics; then `act(norm(x) + residual)` in one pass (ReLU, ReLU6 or SiLU);
- backward: per-channel sums of the gradient (through the activation: ReLU and ReLU6 from their
  output, SiLU from its input computed again from x) and of its product
  with `x - mean`, combined with the weight and bias gradients in a small kernel; then the input's
  gradient, and the residual's, in one pass.

Not exact: sums run in another order than torch's, and `norm(x) + residual` is rounded once where
torch rounds twice; so results agree to the dtype's rounding. `check` compares forward and backward
against torch's ops at each new shape before capture and raises `Mismatch` beyond TOLERANCE (the
run then uses torch's batch-norm and says so). Where the model traces with torch.fx
(norm_graph.py), batch-norm -> ReLU/ReLU6/SiLU and batch-norm -> add -> ReLU become one layer; elsewhere each
`nn.BatchNorm2d` alone. Swapped in only while GraphTrainer warms up and captures: evaluation,
export and checkpoints see the user's modules. Triton is imported only here, only on CUDA.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch
from torch import nn

from mpsrun.train.kernels import swap, vjp
from mpsrun.train.kernels.norm_graph import NONE, RELU, RELU6, SILU

# Tiles, from benchmarks/norm_kernels_gpu.py on an H100 (ResNet18's shapes at batch 256, bf16)
REDUCE_ROWS = 64  # rows a reducing program loads at once
REDUCE_CHANNELS = 64  # channels a reducing program covers (128 bytes of bf16 a row)
REDUCE_WARPS = 4
PROGRAMS = 512  # reducing programs to aim for: several per SM
POINT_ELEMENTS = 4096  # elements an element-wise program covers
POINT_CHANNELS = 64  # at most this many channels a program
POINT_WARPS = 4
FINAL_CHANNELS = 32  # channels per program of the combining kernels
FINAL_ROWS = 64  # partial results they load at once
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}  # of the largest magnitude compared

# NONE, RELU, RELU6, SILU (norm_graph's codes): the activation after a batch-norm (and its residual add), folded into the kernels
ACTS = {NONE: "none", RELU: "ReLU", RELU6: "ReLU6", SILU: "SiLU"}

_kernels: dict[str, Any] = {}


class Mismatch(RuntimeError):
    """The kernels disagreed with torch's batch-norm on this GPU: the run uses torch's (said in its notes)."""


def _tunables() -> None:
    """MPSRUN_NORM_TILES=REDUCE_ROWS,REDUCE_CHANNELS,REDUCE_WARPS,PROGRAMS,POINT_ELEMENTS,POINT_CHANNELS,POINT_WARPS: for the tile benchmark."""
    raw = os.environ.get("MPSRUN_NORM_TILES", "").strip()
    if raw:
        g = globals()
        for name, value in zip(("REDUCE_ROWS", "REDUCE_CHANNELS", "REDUCE_WARPS", "PROGRAMS", "POINT_ELEMENTS", "POINT_CHANNELS", "POINT_WARPS"), raw.split(",")):
            g[name] = int(value)


def _build() -> dict[str, Any]:
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    _tunables()

    @triton.jit
    def _act_grad(g, y_ptr, offs, m, x, mean, scale, shift, ACT: tl.constexpr):
        """The gradient through the activation: ReLU and ReLU6 from the output, as torch's backward reads it; SiLU from
        its input, computed again from x (the output does not give it back)."""
        if ACT == 1:
            y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
            g = tl.where(y <= 0.0, 0.0, g)  # torch's threshold_backward
        if ACT == 2:
            y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
            g = tl.where((y <= 0.0) | (y >= 6.0), 0.0, g)  # torch's hardtanh_backward
        if ACT == 3:
            z = (x - mean[None, :]) * scale[None, :] + shift[None, :]
            sig = tl.sigmoid(z)
            g = g * sig * (1.0 + z * (1.0 - sig))
        return g

    globals()["_act_grad"] = _act_grad  # Triton finds a jit function a kernel calls among the module's globals, not in a closure

    @triton.jit(do_not_specialize=["M", "rows"])  # one compile for every batch and image size
    def stats_partial(x_ptr, mean_ptr, m2_ptr, M, C, rows, BM: tl.constexpr, BC: tl.constexpr):
        pm = tl.program_id(0)
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cc < C
        first = pm * rows
        k = tl.load(x_ptr + first * C + cc, mask=cmask, other=0.0).to(tl.float32)  # the shift: this block's first row
        s1 = tl.zeros((BM, BC), dtype=tl.float32)
        s2 = tl.zeros((BM, BC), dtype=tl.float32)
        for r in range(0, rows, BM):
            rr = first + r + tl.arange(0, BM)
            m = (rr < M)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rr[:, None] * C + cc[None, :], mask=m, other=0.0).to(tl.float32)
            d = tl.where(m, x - k[None, :], 0.0)
            s1 += d
            s2 += d * d
        n = tl.minimum(rows, M - first).to(tl.float32)
        t1 = tl.sum(s1, axis=0)
        t2 = tl.sum(s2, axis=0)
        tl.store(mean_ptr + pm * C + cc, k + t1 / n, mask=cmask)
        tl.store(m2_ptr + pm * C + cc, tl.maximum(t2 - t1 * t1 / n, 0.0), mask=cmask)

    @triton.jit(do_not_specialize=["G", "M", "rows"])
    def stats_final(mean_ptr, m2_ptr, out_mean, out_invstd, run_mean, run_var, G, M, C, rows, eps, momentum,
                    RUNNING: tl.constexpr, BG: tl.constexpr, BC: tl.constexpr):
        cc = tl.program_id(0) * BC + tl.arange(0, BC)
        cmask = cc < C
        wsum = tl.zeros((BC,), dtype=tl.float32)
        for g0 in range(0, G, BG):
            gg = g0 + tl.arange(0, BG)
            m = (gg[:, None] < G) & cmask[None, :]
            n = tl.minimum(rows, M - gg * rows).to(tl.float32)
            mu = tl.load(mean_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            wsum += tl.sum(tl.where(m, n[:, None] * mu, 0.0), axis=0)
        total = M.to(tl.float32)
        mean = wsum / total
        m2 = tl.zeros((BC,), dtype=tl.float32)
        for g0 in range(0, G, BG):
            gg = g0 + tl.arange(0, BG)
            m = (gg[:, None] < G) & cmask[None, :]
            n = tl.minimum(rows, M - gg * rows).to(tl.float32)
            mu = tl.load(mean_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            part = tl.load(m2_ptr + gg[:, None] * C + cc[None, :], mask=m, other=0.0)
            d = mu - mean[None, :]
            m2 += tl.sum(tl.where(m, part + n[:, None] * d * d, 0.0), axis=0)
        var = m2 / total
        tl.store(out_mean + cc, mean, mask=cmask)
        tl.store(out_invstd + cc, 1.0 / tl.sqrt(var + eps), mask=cmask)
        if RUNNING:  # as torch: the unbiased variance into the running one
            rm = tl.load(run_mean + cc, mask=cmask, other=0.0).to(tl.float32)
            rv = tl.load(run_var + cc, mask=cmask, other=0.0).to(tl.float32)
            unbiased = var * total / tl.maximum(total - 1.0, 1.0)
            tl.store(run_mean + cc, (rm * (1.0 - momentum) + mean * momentum).to(run_mean.dtype.element_ty), mask=cmask)
            tl.store(run_var + cc, (rv * (1.0 - momentum) + unbiased * momentum).to(run_var.dtype.element_ty), mask=cmask)

    @triton.jit(do_not_specialize=["M"])
    def norm_fwd(x_ptr, res_ptr, y_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, M, C,
                 RES: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
        rr = tl.program_id(0) * BM + tl.arange(0, BM)
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cc < C
        m = (rr < M)[:, None] & cmask[None, :]
        offs = rr[:, None] * C + cc[None, :]
        mean = tl.load(mean_ptr + cc, mask=cmask, other=0.0)
        invstd = tl.load(invstd_ptr + cc, mask=cmask, other=0.0)
        w = tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = (x - mean[None, :]) * invstd[None, :] * w[None, :] + b[None, :]
        if RES:
            y += tl.load(res_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if ACT == 1:  # ReLU; a NaN stays NaN, as torch's
            y = tl.where(y < 0.0, 0.0, y)
        if ACT == 2:  # ReLU6
            y = tl.where(y < 0.0, 0.0, tl.where(y > 6.0, 6.0, y))
        if ACT == 3:  # SiLU
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["M", "rows"])
    def grad_partial(gy_ptr, y_ptr, x_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, part_ptr, M, C, rows,
                     ACT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
        pm = tl.program_id(0)
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cc < C
        mean = tl.load(mean_ptr + cc, mask=cmask, other=0.0)
        scale = tl.load(invstd_ptr + cc, mask=cmask, other=0.0) * tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
        shift = tl.load(b_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
        first = pm * rows
        a_g = tl.zeros((BM, BC), dtype=tl.float32)
        a_gx = tl.zeros((BM, BC), dtype=tl.float32)
        for r in range(0, rows, BM):
            rr = first + r + tl.arange(0, BM)
            m = (rr < M)[:, None] & cmask[None, :]
            offs = rr[:, None] * C + cc[None, :]
            g = tl.load(gy_ptr + offs, mask=m, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            g = _act_grad(g, y_ptr, offs, m, x, mean, scale, shift, ACT)
            a_g += g
            a_gx += g * (x - mean[None, :])
        tl.store(part_ptr + pm * 2 * C + cc, tl.sum(a_g, axis=0), mask=cmask)
        tl.store(part_ptr + pm * 2 * C + C + cc, tl.sum(a_gx, axis=0), mask=cmask)

    @triton.jit(do_not_specialize=["G"])
    def grad_final(part_ptr, invstd_ptr, sums_ptr, gw_ptr, gb_ptr, G, C, BG: tl.constexpr, BC: tl.constexpr):
        cc = tl.program_id(0) * BC + tl.arange(0, BC)
        cmask = cc < C
        s_g = tl.zeros((BC,), dtype=tl.float32)
        s_gx = tl.zeros((BC,), dtype=tl.float32)
        for g0 in range(0, G, BG):
            gg = g0 + tl.arange(0, BG)
            m = (gg[:, None] < G) & cmask[None, :]
            s_g += tl.sum(tl.load(part_ptr + gg[:, None] * 2 * C + cc[None, :], mask=m, other=0.0), axis=0)
            s_gx += tl.sum(tl.load(part_ptr + gg[:, None] * 2 * C + C + cc[None, :], mask=m, other=0.0), axis=0)
        invstd = tl.load(invstd_ptr + cc, mask=cmask, other=0.0)
        tl.store(sums_ptr + cc, s_g, mask=cmask)
        tl.store(sums_ptr + C + cc, s_gx, mask=cmask)
        tl.store(gw_ptr + cc, (s_gx * invstd).to(gw_ptr.dtype.element_ty), mask=cmask)
        tl.store(gb_ptr + cc, s_g.to(gb_ptr.dtype.element_ty), mask=cmask)

    @triton.jit(do_not_specialize=["M"])
    def grad_input(gy_ptr, y_ptr, x_ptr, dx_ptr, dres_ptr, mean_ptr, invstd_ptr, w_ptr, b_ptr, sums_ptr, M, C,
                   RES: tl.constexpr, ACT: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr):
        rr = tl.program_id(0) * BM + tl.arange(0, BM)
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cc < C
        m = (rr < M)[:, None] & cmask[None, :]
        offs = rr[:, None] * C + cc[None, :]
        mean = tl.load(mean_ptr + cc, mask=cmask, other=0.0)
        invstd = tl.load(invstd_ptr + cc, mask=cmask, other=0.0)
        w = tl.load(w_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
        total = M.to(tl.float32)
        mean_g = tl.load(sums_ptr + cc, mask=cmask, other=0.0) / total
        mean_gx = tl.load(sums_ptr + C + cc, mask=cmask, other=0.0) / total
        g = tl.load(gy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = _act_grad(g, y_ptr, offs, m, x, mean, invstd * w, tl.load(b_ptr + cc, mask=cmask, other=0.0).to(tl.float32), ACT)
        if RES:
            tl.store(dres_ptr + offs, g.to(dres_ptr.dtype.element_ty), mask=m)
        k = invstd * invstd * mean_gx
        dx = (g - mean_g[None, :] - (x - mean[None, :]) * k[None, :]) * (invstd * w)[None, :]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)

    _kernels.update(stats_partial=stats_partial, stats_final=stats_final, norm_fwd=norm_fwd, grad_partial=grad_partial,
                    grad_final=grad_final, grad_input=grad_input, cdiv=triton.cdiv, next_pow2=triton.next_power_of_2)
    return _kernels


def fits(x: torch.Tensor) -> bool:
    """A 4-D channels_last CUDA tensor of a float dtype, small enough for 32-bit offsets."""
    return (x.dim() == 4 and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.is_contiguous(memory_format=torch.channels_last) and x.numel() < 2**31 and x.numel() > x.shape[1])


def _reduce_grid(k: dict[str, Any], rows: int, c: int) -> tuple[int, int, int, int]:
    """(groups, channel blocks, rows per group, channel tile) for the reducing kernels."""
    bc = min(REDUCE_CHANNELS, max(16, k["next_pow2"](c)))  # at least 16 lanes: a layer of 1 or 2 channels is masked, not a tile of its own
    col_blocks = k["cdiv"](c, bc)
    per = max(REDUCE_ROWS, k["cdiv"](k["cdiv"](rows * col_blocks, PROGRAMS), REDUCE_ROWS) * REDUCE_ROWS)
    return k["cdiv"](rows, per), col_blocks, per, bc


def _point_grid(k: dict[str, Any], rows: int, c: int) -> tuple[tuple[int, int], int, int]:
    bc = min(POINT_CHANNELS, max(16, k["next_pow2"](c)))
    bm = max(1, POINT_ELEMENTS // bc)
    return (k["cdiv"](rows, bm), k["cdiv"](c, bc)), bm, bc


def stats(x: torch.Tensor, eps: float, running_mean: Optional[torch.Tensor] = None, running_var: Optional[torch.Tensor] = None,
          momentum: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and 1/sqrt(biased variance + eps) of a channels_last tensor, in fp32 (torch.batch_norm_stats');
    the running statistics moved as torch's batch-norm moves them, when given."""
    k = _build()
    c = x.shape[1]
    rows = x.numel() // c
    groups, col_blocks, per, bc = _reduce_grid(k, rows, c)
    mean_p = torch.empty((groups, c), device=x.device, dtype=torch.float32)
    m2_p = torch.empty_like(mean_p)
    k["stats_partial"][(groups, col_blocks)](x, mean_p, m2_p, rows, c, per, BM=REDUCE_ROWS, BC=bc, num_warps=REDUCE_WARPS)
    mean = torch.empty((c,), device=x.device, dtype=torch.float32)
    invstd = torch.empty_like(mean)
    running = running_mean is not None and running_var is not None
    k["stats_final"][(k["cdiv"](c, FINAL_CHANNELS),)](mean_p, m2_p, mean, invstd, running_mean if running else mean,
                                                       running_var if running else invstd, groups, rows, c, per, eps, momentum,
                                                       RUNNING=running, BG=FINAL_ROWS, BC=FINAL_CHANNELS, num_warps=4)
    return mean, invstd


class _NormAct(torch.autograd.Function):
    """act(batch_norm(x) + residual?) in training mode; `res` None for no residual; `act` one of ACTS' keys."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, res: Optional[torch.Tensor],  # type: ignore[override]
                running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], momentum: float, eps: float, act: int) -> torch.Tensor:
        k = _build()
        c = x.shape[1]
        rows = x.numel() // c
        mean, invstd = stats(x, eps, running_mean, running_var, momentum)
        y = torch.empty_like(x, memory_format=torch.channels_last)
        grid, bm, bc = _point_grid(k, rows, c)
        k["norm_fwd"][grid](x, res if res is not None else x, y, mean, invstd, weight, bias, rows, c,
                            RES=res is not None, ACT=int(act), BM=bm, BC=bc, num_warps=POINT_WARPS)
        ctx.save_for_backward(x, y if act in (RELU, RELU6) else None, weight, bias, mean, invstd)
        ctx.act = int(act)
        ctx.res_dtype = res.dtype if res is not None else None
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:  # type: ignore[override]
        x, y, weight, bias, mean, invstd = ctx.saved_tensors
        k = _build()
        gy = gy.contiguous(memory_format=torch.channels_last)
        c = x.shape[1]
        rows = x.numel() // c
        groups, col_blocks, per, bc = _reduce_grid(k, rows, c)
        part = torch.empty((groups, 2, c), device=x.device, dtype=torch.float32)
        k["grad_partial"][(groups, col_blocks)](gy, y if y is not None else gy, x, mean, invstd, weight, bias, part, rows, c, per,
                                                 ACT=ctx.act, BM=REDUCE_ROWS, BC=bc, num_warps=REDUCE_WARPS)
        sums = torch.empty((2, c), device=x.device, dtype=torch.float32)
        gw = torch.empty_like(weight)
        gb = torch.empty_like(weight)
        k["grad_final"][(k["cdiv"](c, FINAL_CHANNELS),)](part, invstd, sums, gw, gb, groups, c, BG=FINAL_ROWS, BC=FINAL_CHANNELS, num_warps=4)
        dx = torch.empty_like(x, memory_format=torch.channels_last)
        res = ctx.res_dtype is not None
        dres = torch.empty_like(x, dtype=ctx.res_dtype, memory_format=torch.channels_last) if res else None
        grid, bm, pc = _point_grid(k, rows, c)
        k["grad_input"][grid](gy, y if y is not None else gy, x, dx, dres if res else dx, mean, invstd, weight, bias, sums, rows, c,
                              RES=res, ACT=ctx.act, BM=bm, BC=pc, num_warps=POINT_WARPS)
        return dx, gw, gb, dres, None, None, None, None, None


def eligible(m: nn.Module) -> bool:
    """Plain affine BatchNorm2d with a fixed momentum (a cumulative average reads a count on the host) and no hooks."""
    return type(m) is nn.BatchNorm2d and m.affine and m.momentum is not None and not swap.hooked(m)


def candidates(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if eligible(m)]


def activate(y: torch.Tensor, act: int) -> torch.Tensor:
    """torch's own activation `act` of `y`."""
    if act == RELU:
        return torch.relu(y)
    if act == RELU6:
        return nn.functional.relu6(y)
    return nn.functional.silu(y) if act == SILU else y


def reference(bn: nn.BatchNorm2d, x: torch.Tensor, res: Optional[torch.Tensor], act: int) -> torch.Tensor:
    """What the layer computes with torch's own modules and ops (evaluation, and any input the kernels do not fit)."""
    y = type(bn).forward(bn, x)
    if res is not None:
        y = y + res
    return activate(y, act)


class NormAct(nn.Module):
    """One batch-norm, and the activation and residual add after it where the model's graph has them, as the kernels."""

    def __init__(self, bn: nn.BatchNorm2d, act: int, residual: bool, checked: set) -> None:
        super().__init__()
        self.__dict__["bn"] = bn  # not a child: its parameters stay the model's alone
        self.act = int(act)
        self.residual = residual
        self.checked = checked

    def forward(self, x: torch.Tensor, res: Optional[torch.Tensor] = None) -> torch.Tensor:
        bn = self.bn
        if not (bn.training and fits(x) and (res is None or (res.shape == x.shape and res.dtype == x.dtype
                                                            and res.is_contiguous(memory_format=torch.channels_last)))):
            return reference(bn, x, res, self.act)
        key = (x.shape[1], x.dtype, self.act, res is not None)  # what picks the kernels' code: channels, dtype, what is folded in
        if key not in self.checked and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            check(check_shape(tuple(x.shape)), x.dtype, x.device, bn.eps, self.act, res is not None)
            self.checked.add(key)
        if bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
        rm, rv = (bn.running_mean, bn.running_var) if bn.track_running_stats else (None, None)
        return _NormAct.apply(x, bn.weight, bn.bias, res, rm, rv, float(bn.momentum), bn.eps, self.act)


class Norms:
    """The model's batch-norms as the kernels, swapped in only while steps are warmed up and captured.

    With the model traced by torch.fx, the model's forward is the rewritten graph's inside the block
    (batch-norm -> [add ->] ReLU as one layer); otherwise each batch-norm's forward is a NormAct's.
    """

    def __init__(self, model: nn.Module) -> None:
        from mpsrun.train.kernels import norm_graph

        self.checked: set[tuple] = set()
        self.model = model
        try:
            self.graph, self.layers = norm_graph.rewrite(model, lambda bn, act, residual: NormAct(bn, act, residual, self.checked), eligible)
        except Exception:  # a graph fx traced but could not rewrite: the batch-norms alone, never a failed run
            self.graph, self.layers = None, []
        self.modules = [layer.bn for layer in self.layers] if self.graph is not None else candidates(model)
        self.singles = [] if self.graph is not None else [(m, NormAct(m, NONE, False, self.checked)) for m in self.modules]

    def describe(self) -> str:
        """How many layers, and how many with an activation or the residual folded in."""
        if self.graph is None:
            return f"{len(self.modules)} batch-norms (the model does not trace with torch.fx: no activation folded in)"
        acts = ", ".join(f"{sum(1 for layer in self.layers if layer.act == a)} {name}" for a, name in ACTS.items()
                         if a != NONE and any(layer.act == a for layer in self.layers))
        res = sum(1 for layer in self.layers if layer.residual)
        return f"{len(self.layers)} batch-norms; activations folded in: {acts or 'none'}; residual adds folded in: {res}"

    def swapped(self) -> contextlib.AbstractContextManager:
        if self.graph is not None:
            return swap.swapped([(self.model, self.graph.forward)])
        return swap.swapped([(m, layer.forward) for m, layer in self.singles])


CHECK_ELEMENTS = 1 << 22  # the check's input at most about this many elements (a few MB, not the batch's GBs)


def check_shape(shape: tuple) -> tuple:
    """The batch's shape with fewer images: the same channels and image size (the kernels' code and tiles), the
    check's copies and fp32 reference a few MB (at the batch's own shape, ResNet18's stem at batch 256 held 4.6 GB more at peak)."""
    n, c, h, w = shape
    return (max(1, min(n, -(-CHECK_ELEMENTS // (c * h * w)))), c, h, w)


def check(shape: tuple, dtype: torch.dtype, device: torch.device, eps: float, act: int, residual: bool) -> None:
    """The kernels against torch's batch-norm (and add, ReLU), forward and backward, on an input with a large common
    offset (where sums of squares lose everything); raises Mismatch beyond TOLERANCE of the largest magnitude.

    Why: MPS has shown silent wrong answers, and a kernel written here could too on a GPU it was not
    measured on. Once per shape, before capture, with a private generator (the run's random streams are untouched).
    """
    gen = torch.Generator(device=device).manual_seed(0)
    c = shape[1]

    def rand(*s: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return torch.randn(s, device=device, generator=gen) * scale + offset

    x = (rand(*shape, scale=3.0, offset=50.0)).to(dtype).contiguous(memory_format=torch.channels_last)
    res = rand(*shape).to(dtype).contiguous(memory_format=torch.channels_last) if residual else None
    gy = rand(*shape).to(dtype).contiguous(memory_format=torch.channels_last)
    w, b = rand(c, scale=0.5, offset=1.0), rand(c, scale=0.5)
    rm, rv = rand(c), rand(c).abs() + 0.5
    outs, kept = [], None
    for mine in (True, False):
        xs = x.clone().requires_grad_()
        rs = res.clone().requires_grad_() if res is not None else None
        ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
        run_m, run_v = rm.clone(), rv.clone()
        with torch.enable_grad():
            if mine:
                out = _NormAct.apply(xs, ws, bs, rs, run_m, run_v, 0.1, eps, act)
                kept = (out.detach() > 0) & (out.detach() < (6 if act == RELU6 else float("inf")))
            else:  # torch's, in fp32 from the same inputs: what the rounding of `dtype` is measured against
                out = nn.functional.batch_norm(xs.float(), run_m, run_v, ws, bs, True, 0.1, eps)
                out = out + rs.float() if rs is not None else out
                if act in (RELU, RELU6):  # where a value within rounding of a kink went the other way, the kernels' side is taken
                    pre = out.detach()
                    top = 6.0 if act == RELU6 else float("inf")
                    flipped = kept != ((pre > 0) & (pre < top))
                    near = torch.minimum(pre.abs(), (pre - top).abs())
                    if flipped.any() and near[flipped].max().item() > TOLERANCE[dtype] * pre.abs().max().item():
                        raise Mismatch(f"batch-norm {tuple(shape)} {dtype}: the {ACTS[act]} kept or dropped values away from its kinks")
                    out = torch.where(kept, out, activate(pre, act))
                else:
                    out = activate(out, act)
            grads = vjp(out, [t for t in (xs, ws, bs, rs) if t is not None], gy.to(out.dtype))
        outs.append([out, *grads, run_m, run_v])
    names = ["output", "input gradient", "weight gradient", "bias gradient"] + (["residual gradient"] if residual else []) + ["running mean", "running var"]
    for name, a, r in zip(names, *outs):
        scale = r.float().abs().max().item() or 1.0
        err = (a.float() - r.float()).abs().max().item() / scale
        tol = TOLERANCE[dtype] if name in ("output", "input gradient", "residual gradient") else TOLERANCE[torch.float32] * 10
        if not err <= tol:
            raise Mismatch(f"batch-norm {tuple(shape)} {dtype}{' + residual' if residual else ''}{' + ' + ACTS[act] if act else ''}: "
                           f"the {name} is off by {err:.1e} of its largest magnitude (tolerance {tol:.0e})")


def plan(model: nn.Module) -> Optional[Norms]:
    """The model's batch-norms for the kernels, or None when it has none they fit."""
    norms = Norms(model)
    return norms if norms.modules else None
