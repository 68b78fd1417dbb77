"""Convolution stages of M members packed as one tensor [B, M*C, H, W] (channels_last on CUDA).

Why: graphed.group_for turns it on for CUDA, where per-member tensors [M, B, C, H, W] would be
transposed around every convolution. Members that share a batch run their first convolution as
one dense convolution; later convolutions are grouped by member, with the weight gradient as one
batched matmul over the unfolded input (cuDNN computes a grouped weight gradient group by group);
max-pools can be the solo engine's Triton kernels (FastPools). layers.Stacked decides when the
packed layout starts and ends; tests/test_fused_graphs.py checks it against the member-by-member
layout on the CPU and on CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mpsrun.sweep.fused.amp import amp_cast
from mpsrun.sweep.fused.kernels.checked import Checked
from mpsrun.sweep.fused.kernels.convcheck import timed_check

ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity, nn.Hardswish, nn.Mish)
POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)

PACKED = (nn.BatchNorm2d, *ELEMENTWISE, *POOLS)  # per-channel layers: on the packed channels as they are


def pack(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """[M, B, C, H, W] -> [B, M*C, H, W] (channels_last where asked)."""
    y = x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])
    return y.contiguous(memory_format=torch.channels_last) if channels_last else y


def unpack(y: torch.Tensor, m: int) -> torch.Tensor:
    """[B, M*C, H, W] -> [M, B, C, H, W] (a view; the flatten that follows copies in C, H, W order, as alone)."""
    return y.reshape(y.shape[0], m, y.shape[1] // m, *y.shape[2:]).transpose(0, 1)


def shared_conv(layer: nn.Conv2d, slot: dict[str, torch.Tensor], x: torch.Tensor, channels_last: bool, convs: Any = None) -> torch.Tensor:
    """Every member's convolution of one shared batch [B, C, H, W] as one dense convolution with M*out filters.

    Why: members that share a seed share each batch; a grouped convolution would copy it M times and run
    cuDNN's grouped kernels, where this is one ordinary convolution whose output is already packed."""
    w = slot["weight"]
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    if convs is not None and not isinstance(layer.padding, str):  # convcheck.Convs: the forward and weight gradient as Triton kernels
        from mpsrun.sweep.fused.kernels.tconv import SharedConv

        return SharedConv.apply(x, w, slot.get("bias"), tuple(layer.stride), tuple(layer.padding), tuple(layer.dilation), convs)
    bias = slot["bias"].reshape(-1) if "bias" in slot else None
    return F.conv2d(x, w.reshape(-1, *w.shape[2:]), bias, layer.stride, layer.padding, layer.dilation)


def packed_layer(layer: nn.Module, slot: dict[str, torch.Tensor], y: torch.Tensor, m: int, training: bool, convs: Any = None) -> torch.Tensor:
    """One layer on packed members: a convolution grouped by member, a batch-norm over every member's channels.
    `convs` (convcheck.Convs, CUDA groups): the convolutions as Triton kernels where checked, else cuDNN's."""
    if isinstance(layer, nn.Conv2d):
        if isinstance(layer.padding, str):  # 'same' / 'valid': torch's grouped convolution and its own backward
            w = slot["weight"]
            bias = slot["bias"].reshape(-1) if "bias" in slot else None
            return F.conv2d(y, w.reshape(m * w.shape[1], *w.shape[2:]), bias, layer.stride, layer.padding, layer.dilation, groups=m)
        return _GroupedConv.apply(y, slot["weight"], slot.get("bias"), tuple(layer.stride), tuple(layer.padding), tuple(layer.dilation), convs)
    if isinstance(layer, nn.BatchNorm2d):
        flat = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731 - views: running stats update in place
        if training and "num_batches_tracked" in slot:
            slot["num_batches_tracked"].add_(1)
        return F.batch_norm(y, flat(slot.get("running_mean")), flat(slot.get("running_var")), flat(slot.get("weight")),
                            flat(slot.get("bias")), training, layer.momentum, layer.eps)
    return layer(y)


WGRAD_CHUNK_BYTES = 1 << 30  # the unfolded input of the weight gradient, at most this much at once (members in chunks)
WGRAD_ROWS = 4096  # rows per slice of a weight gradient's sum (_splits)


class _GroupedConv(torch.autograd.Function):
    """A convolution grouped by member (x packed [B, M*in, H, W], weight [M, out, in, kh, kw]), its weight
    gradient as one batched matmul over the unfolded input.

    Why: cuDNN computes a grouped convolution's weight gradient group by group with generic fp32 kernels
    and layout transforms (on an H200, 16 small-CNN members: about 1.4 ms of a 3 ms step, where the
    forward and the input gradient take 0.17 ms each). Unfolded, each member's weight gradient is
    grad_out^T @ columns: one `bmm` for all members, at the precision cuDNN gives the convolution
    (TF32 where torch.backends.cudnn.allow_tf32, the default; fp32 otherwise). The forward and the
    input gradient stay cuDNN's. Where the group has `convs` (convcheck.Convs: graphed CUDA groups) and the shape
    passed its check, all three are tconv's Triton kernels instead (input gradient: stride 1; forward: where
    tconv.forward_ok, few input channels at any stride or many at stride 1), the bias gradient summed in the weight
    gradient's kernel where that was measured faster (tconv.conv_wgrad).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: tuple, padding: tuple, dilation: tuple,  # type: ignore[override]
                convs: Any = None) -> torch.Tensor:
        x, w, b = amp_cast(x, w, b)  # bf16 autocast: what a convolution reads, cast and saved for the backward
        ctx.save_for_backward(x, w)
        # tconv's kernels where the group has them and this shape passed its check (forward and input gradient: stride 1)
        use = convs is not None and convs.use("grouped", x, w, stride, padding, dilation, b is not None)
        ctx.conf = (stride, padding, dilation, b is not None, use)
        m = w.shape[0]
        if use:
            from mpsrun.sweep.fused.kernels import tconv

            if tconv.forward_ok(w.shape[2], stride):
                return tconv.conv_fwd(x, w, b, padding, dilation, m, stride)
        return F.conv2d(x, w.reshape(-1, *w.shape[2:]), b.reshape(-1) if b is not None else None, stride, padding, dilation, groups=m)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = g.to(x.dtype)
        stride, padding, dilation, has_bias, use = ctx.conf
        m, cout = w.shape[0], w.shape[1]
        gx = gw = gb = None
        if use:
            from mpsrun.sweep.fused.kernels import tconv

            g = g.contiguous(memory_format=torch.channels_last)
            if ctx.needs_input_grad[0] and tuple(stride) == (1, 1):
                gx = tconv.conv_dgrad(g, w, tuple(x.shape), padding, dilation)
            if ctx.needs_input_grad[1]:
                want_b = has_bias and ctx.needs_input_grad[2]
                gw = tconv.conv_wgrad(g, x, tuple(w.shape), padding, dilation, stride, bias=want_b)
                if want_b:  # the bias gradient from the same pass over g
                    gw, gb = gw[0], gw[1].view(m, cout)
        if ctx.needs_input_grad[0] and gx is None:
            gx = torch.ops.aten.convolution_backward(g, x, w.reshape(-1, *w.shape[2:]), None, list(stride), list(padding), list(dilation),
                                                     False, [0, 0], m, [True, False, False])[0]
        if ctx.needs_input_grad[1] and gw is None:
            gw = _wgrad(g, x, tuple(w.shape), stride, padding, dilation)
        if has_bias and ctx.needs_input_grad[2] and gb is None:
            gb = g.sum((0, 2, 3)).view(m, cout)
        return gx, gw, gb, None, None, None, None


def _wgrad(g: torch.Tensor, x: torch.Tensor, wshape: tuple, stride: tuple, padding: tuple, dilation: tuple) -> torch.Tensor:
    """Each member's weight gradient: its grad_out [P, out]^T @ its unfolded input [P, in*kh*kw] (P = B*OH*OW)."""
    m, cout, cin, kh, kw = wshape
    n, _, h, wd = x.shape
    oh, ow = g.shape[2], g.shape[3]
    ph, pw = padding
    xh = x.permute(0, 2, 3, 1)  # [B, H, W, M*in]: a view where x is channels_last
    if ph or pw:
        xp = x.new_zeros(n, h + 2 * ph, wd + 2 * pw, m * cin)
        xp[:, ph:ph + h, pw:pw + wd] = xh
    else:
        xp = xh.contiguous()
    s_n, s_h, s_w, s_c = xp.stride()
    rows, width = n * oh * ow, cin * kh * kw
    go = g.permute(0, 2, 3, 1).reshape(rows, m, cout)  # a view where g is channels_last
    # Split the long sum over rows: one [out, rows] @ [rows, width] per member is a handful of thread blocks each
    # walking 10^5 rows (1.3 ms a step for 16 members' 3->32 first layer on an H200); S slices of Q rows each are
    # S times the blocks, summed after.
    splits = _splits(rows)
    q = rows // splits
    step = max(1, min(m, WGRAD_CHUNK_BYTES // max(1, rows * width * x.element_size())))
    parts = []
    with _matmul_like_conv(g):
        for j in range(0, m, step):
            k = min(m, j + step) - j
            cols = xp.as_strided((k, n, oh, ow, cin, kh, kw),
                                 (cin * s_c, s_n, stride[0] * s_h, stride[1] * s_w, s_c, dilation[0] * s_h, dilation[1] * s_w),
                                 xp.storage_offset() + j * cin * s_c).reshape(k * splits, q, width)
            a = go[:, j:j + k].reshape(splits, q, k, cout).permute(2, 0, 3, 1).reshape(k * splits, cout, q)
            parts.append(torch.bmm(a, cols).view(k, splits, cout, width).sum(1))
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(wshape)


def _splits(rows: int) -> int:
    """Into how many equal slices the rows of a weight gradient's sum are cut: about WGRAD_ROWS rows each."""
    s = max(1, rows // WGRAD_ROWS)
    while rows % s:
        s -= 1
    return s


@contextlib.contextmanager
def _matmul_like_conv(t: torch.Tensor) -> Iterator[None]:
    """cuBLAS at cuDNN's convolution precision for the block: TF32 where cuDNN may use it (CUDA only)."""
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = t.is_cuda and bool(torch.backends.cudnn.allow_tf32)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


class FastPools(Checked):
    """The packed stage's max-pools as the solo engine's Triton kernels (train/kernels/fused_pool.py).

    Checked against torch's max-pool once per shape outside any capture (the warm-up steps); a mismatch, or a
    kernel Triton cannot build for this GPU, turns them off for the group, said through `say`. `why_not` says why they were not used at all."""

    fallback = "pools: torch's max-pool kernels for this group, not the fused ones"
    together = False  # every shape's check compiles the same two kernels

    def __init__(self, layers: list[nn.Module], say: Any) -> None:
        from mpsrun.train.kernels import fused_pool

        super().__init__(say)
        self.k = fused_pool
        self.mismatch = (fused_pool.Mismatch,)
        self.geo = {id(m): geo for m, geo in fused_pool.candidates(nn.Sequential(*layers))}

    @staticmethod
    def why_not(layers: list[nn.Module], device: torch.device, channels_last: bool) -> str | None:
        if device.type != "cuda" or not channels_last:
            return "not a CUDA channels_last group"
        if not any(type(m) is nn.MaxPool2d for m in layers):
            return "no max-pool"
        from mpsrun.train.kernels import kernels_off

        return kernels_off("MPSRUN_FUSED_POOL")

    def __call__(self, layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
        geo = self.geo.get(id(layer))
        if geo is None or self.off is not None or not self.k.fits(y):
            return layer(y)
        shape, dtype, device = tuple(y.shape), y.dtype, y.device

        def run() -> None:
            with timed_check(f"pool x={shape}", device):
                self.k.check(shape, dtype, device, geo)

        if not self.ready((shape, dtype, geo), run, y.is_cuda):
            return layer(y)
        return self.k.max_pool(y, layer, geo)  # type: ignore[arg-type]
