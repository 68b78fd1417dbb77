"""A channels_last max-pool as one Triton kernel forward and one backward, bit-equal to torch's.

Why: in the H100 profile of ResNet18 (bf16, channels_last, batch 256, docs/benchmarks.md) the
stem's 3x3 stride-2 max-pool took 0.86 ms forward and 1.70 ms backward of a 21.3 ms step, about
12%: torch's NHWC kernels write an int64 index for every output and its backward walks them
through shared memory. Here the forward keeps the winner's place in its window as one byte, and
the backward gathers, for each input, the few windows that cover it: each tensor is read or
written once.

Exact: the same maximum and the same winner as torch's kernel (the first strict maximum in the
window's row-major order, a NaN always taking over), and each input's gradient the fp32 sum over
its windows in torch's order, rounded once to the tensor's dtype. So results are torch's to the
bit (a gradient of -0.0 may come back +0.0); `Pools.check` compares both ways against torch's ops
on tied and NaN-laden inputs at each new shape, before any capture, and raises `Mismatch` (the run
then uses torch's kernels and says so).

Used only where it is replayed from CUDA graphs (GraphTrainer swaps the modules' forward for
warm-up and capture, and puts them back): evaluation outside the graphs, export and checkpoints
see the plain modules. Triton is imported only here, only on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Optional

import torch
from torch import nn

from mpsrun.train.kernels import swap, vjp

BLOCK_POSITIONS = 32  # output (forward) or input (backward) positions per program
BLOCK_CHANNELS = 64  # channels per program: the ResNet stem's 64 in one program, 128 bytes of bf16 a row

_kernels: dict[str, Any] = {}


class Mismatch(RuntimeError):
    """The kernels disagreed with torch's on this GPU: the run uses torch's max-pool (said in its notes)."""


def _build() -> dict[str, Any]:
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def pool_fwd(x_ptr, y_ptr, i_ptr, P, C, H, W, OH, OW,
                 KH: tl.constexpr, KW: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr,
                 BP: tl.constexpr, BC: tl.constexpr, WANT_IDX: tl.constexpr):
        pp = tl.program_id(0) * BP + tl.arange(0, BP)  # output positions, n * OH * OW + oh * OW + ow
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        pmask = pp < P
        cmask = cc < C
        ow = pp % OW
        oh = (pp // OW) % OH
        n = pp // (OW * OH)
        best = tl.full((BP, BC), float("-inf"), tl.float32)
        arg = tl.zeros((BP, BC), dtype=tl.int32)
        for kh in tl.static_range(KH):
            ih = oh * S - PAD + kh
            for kw in tl.static_range(KW):
                iw = ow * S - PAD + kw
                ok = pmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                src = (n * H + ih) * W + iw
                v = tl.load(x_ptr + src[:, None] * C + cc[None, :], mask=ok[:, None] & cmask[None, :], other=float("-inf")).to(tl.float32)
                take = (v > best) | (v != v)  # torch's rule: a strict maximum, or a NaN (the last one stays)
                best = tl.where(take, v, best)
                arg = tl.where(take, kh * KW + kw, arg)
        out = pp[:, None] * C + cc[None, :]
        m = pmask[:, None] & cmask[None, :]
        tl.store(y_ptr + out, best.to(y_ptr.dtype.element_ty), mask=m)
        if WANT_IDX:
            tl.store(i_ptr + out, arg.to(tl.int8), mask=m)

    @triton.jit
    def pool_bwd(g_ptr, i_ptr, dx_ptr, Q, C, H, W, OH, OW,
                 KH: tl.constexpr, KW: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr,
                 NH: tl.constexpr, NW: tl.constexpr, BQ: tl.constexpr, BC: tl.constexpr):
        qq = tl.program_id(0) * BQ + tl.arange(0, BQ)  # input positions, n * H * W + ih * W + iw
        cc = tl.program_id(1) * BC + tl.arange(0, BC)
        qmask = qq < Q
        cmask = cc < C
        iw = qq % W
        ih = (qq // W) % H
        n = qq // (W * H)
        # the windows that cover this input: rows [hs, he), columns [ws, we) (torch's p_start / p_end)
        hs = tl.where(ih + PAD < KH, 0, (ih + PAD - KH) // S + 1)
        he = tl.minimum((ih + PAD) // S + 1, OH)
        ws = tl.where(iw + PAD < KW, 0, (iw + PAD - KW) // S + 1)
        we = tl.minimum((iw + PAD) // S + 1, OW)
        acc = tl.zeros((BQ, BC), dtype=tl.float32)
        for dh in tl.static_range(NH):  # torch's order: window rows outer, columns inner, summed in fp32
            oh = hs + dh
            for dw in tl.static_range(NW):
                ow = ws + dw
                ok = qmask & (oh < he) & (ow < we)
                place = (ih + PAD - oh * S) * KW + (iw + PAD - ow * S)
                src = (n * OH + oh) * OW + ow
                lm = ok[:, None] & cmask[None, :]
                won = tl.load(i_ptr + src[:, None] * C + cc[None, :], mask=lm, other=-1).to(tl.int32)
                g = tl.load(g_ptr + src[:, None] * C + cc[None, :], mask=lm, other=0.0).to(tl.float32)
                acc += tl.where(won == place[:, None], g, 0.0)
        tl.store(dx_ptr + qq[:, None] * C + cc[None, :], acc.to(dx_ptr.dtype.element_ty), mask=qmask[:, None] & cmask[None, :])

    _kernels.update(fwd=pool_fwd, bwd=pool_bwd, cdiv=triton.cdiv)
    return _kernels


def _geometry(m: nn.MaxPool2d) -> Optional[tuple[int, int, int, int]]:
    """(kernel h, kernel w, stride, padding) of a square-strided, square-padded, undilated pool; None otherwise."""
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    kh, kw = pair(m.kernel_size)
    sh, sw = pair(m.stride if m.stride is not None else m.kernel_size)
    ph, pw = pair(m.padding)
    dh, dw = pair(m.dilation)
    if sh != sw or ph != pw or (dh, dw) != (1, 1) or m.ceil_mode or m.return_indices:
        return None
    return int(kh), int(kw), int(sh), int(ph)


def _out_size(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


def fits(x: torch.Tensor) -> bool:
    """A 4-D channels_last CUDA tensor of a float dtype, small enough for 32-bit offsets."""
    return (x.dim() == 4 and x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.is_contiguous(memory_format=torch.channels_last) and x.numel() < 2**31 and x.shape[0] > 0)


def _forward(x: torch.Tensor, geo: tuple[int, int, int, int], want_idx: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    k = _build()
    kh, kw, s, p = geo
    n, c, h, w = x.shape
    oh, ow = _out_size(h, kh, s, p), _out_size(w, kw, s, p)
    y = torch.empty((n, c, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    idx = torch.empty((n, c, oh, ow), device=x.device, dtype=torch.int8, memory_format=torch.channels_last) if want_idx else None
    positions = n * oh * ow
    grid = (k["cdiv"](positions, BLOCK_POSITIONS), k["cdiv"](c, BLOCK_CHANNELS))
    k["fwd"][grid](x, y, idx if idx is not None else y, positions, c, h, w, oh, ow, KH=kh, KW=kw, S=s, PAD=p,
                   BP=BLOCK_POSITIONS, BC=BLOCK_CHANNELS, WANT_IDX=want_idx, num_warps=4)
    return y, idx


def _backward(g: torch.Tensor, idx: torch.Tensor, shape: torch.Size, geo: tuple[int, int, int, int]) -> torch.Tensor:
    k = _build()
    kh, kw, s, p = geo
    n, c, h, w = shape
    g = g.contiguous(memory_format=torch.channels_last)
    dx = torch.empty(shape, device=g.device, dtype=g.dtype, memory_format=torch.channels_last)
    positions = n * h * w
    grid = (k["cdiv"](positions, BLOCK_POSITIONS), k["cdiv"](c, BLOCK_CHANNELS))
    k["bwd"][grid](g, idx, dx, positions, c, h, w, idx.shape[2], idx.shape[3], KH=kh, KW=kw, S=s, PAD=p,
                   NH=-(-kh // s), NW=-(-kw // s), BQ=BLOCK_POSITIONS, BC=BLOCK_CHANNELS, num_warps=4)
    return dx


class _MaxPool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, geo: tuple[int, int, int, int]) -> torch.Tensor:  # type: ignore[override]
        y, idx = _forward(x, geo, want_idx=True)
        ctx.save_for_backward(idx)
        ctx.shape, ctx.geo = x.shape, geo
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        return _backward(g, idx, ctx.shape, ctx.geo), None


def max_pool(x: torch.Tensor, m: nn.MaxPool2d, geo: tuple[int, int, int, int]) -> torch.Tensor:
    """`m(x)` through the kernels where they apply (torch's op otherwise)."""
    if not fits(x):
        return nn.functional.max_pool2d(x, m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode, return_indices=m.return_indices)
    if torch.is_grad_enabled() and x.requires_grad:
        return _MaxPool.apply(x, geo)
    return _forward(x, geo, want_idx=False)[0]


def candidates(model: nn.Module) -> list[tuple[nn.MaxPool2d, tuple[int, int, int, int]]]:
    """The model's plain MaxPool2d modules the kernels can stand in for (no hooks, no dilation, floor mode)."""
    out = []
    for m in model.modules():
        if type(m) is nn.MaxPool2d and not swap.hooked(m):
            geo = _geometry(m)
            if geo is not None and geo[3] <= min(geo[0], geo[1]) // 2:
                out.append((m, geo))
    return out


class Pools:
    """The model's max-pools as the kernels, swapped in only while steps are warmed up and captured."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = candidates(model)
        self.checked: set[tuple] = set()

    def swapped(self) -> contextlib.AbstractContextManager:
        """Each pool's forward is the kernels' inside the block."""
        return swap.swapped([(m, functools.partial(self._call, m=m, geo=geo)) for m, geo in self.modules])

    def _call(self, x: torch.Tensor, m: nn.MaxPool2d, geo: tuple[int, int, int, int]) -> torch.Tensor:
        if fits(x):
            key = (tuple(x.shape), x.dtype, geo)
            if key not in self.checked and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
                check(tuple(x.shape), x.dtype, x.device, geo)
                self.checked.add(key)
        return max_pool(x, m, geo)


def check(shape: tuple, dtype: torch.dtype, device: torch.device, geo: tuple[int, int, int, int]) -> None:
    """The kernels against torch's max-pool on inputs full of ties, with NaNs, both ways; raises Mismatch.

    Why: MPS has shown silent wrong answers, and a kernel written here could too on a GPU it was
    not measured on. Once per shape, before capture, with a private generator (the run's random
    streams are untouched).
    """
    from concurrent.futures import ThreadPoolExecutor

    if device.type != "cuda":  # Triton's CPU interpreter (the tests) keeps one launch's grid in a global: no threads
        _against_torch(shape, dtype, device, geo)
        return
    _build()  # once, here: both threads use the same kernels (each would otherwise make and compile its own)
    with ThreadPoolExecutor(1, thread_name_prefix="mpsrun-pool-check") as ex:
        early = ex.submit(_first_backward, shape, dtype, device, geo)  # its first compile beside the forward's
        _against_torch(shape, dtype, device, geo)
        early.result()


def _first_backward(shape: tuple, dtype: torch.dtype, device: torch.device, geo: tuple[int, int, int, int]) -> None:
    """The backward kernel launched once on zeros of this shape, on its own thread: its first launch compiles it
    (Triton's passes and its launcher, about as long as the forward's; the compiles release the interpreter lock),
    so the check's two compiles overlap instead of following each other. Its own stream, synchronised."""
    kh, kw, s, p = geo
    with torch.cuda.device(device):
        n, c, h, w = shape
        out = (n, c, _out_size(h, kh, s, p), _out_size(w, kw, s, p))
        g = torch.zeros(out, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        idx = torch.zeros(out, device=device, dtype=torch.int8).contiguous(memory_format=torch.channels_last)
        _backward(g, idx, torch.Size(shape), geo)
        torch.cuda.synchronize(device)


def _against_torch(shape: tuple, dtype: torch.dtype, device: torch.device, geo: tuple[int, int, int, int]) -> None:
    kh, kw, s, p = geo
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(-3, 4, shape, device=device, generator=gen).to(dtype)
    x.view(-1)[:: max(1, x.numel() // 7)] = float("nan")  # a few NaNs: they win their windows, as in torch
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    with torch.enable_grad():
        got = _MaxPool.apply(x, geo)
        want = nn.functional.max_pool2d(x, (kh, kw), s, p)
        g = torch.randint(-8, 9, got.shape, device=device, generator=gen).to(dtype) / 4  # sums of a few are exact in any dtype
        (mine,) = vjp(got, x, g)
        (ref,) = vjp(want, x, g)
    for what, a, b in (("output", got, want), ("input gradient", mine, ref)):
        if a.shape != b.shape or not torch.equal(torch.nan_to_num(a, nan=1e4), torch.nan_to_num(b, nan=1e4)):
            raise Mismatch(f"max-pool {tuple(shape)} {dtype}: the {what} differs from torch's")


def plan(model: nn.Module) -> Optional[Pools]:
    """The model's pools for the kernels, or None when it has none they fit."""
    pools = Pools(model)
    return pools if pools.modules else None
