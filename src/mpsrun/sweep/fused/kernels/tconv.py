"""Triton implicit-GEMM convolutions on the fused sweep's packed channels_last layout.

Why: members packed as [B, M*C, H, W] (packed.py) run their later convolutions grouped by member.
cuDNN runs a grouped convolution group by group (on an H200, 16 small-CNN members: 0.8 ms of a
3.7 ms step in grouped forward and input gradient), and the weight gradient was a batched matmul
over an unfolded copy of the input (hundreds of megabytes a step). Here each is one kernel over
every member at once, reading the packed tensors where they lie:

- `conv_fwd`: out[p, m*Cout+co] = sum over (kh, kw, ci) of x[shift(p, kh, kw), m*Cin+ci] * w[m, co, ci, kh, kw]
  (stride 1), bias in the epilogue; memory is [N, H, W, M*C] (channels_last), so a member's channels
  at one pixel are contiguous.
- `conv_dgrad`: the same kernel on grad_out with each member's filters flipped and transposed, and
  padding d*(K-1)-p (negative padding is only an offset: the masks do the rest).
- `conv_wgrad`: gw[m, co, (ci, kh, kw)] = sum_p g[p, m*Cout+co] * x[shift(p, kh, kw), m*Cin+ci], the
  sum over p cut into S slices (split-K), each program writing fp32 partials, summed by torch after
  (deterministic, no atomics). The (ci, kh, kw) columns are one flattened axis, so a 3-channel first
  layer fills its tiles (27 columns in a 32-wide tile) instead of padding each tap to 16. With a bias, the
  programs of the first column block also sum their grad_out tiles over rows: the bias gradient's fp32 partials
  [S, M, Cout], summed the same way (one pass over grad_out instead of a separate reduction after).
- `conv_flat_k`: the forward of a few-channel convolution (Cin < FLAT_CIN) over the same flattened (ci, kh, kw)
  axis, any stride, bias in the epilogue. Why: a 3-channel first layer padded each tap's 3 channels to a 16-wide
  tile in `conv_fwd_k` (5x the work), and the dense first convolution of members sharing a batch went to cuDNN,
  whose bias is a separate broadcast add over the whole output (on an H200, 16 members: 145 us + 189 us a step).
- tpipe.py: software-pipelined candidates of the per-tap forward / input gradient (one dynamic (tap, channel block)
  loop) and weight gradient, taken only where CFG["fwd_pipe"], ["dgrad_pipe"] or ["wgrad_pipe"] names their tiles.

Precision: fp32 inputs use TF32 tensor cores where `torch.backends.cudnn.allow_tf32` (cuDNN's own
choice for convolutions) and exact fp32 ("ieee") otherwise; bf16/fp16 inputs accumulate in fp32 and
write the input's dtype (the weight gradient stays fp32 until the caller casts it).

Triton is imported only when a kernel is first built, so this module imports on a machine without it.
Tensor offsets are 32-bit: `fits` refuses tensors of 2**31 elements or more.
"""

from __future__ import annotations

from typing import Any

import torch

_kernels: dict[str, Any] = {}

# Tiles: one fixed choice per kernel, no autotuning (each variant compiled costs a user seconds of start-up).
# fwd: (positions per program, most output channels, most input channels per dot, warps)
# wgrad: (rows per inner step, most output channels, most flattened (ci, kh, kw) columns, warps)
# On an H200 (bf16, 16 members 32 -> 64 channels, 16x16): fwd 128-position tiles 0.141 ms, 64: 0.153 (cuDNN's grouped 0.358);
# wgrad 64 rows 0.164 ms (the present unfolded bmm 0.911), and for a 3-channel dense first layer 0.071 (128 rows: 0.142).
# flat: (positions per program, most output channels, flattened (ci, kh, kw) columns per dot, warps)
# *_pipe: tpipe's software-pipelined variants, (the same four, then num_stages), or None (the kernels above), chosen from
# a GPU probe (below): fwd_pipe for grouped forwards of TAP_CIN channels and more,
# dgrad_pipe for every input gradient, wgrad_pipe for weight gradients of 16 channels and more.
# flat on an H200 (bf16, a dense 3 -> 512 first layer over [128, 3, 32, 32], bias fused): 128 output channels a tile
# 0.105 ms, 64: 0.115 (cuDNN's forward and its separate bias pass 0.360).
CFG: dict[str, Any] = {"fwd": (128, 64, 32, 4), "wgrad": (64, 64, 32, 4), "flat": (128, 128, 32, 4),
                       "fwd_pipe": (128, 64, 32, 4, 3), "dgrad_pipe": (128, 64, 32, 4, 3), "wgrad_pipe": None}
# *_pipe on an H200 (git show f803281:benchmarks/tconv3_probe_gpu.py, bf16, batch 128; ms, the kernels above / pipelined): forward 16 members 32 -> 64 at
# 16x16 0.142 / 0.105, 64 -> 128 at 8x8 0.102 / 0.083, 64 members 32 -> 64 0.499 / 0.300; input gradient 0.141 / 0.117,
# 0.089 / 0.080, 0.495 / 0.374; no pipelined weight gradient won (0.214 against 0.247 at best: it pipelined already).
# fewer input channels a member: the forward over flattened (ci, kh, kw) columns, any stride. An H200 (bf16, 16 members):
# 3 -> 32 channels 0.17 ms against cuDNN's grouped 0.54; 8 -> 16 channels 0.77 against 0.37 (the per-tap kernel 0.83),
# so from 5 to 15 channels the forward stays cuDNN's (forward_ok).
FLAT_CIN = 5
TAP_CIN = 16  # this many input channels a member and more: a tap's channels a tile (forward, weight gradient)
WGRAD_PROGRAMS = 1024  # about this many programs for a weight gradient: a few waves on a 132-SM GPU
WGRAD_MIN_ROWS = 512  # rows per split at least (partials stay small against the sum)


def _build() -> dict[str, Any]:
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def conv_fwd_k(x_ptr, w_ptr, b_ptr, y_ptr, P, H, W, OH, OW, CIN, COUT, XC, YC, PH, PW,
                   DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BP: tl.constexpr, BCO: tl.constexpr, BCI: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
        ncb = tl.cdiv(COUT, BCO)
        m = tl.program_id(1) // ncb
        co = (tl.program_id(1) % ncb) * BCO + tl.arange(0, BCO)
        pp = tl.program_id(0) * BP + tl.arange(0, BP)
        pmask = pp < P
        comask = co < COUT
        ow = pp % OW
        oh = (pp // OW) % OH
        n = pp // (OW * OH)
        acc = tl.zeros((BP, BCO), dtype=tl.float32)
        for kh in tl.static_range(KH):
            ih = oh - PH + kh * DH
            for kw in tl.static_range(KW):
                iw = ow - PW + kw * DW
                ok = pmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                base = ((n * H + ih) * W + iw) * XC + m * CIN
                wbase = ((m * KH + kh) * KW + kw) * CIN  # w rearranged: [M, KH, KW, CIN, COUT]
                for c0 in range(0, CIN, BCI):
                    ci = c0 + tl.arange(0, BCI)
                    cimask = ci < CIN
                    a = tl.load(x_ptr + base[:, None] + ci[None, :], mask=ok[:, None] & cimask[None, :], other=0.0)
                    b = tl.load(w_ptr + (wbase + ci)[:, None] * COUT + co[None, :], mask=cimask[:, None] & comask[None, :], other=0.0)
                    if UP:
                        a, b = a.to(tl.float32), b.to(tl.float32)
                    acc = tl.dot(a, b, acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + m * COUT + co, mask=comask, other=0.0).to(tl.float32)[None, :]
        out = pp[:, None] * YC + m * COUT + co[None, :]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=pmask[:, None] & comask[None, :])

    @triton.jit
    def conv_flat_k(x_ptr, w_ptr, b_ptr, y_ptr, P, H, W, OH, OW, CIN, COUT, XC, YC, PH, PW, SH, SW, DH, DW,
                    KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BP: tl.constexpr, BCO: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
        ncb = tl.cdiv(COUT, BCO)
        m = tl.program_id(1) // ncb
        co = (tl.program_id(1) % ncb) * BCO + tl.arange(0, BCO)
        pp = tl.program_id(0) * BP + tl.arange(0, BP)
        pmask = pp < P
        comask = co < COUT
        ow = pp % OW
        oh = (pp // OW) % OH
        n = pp // (OW * OH)
        ih0 = oh * SH - PH
        iw0 = ow * SW - PW
        K = CIN * KH * KW
        acc = tl.zeros((BP, BCO), dtype=tl.float32)
        for k0 in range(0, K, BK):  # w rearranged: [M, CIN*KH*KW, COUT], the weight's own (ci, kh, kw) order
            kk = k0 + tl.arange(0, BK)
            kmask = kk < K
            ci = kk // (KH * KW)
            kh = (kk // KW) % KH
            kw = kk % KW
            ih = ih0[:, None] + (kh * DH)[None, :]
            iw = iw0[:, None] + (kw * DW)[None, :]
            ok = pmask[:, None] & kmask[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.load(x_ptr + ((n[:, None] * H + ih) * W + iw) * XC + (m * CIN + ci)[None, :], mask=ok, other=0.0)
            b = tl.load(w_ptr + (m * K + kk)[:, None] * COUT + co[None, :], mask=kmask[:, None] & comask[None, :], other=0.0)
            if UP:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + m * COUT + co, mask=comask, other=0.0).to(tl.float32)[None, :]
        out = pp[:, None] * YC + m * COUT + co[None, :]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=pmask[:, None] & comask[None, :])

    @triton.jit
    def conv_wgrad_k(g_ptr, x_ptr, part_ptr, gb_ptr, P, ROWS, M, H, W, OH, OW, CIN, COUT, XC, YC, PH, PW, SH, SW, NKB,
                     DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, TAP: tl.constexpr,
                     HAS_BIAS: tl.constexpr,
                     BP: tl.constexpr, BCO: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
        s = tl.program_id(1)  # which slice of the rows
        ncb = tl.cdiv(COUT, BCO)
        pid = tl.program_id(0)  # the column block varies fastest: neighbours read the same grad_out rows (L2)
        kb = pid % NKB
        cb = (pid // NKB) % ncb
        m = pid // (NKB * ncb)
        K = CIN * KH * KW
        co = cb * BCO + tl.arange(0, BCO)
        comask = co < COUT
        if TAP:  # a block of one tap's channels: each row's BK channels are contiguous (vector loads)
            ncib = tl.cdiv(CIN, BK)
            tap = kb // ncib
            ci = (kb % ncib) * BK + tl.arange(0, BK)
            kmask = ci < CIN
            kh = tap // KW + ci * 0
            kw = tap % KW + ci * 0
            kk = (ci * KH + kh) * KW + kw  # the weight's own (ci, kh, kw) order
        else:  # flattened (ci, kh, kw) columns: a few-channel layer fills its tiles
            kk = kb * BK + tl.arange(0, BK)
            kmask = kk < K
            ci = kk // (KH * KW)
            kh = (kk // KW) % KH
            kw = kk % KW
        acc = tl.zeros((BCO, BK), dtype=tl.float32)
        bacc = tl.zeros((BCO,), dtype=tl.float32)  # the bias gradient's partial: programs of the first column block only
        start = s * ROWS
        for p0 in range(start, start + ROWS, BP):
            pp = p0 + tl.arange(0, BP)
            pmask = pp < P
            ow = pp % OW
            oh = (pp // OW) % OH
            n = pp // (OW * OH)
            a = tl.load(g_ptr + pp[None, :] * YC + m * COUT + co[:, None], mask=pmask[None, :] & comask[:, None], other=0.0)
            if HAS_BIAS:
                if kb == 0:
                    bacc += tl.sum(a.to(tl.float32), axis=1)
            if TAP:
                ih = oh * SH - PH + (tap // KW) * DH
                iw = ow * SW - PW + (tap % KW) * DW
                ok = pmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                b = tl.load(x_ptr + ((n * H + ih) * W + iw)[:, None] * XC + (m * CIN + ci)[None, :], mask=ok[:, None] & kmask[None, :],
                            other=0.0)
            else:
                ih = (oh * SH - PH)[:, None] + (kh * DH)[None, :]
                iw = (ow * SW - PW)[:, None] + (kw * DW)[None, :]
                ok = pmask[:, None] & kmask[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                b = tl.load(x_ptr + ((n[:, None] * H + ih) * W + iw) * XC + (m * CIN + ci)[None, :], mask=ok, other=0.0)
            if UP:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        base = (s * M + m) * COUT * K  # partials [S, M, COUT, K]
        tl.store(part_ptr + base + co[:, None] * K + kk[None, :], acc, mask=comask[:, None] & kmask[None, :])
        if HAS_BIAS:
            tl.store(gb_ptr + (s * M + m) * COUT + co, bacc, mask=comask & (kb == 0))  # partials [S, M, COUT]

    from mpsrun.sweep.fused.kernels import tpipe

    pipe = tpipe.build()
    _kernels.update(fwd=conv_fwd_k, flat=conv_flat_k, wgrad=conv_wgrad_k, fwd_pipe=pipe["fwd"], wgrad_pipe=pipe["wgrad"],
                    cdiv=triton.cdiv)
    return _kernels


def fits(*ts: torch.Tensor) -> bool:
    """4-D channels_last tensors of a float dtype the kernels take, small enough for 32-bit offsets."""
    return all(t.dim() == 4 and t.dtype in (torch.float32, torch.bfloat16, torch.float16) and t.numel() < 2**31 and t.shape[0] > 0
               and t.is_contiguous(memory_format=torch.channels_last) for t in ts)


def _prec(dtype: torch.dtype) -> str:
    """'tf32' where cuDNN would use TF32 for this convolution (fp32 inputs, allow_tf32), else exact fp32 products."""
    if dtype != torch.float32:
        return "tf32"  # bf16/fp16 products are exact in fp32: the setting does not apply
    return "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"


def _up(dtype: torch.dtype) -> bool:
    """Half-precision tiles widened to fp32 before `tl.dot`, only in Triton's CPU interpreter.

    Why: the interpreter's dot reads bf16 as raw integers (Triton 3.8: wrong by 1e10); a bf16 x bf16 product
    is exact in fp32, so the widened dot is the same sum the GPU's bf16 tensor cores accumulate in fp32."""
    import os

    return dtype != torch.float32 and os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, lo: int, hi: int) -> int:
    p = lo
    while p < n and p < hi:
        p *= 2
    return p


def _out(size: int, k: int, p: int, d: int, s: int = 1) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _implicit(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor | None, padding: tuple, dilation: tuple, m: int,
              which: str = "fwd") -> torch.Tensor:
    """The forward kernel: x [N, M*CIN, H, W] channels_last, wr [M, KH, KW, CIN, COUT] contiguous, stride 1.
    `which` ("fwd" or "dgrad"): whose CFG[which + "_pipe"] picks the pipelined variant (tpipe) when set."""
    k = _build()
    _, kh, kw, cin, cout = wr.shape
    n, xc, h, w = x.shape
    ph, pw = padding
    dh, dw = dilation
    oh, ow = _out(h, kh, ph, dh), _out(w, kw, pw, dw)
    y = torch.empty((n, m * cout, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    if y.numel() == 0:
        return y
    p = n * oh * ow
    pipe = CFG[which + "_pipe"]
    if pipe is not None:
        bp, hi_co, hi_ci, warps, stages = pipe
        kern, launch = k["fwd_pipe"], {"num_warps": warps, "num_stages": stages}
    else:
        bp, hi_co, hi_ci, warps = CFG["fwd"]
        kern, launch = k["fwd"], {"num_warps": warps}
    bco, bci = _pow2(cout, 16, hi_co), _pow2(cin, 16, hi_ci)
    grid = (k["cdiv"](p, bp), m * k["cdiv"](cout, bco))
    kern[grid](x, wr, bias if bias is not None else wr, y, p, h, w, oh, ow, cin, cout, xc, m * cout, ph, pw,
                   DH=dh, DW=dw, KH=kh, KW=kw, HAS_BIAS=bias is not None, BP=bp, BCO=bco, BCI=bci,
                   PREC=_prec(x.dtype), UP=_up(x.dtype), **launch)
    return y


def forward_ok(cin: int, stride: tuple) -> bool:
    """Whether `conv_fwd` takes a convolution of `cin` input channels a member at this stride: few channels (the
    flattened kernel) at any stride, TAP_CIN and more at stride 1 (a tap's channels a tile); cuDNN's between."""
    return cin < FLAT_CIN or (cin >= TAP_CIN and tuple(stride) == (1, 1))


def _flat(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: tuple, padding: tuple, dilation: tuple) -> torch.Tensor:
    """The few-channel forward kernel: x [N, M*CIN, H, W] channels_last, w [M, COUT, CIN, KH, KW], bias [M*COUT] or None."""
    k = _build()
    m, cout, cin, kh, kw = w.shape
    n, xc, h, wd = x.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh, ow = _out(h, kh, ph, dh, sh), _out(wd, kw, pw, dw, sw)
    y = torch.empty((n, m * cout, oh, ow), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    if y.numel() == 0:
        return y
    wr = w.to(x.dtype).reshape(m, cout, cin * kh * kw).transpose(1, 2).contiguous()  # [M, (ci, kh, kw), COUT]
    p = n * oh * ow
    bp, hi_co, hi_k, warps = CFG["flat"]
    bco, bk = _pow2(cout, 16, hi_co), _pow2(cin * kh * kw, 16, hi_k)
    grid = (k["cdiv"](p, bp), m * k["cdiv"](cout, bco))
    k["flat"][grid](x, wr, bias if bias is not None else wr, y, p, h, wd, oh, ow, cin, cout, xc, m * cout, ph, pw, sh, sw, dh, dw,
                    KH=kh, KW=kw, HAS_BIAS=bias is not None, BP=bp, BCO=bco, BK=bk, PREC=_prec(x.dtype), UP=_up(x.dtype),
                    num_warps=warps)
    return y


def conv_fwd(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, padding: tuple, dilation: tuple, groups_m: int,
             stride: tuple = (1, 1)) -> torch.Tensor:
    """Each member's convolution: x [N, M*Cin, H, W] channels_last, w [M, Cout, Cin, KH, KW], bias [M, Cout] or None.
    Returns [N, M*Cout, OH, OW] channels_last in x's dtype. Cin < FLAT_CIN: the flattened kernel (any stride);
    else a tap at a time, stride 1 only (`forward_ok`)."""
    b = bias.reshape(-1).contiguous() if bias is not None else None
    cin = w.shape[2]
    if not forward_ok(cin, stride):
        raise ValueError(f"conv_fwd: {cin} input channels at stride {tuple(stride)} (forward_ok: stride 1 from {FLAT_CIN} channels)")
    if cin < FLAT_CIN:
        return _flat(x, w, b, tuple(stride), tuple(padding), tuple(dilation))
    wr = w.to(x.dtype).permute(0, 3, 4, 2, 1).contiguous()  # [M, KH, KW, Cin, Cout]: a member's tap a [Cin, Cout] tile
    return _implicit(x, wr, b, tuple(padding), tuple(dilation), groups_m)


def conv_dgrad(g: torch.Tensor, w: torch.Tensor, xshape: tuple, padding: tuple, dilation: tuple) -> torch.Tensor:
    """The input gradient of a stride-1 member-grouped convolution: g [N, M*Cout, OH, OW] channels_last.

    A forward convolution of g with w'[m, ci, co, kh, kw] = w[m, co, ci, KH-1-kh, KW-1-kw] and padding d*(K-1)-p:
    input row i gathers grad rows o = i + p - d*k, which is the flipped filter's tap K-1-k at offset -(d*(K-1)-p)."""
    m, _, _, kh, kw = w.shape
    wr = w.to(g.dtype).flip(3, 4).permute(0, 3, 4, 1, 2).contiguous()  # [M, KH, KW, Cout, Cin]
    pad = (dilation[0] * (kh - 1) - padding[0], dilation[1] * (kw - 1) - padding[1])
    gx = _implicit(g, wr, None, pad, tuple(dilation), m, "dgrad")
    if tuple(gx.shape[2:]) != tuple(xshape[2:]):  # never for stride 1; a guard against a wrong caller
        raise ValueError(f"input gradient {tuple(gx.shape)} for an input {tuple(xshape)}")
    return gx


def conv_wgrad(g: torch.Tensor, x: torch.Tensor, wshape: tuple, padding: tuple, dilation: tuple, stride: tuple = (1, 1),
               bias: bool = False) -> Any:
    """Each member's weight gradient, fp32 [M, Cout, Cin, KH, KW]: g [N, M*Cout, OH, OW], x [N, M*Cin, H, W], both channels_last.
    With `bias`, (weight gradient, bias gradient fp32 [M, Cout]): the bias's summed in the same pass over g.

    Split-K over the N*OH*OW rows: S slices, each program's [BCO, BK] tile summed over its slice into fp32
    partials [S, M, Cout, Cin*KH*KW] (and [S, M, Cout] for the bias), then `sum(0)` (a deterministic order)."""
    k = _build()
    m, cout, cin, kh, kw = wshape
    n, xc, h, w = x.shape
    oh, ow = g.shape[2], g.shape[3]
    p = n * oh * ow
    kdim = cin * kh * kw
    tap = cin >= TAP_CIN  # one tap's channels a block (contiguous loads); fewer channels: flattened (ci, kh, kw) columns
    pipe = CFG["wgrad_pipe"] if tap else None
    if bias and tap and pipe is None:  # the per-tap kernel's branch for the bias slowed it more than a separate sum costs
        # (an H200, bf16, 16 members 32 -> 64 at 16x16: 0.224 ms with the bias inside, 0.167 + 0.042 apart)
        return conv_wgrad(g, x, wshape, padding, dilation, stride), g.sum((0, 2, 3), dtype=torch.float32).view(wshape[0], -1)
    bp, hi_co, hi_k, warps = pipe[:4] if pipe is not None else CFG["wgrad"]
    bco, bk = _pow2(cout, 16, hi_co), _pow2(cin if tap else kdim, 16, hi_k)
    nkb = kh * kw * k["cdiv"](cin, bk) if tap else k["cdiv"](kdim, bk)
    tiles = m * k["cdiv"](cout, bco) * nkb
    splits = max(1, min(k["cdiv"](WGRAD_PROGRAMS, tiles), k["cdiv"](p, WGRAD_MIN_ROWS)))
    rows = k["cdiv"](k["cdiv"](p, splits), bp) * bp
    splits = k["cdiv"](p, rows)
    part = torch.empty((splits, m, cout, kdim), device=x.device, dtype=torch.float32)
    bpart = torch.empty((splits, m, cout), device=x.device, dtype=torch.float32) if bias else part
    args = (g, x, part, bpart, p, rows, m, h, w, oh, ow, cin, cout, xc, g.shape[1], padding[0], padding[1], stride[0], stride[1], nkb)
    consts = dict(DH=dilation[0], DW=dilation[1], KH=kh, KW=kw, HAS_BIAS=bias, BP=bp, BCO=bco, BK=bk, PREC=_prec(x.dtype), UP=_up(x.dtype))
    if pipe is not None:
        k["wgrad_pipe"][(tiles, splits)](*args, **consts, num_warps=warps, num_stages=pipe[4])
    else:
        k["wgrad"][(tiles, splits)](*args, **consts, TAP=tap, num_warps=warps)
    gw = (part[0] if splits == 1 else part.sum(0)).view(m, cout, cin, kh, kw)
    if not bias:
        return gw
    return gw, (bpart[0] if splits == 1 else bpart.sum(0))


class SharedConv(torch.autograd.Function):
    """Every member's first convolution of one shared batch as one dense convolution (packed.shared_conv), its
    forward (few input channels: `conv_flat_k`, bias fused) and weight and bias gradients through these kernels.

    Why: for a 3-channel input cuDNN's dense weight gradient is a generic kernel plus a layout transform (on an
    H200, 0.5 ms of a 16-member step), and its forward adds the bias in a separate pass over the whole output
    (189 us a step beside its 145 us convolution). The input gradient stays cuDNN's, where the input needs one
    (a shared batch does not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: tuple, padding: tuple, dilation: tuple,  # type: ignore[override]
                convs: Any) -> torch.Tensor:
        from mpsrun.sweep.fused.amp import amp_cast

        x, w, b = amp_cast(x, w, b)
        ctx.save_for_backward(x, w)
        wf = w.reshape(-1, *w.shape[2:])
        use = convs.use("shared", x, wf.unsqueeze(0), stride, padding, dilation, b is not None)
        ctx.conf = (stride, padding, dilation, b is not None, use)
        if use and forward_ok(wf.shape[1], stride):
            return conv_fwd(x, wf.unsqueeze(0), b.reshape(1, -1) if b is not None else None, padding, dilation, 1, stride)
        return torch.nn.functional.conv2d(x, wf, b.reshape(-1) if b is not None else None, stride, padding, dilation)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w = ctx.saved_tensors
        stride, padding, dilation, has_bias, use = ctx.conf
        g = g.to(x.dtype)
        wf = w.reshape(-1, *w.shape[2:])
        m, cout = w.shape[0], w.shape[1]
        gx = gw = gb = None
        want_w = ctx.needs_input_grad[1] and not use
        if ctx.needs_input_grad[0] or want_w:
            gx, gw, _ = torch.ops.aten.convolution_backward(g, x, wf, None, list(stride), list(padding), list(dilation), False, [0, 0], 1,
                                                            [ctx.needs_input_grad[0], want_w, False])
            gw = gw.view(w.shape) if want_w else None
        want_b = has_bias and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[1] and use:
            g = g.contiguous(memory_format=torch.channels_last)
            gw = conv_wgrad(g, x, (1, *wf.shape), padding, dilation, stride, bias=want_b)
            if want_b:  # the bias gradient summed in the weight gradient's pass over g
                gw, gb = gw[0], gw[1].view(m, cout)
            gw = gw.view(w.shape)
        if want_b and gb is None:
            gb = g.sum((0, 2, 3)).view(m, cout)
        return gx, gw, gb, None, None, None, None
