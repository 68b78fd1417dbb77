"""Software-pipelined variants of tconv's per-tap convolution kernels (issue 43): the forward's is what runs.

Why: `conv_fwd_k` walks the taps with `tl.static_range` (unrolled) and each tap's channel blocks with an inner
`range` that runs once for 32 channels a member, so Triton has no loop to pipeline: each tap's loads wait for
memory (on an H200, 16 members 32 -> 64 at 16x16: ~128 us a call, neither compute- nor bandwidth-bound).
`conv_fwd_pipe_k` walks (tap, channel block) as ONE dynamic loop, kh, kw and the channel offset computed from
its counter, so the loads of the next iterations are issued while this one's product runs (`num_stages`, a
launch option). `conv_wgrad_pipe_k` is the weight gradient's per-tap case: its reduction is over rows (a
dynamic loop already), so the variant is the launch (`num_stages`, tiles) and a loop body without a branch (the
bias gradient's row sum runs in every program, only the first channel block's is stored), a conditional in the
loop being something Triton's pipeliner may decline.

tconv takes these where its `CFG["fwd_pipe"]`, `CFG["dgrad_pipe"]` or `CFG["wgrad_pipe"]` names a tile choice
(BP, BCO, BCI or BK, warps, stages): fixed, no autotune, chosen from an H200 probe (`git show
f803281:benchmarks/tconv3_probe_gpu.py`): the forward and the input gradient take the pipelined forward (0.142 ->
0.105 ms and 0.141 -> 0.117 for 16 members 32 -> 64); no pipelined weight gradient won, so `wgrad_pipe` is None.
Triton is imported only when `build` is first called (from tconv._build).
"""

from __future__ import annotations

from typing import Any

_kernels: dict[str, Any] = {}


def build() -> dict[str, Any]:
    """The pipelined kernels' jit objects, made once."""
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def conv_fwd_pipe_k(x_ptr, w_ptr, b_ptr, y_ptr, P, H, W, OH, OW, CIN, COUT, XC, YC, PH, PW,
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
        nrow = (pp // (OW * OH)) * H
        ncib = tl.cdiv(CIN, BCI)
        acc = tl.zeros((BP, BCO), dtype=tl.float32)
        for t in range(0, KH * KW * ncib):  # (tap, channel block): one loop Triton can pipeline
            tap = t // ncib
            ci = (t - tap * ncib) * BCI + tl.arange(0, BCI)
            kh = tap // KW
            ih = oh - PH + kh * DH
            iw = ow - PW + (tap - kh * KW) * DW
            ok = pmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            cimask = ci < CIN
            base = ((nrow + ih) * W + iw) * XC + m * CIN
            a = tl.load(x_ptr + base[:, None] + ci[None, :], mask=ok[:, None] & cimask[None, :], other=0.0)
            wrow = (m * KH * KW + tap) * CIN + ci  # w rearranged: [M, KH, KW, CIN, COUT]
            b = tl.load(w_ptr + wrow[:, None] * COUT + co[None, :], mask=cimask[:, None] & comask[None, :], other=0.0)
            if UP:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + m * COUT + co, mask=comask, other=0.0).to(tl.float32)[None, :]
        out = pp[:, None] * YC + m * COUT + co[None, :]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=pmask[:, None] & comask[None, :])

    @triton.jit
    def conv_wgrad_pipe_k(g_ptr, x_ptr, part_ptr, gb_ptr, P, ROWS, M, H, W, OH, OW, CIN, COUT, XC, YC, PH, PW, SH, SW, NKB,
                          DH: tl.constexpr, DW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr,
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
        ncib = tl.cdiv(CIN, BK)
        tap = kb // ncib
        ci = (kb % ncib) * BK + tl.arange(0, BK)
        kmask = ci < CIN
        kh = tap // KW
        kw = tap % KW
        kk = (ci * KH + kh) * KW + kw  # the weight's own (ci, kh, kw) order
        dh = kh * DH - PH
        dw = kw * DW - PW
        acc = tl.zeros((BCO, BK), dtype=tl.float32)
        bacc = tl.zeros((BCO,), dtype=tl.float32)
        start = s * ROWS
        for p0 in range(start, start + ROWS, BP):
            pp = p0 + tl.arange(0, BP)
            pmask = pp < P
            ow = pp % OW
            oh = (pp // OW) % OH
            n = pp // (OW * OH)
            a = tl.load(g_ptr + pp[None, :] * YC + m * COUT + co[:, None], mask=pmask[None, :] & comask[:, None], other=0.0)
            if HAS_BIAS:  # no branch on kb in the loop: every program sums, the first channel block's partial is stored
                bacc += tl.sum(a.to(tl.float32), axis=1)
            ih = oh * SH + dh
            iw = ow * SW + dw
            ok = pmask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            b = tl.load(x_ptr + ((n * H + ih) * W + iw)[:, None] * XC + (m * CIN + ci)[None, :], mask=ok[:, None] & kmask[None, :],
                        other=0.0)
            if UP:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        base = (s * M + m) * COUT * K  # partials [S, M, COUT, K]
        tl.store(part_ptr + base + co[:, None] * K + kk[None, :], acc, mask=comask[:, None] & kmask[None, :])
        if HAS_BIAS:
            tl.store(gb_ptr + (s * M + m) * COUT + co, bacc, mask=comask & (kb == 0))  # partials [S, M, COUT]

    _kernels.update(fwd=conv_fwd_pipe_k, wgrad=conv_wgrad_pipe_k)
    return _kernels
