"""A small MLP's Linear (+ ReLU) layers as one Triton kernel forward and one backward each.

Why: the fashion step (batch 64, 784-512-512-10) spends most of its time in cuBLAS's fp32
GEMMs, which tile 64-row matrices onto a few of the GPU's SMs (8.7 us for a 64x512x512
product, split-K reductions beside them), plus separate kernels for the bias gradients
and ReLU's backward. Here each layer's forward is one kernel with the bias and the ReLU
in its epilogue, on small tiles that spread over many SMs; its backward is one kernel
whose programs split between the weight gradient (with the bias gradient in the same
pass) and the input's gradient (with the previous ReLU's mask applied, so no separate
threshold kernel runs).

Exact fp32: the products are IEEE fp32 FMAs (`input_precision="ieee"`, never TF32), summed in a
fixed order (a split reduction's parts too: an atomic counts them, never adds values), so a replay
gives the same bits every time; the sums are
ordered differently from cuBLAS's, so results agree with torch's to fp32 rounding, as any
two GEMM libraries do. The model itself is not changed: `plan` returns a forward that the
training step calls instead of the model's own; evaluation, export and checkpoints see
the plain modules. Triton is imported only here, only on CUDA.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import nn

from mpsrun.train.kernels import vjp
from mpsrun.train.kernels.swap import hooked

MAX_ROWS = 256  # batch rows the small tiles are for; larger batches fill the GPU through cuBLAS

# tile sizes (rows, outputs, reduction) and warps, chosen on the H100 (docs/benchmarks.md, "The step")
FWD = {"BM": 16, "BN": 32, "BK": 32, "warps": 2}
PROGRAMS = 256  # a forward's programs when its reduction is split (split-K): about two per SM of an H100
BWD_W = {"BN": 64, "BK": 64, "BM": 16, "warps": 4}
BWD_X = {"BM": 16, "BK": 16, "BN": 64, "warps": 2}

PRECISION = "ieee"  # IEEE fp32 FMAs; "tf32x3" (three TF32 tensor-core products) is for measuring only

_kernels: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def linear_fwd(x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, c_ptr, M, N, K, sx, sw, k_per,
                   HAS_BIAS: tl.constexpr, RELU: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SPLIT: tl.constexpr, PREC: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        omask = (rm[:, None] < M) & (rn[None, :] < N)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo = tl.program_id(2) * k_per
        for k0 in range(k_lo, k_lo + k_per, BK):  # this program's share of the reduction
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sx + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * sw + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PREC)
        last = True
        if SPLIT > 1:  # split-K: the program that ends last sums the parts in a fixed order (same bits whoever it is)
            tile = pm * tl.num_programs(1) + pn
            tl.store(p_ptr + tl.program_id(2) * M * N + rm[:, None] * N + rn[None, :], acc, mask=omask)
            tl.debug_barrier()  # every thread's part stored before the one count below (CUTLASS's semaphore pattern)
            done = tl.atomic_add(c_ptr + tile, 1, sem="acq_rel", scope="gpu")  # release: the parts are visible first
            last = done == SPLIT - 1
            tl.debug_barrier()
            if last:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                for s in range(SPLIT):
                    acc += tl.load(p_ptr + s * M * N + rm[:, None] * N + rn[None, :], mask=omask, other=0.0, cache_modifier=".cg")
                tl.store(c_ptr + tile, 0)  # zero again for the next call (a graph replays this kernel as it is)
        if last:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
            if RELU:
                acc = tl.where(acc < 0.0, 0.0, acc)  # NaN stays NaN, as torch.relu: a diverging run is still seen
            tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=omask)

    @triton.jit
    def linear_bwd(g_ptr, y_ptr, x_ptr, w_ptr, gx_ptr, gw_ptr, gb_ptr, M, N, K, sg, sx, sw, tiles_k, tiles_w, xtiles_k,
                   RELU: tl.constexpr, IN_RELU: tl.constexpr, HAS_BIAS: tl.constexpr, WANT_X: tl.constexpr,
                   WN: tl.constexpr, WK: tl.constexpr, WM: tl.constexpr, XM: tl.constexpr, XK: tl.constexpr, XN: tl.constexpr, PREC: tl.constexpr):
        pid = tl.program_id(0)
        if pid < tiles_w:  # the weight's gradient G^T X on a (WN, WK) tile; the bias's, sum of G, beside it
            rn = (pid // tiles_k) * WN + tl.arange(0, WN)
            rk = (pid % tiles_k) * WK + tl.arange(0, WK)
            acc = tl.zeros((WN, WK), dtype=tl.float32)
            bacc = tl.zeros((WN,), dtype=tl.float32)
            for m0 in range(0, M, WM):
                rm = m0 + tl.arange(0, WM)
                gmask = (rm[:, None] < M) & (rn[None, :] < N)
                g = tl.load(g_ptr + rm[:, None] * sg + rn[None, :], mask=gmask, other=0.0)
                if RELU:
                    y = tl.load(y_ptr + rm[:, None] * N + rn[None, :], mask=gmask, other=0.0)
                    g = tl.where(y > 0.0, g, 0.0)  # torch's threshold_backward on the output (NaN included)
                x = tl.load(x_ptr + rm[:, None] * sx + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
                acc = tl.dot(tl.trans(g), x, acc, input_precision=PREC)
                if HAS_BIAS:
                    bacc += tl.sum(g, axis=0)
            tl.store(gw_ptr + rn[:, None] * K + rk[None, :], acc, mask=(rn[:, None] < N) & (rk[None, :] < K))
            if HAS_BIAS:
                if pid % tiles_k == 0:
                    tl.store(gb_ptr + rn, bacc, mask=rn < N)
        else:
            if WANT_X:  # the input's gradient G W on a (XM, XK) tile, masked by the ReLU that made the input
                # (names apart from the branch above: Triton merges same-named values of both branches)
                q = pid - tiles_w
                xm = (q // xtiles_k) * XM + tl.arange(0, XM)
                xk = (q % xtiles_k) * XK + tl.arange(0, XK)
                xacc = tl.zeros((XM, XK), dtype=tl.float32)
                for n0 in range(0, N, XN):
                    xn = n0 + tl.arange(0, XN)
                    xgmask = (xm[:, None] < M) & (xn[None, :] < N)
                    xg = tl.load(g_ptr + xm[:, None] * sg + xn[None, :], mask=xgmask, other=0.0)
                    if RELU:
                        xy = tl.load(y_ptr + xm[:, None] * N + xn[None, :], mask=xgmask, other=0.0)
                        xg = tl.where(xy > 0.0, xg, 0.0)
                    xw = tl.load(w_ptr + xn[:, None] * sw + xk[None, :], mask=(xn[:, None] < N) & (xk[None, :] < K), other=0.0)
                    xacc = tl.dot(xg, xw, xacc, input_precision=PREC)
                xmask = (xm[:, None] < M) & (xk[None, :] < K)
                if IN_RELU:
                    xin = tl.load(x_ptr + xm[:, None] * sx + xk[None, :], mask=xmask, other=0.0)
                    xacc = tl.where(xin > 0.0, xacc, 0.0)
                tl.store(gx_ptr + xm[:, None] * K + xk[None, :], xacc, mask=xmask)

    _kernels.update(fwd=linear_fwd, bwd=linear_bwd, cdiv=triton.cdiv)
    return _kernels


def _forward(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], relu: bool, site: Optional[dict] = None) -> torch.Tensor:
    k = _build()
    m, kin = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=torch.float32)
    c = FWD
    tiles_m, tiles_n = k["cdiv"](m, c["BM"]), k["cdiv"](n, c["BN"])
    split, k_per = split_k(tiles_m * tiles_n, kin, c["BK"])
    parts = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
    counts = _counters(site, x.device, tiles_m * tiles_n) if split > 1 else y
    k["fwd"][(tiles_m, tiles_n, split)](x, w, b if b is not None else w, y, parts, counts, m, n, kin, x.stride(0), w.stride(0), k_per,
                                        HAS_BIAS=b is not None, RELU=relu, BM=c["BM"], BN=c["BN"], BK=c["BK"], SPLIT=split,
                                        PREC=PRECISION, num_warps=c["warps"])
    return y


def split_k(tiles: int, k: int, bk: int) -> tuple[int, int]:
    """(parts, reduction length per part): enough programs to reach PROGRAMS, each at least two BK steps long."""
    want = max(1, min(PROGRAMS // max(1, tiles), _cdiv(k, 2 * bk)))
    per = _cdiv(_cdiv(k, want), bk) * bk
    return _cdiv(k, per), per


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _counters(site: Optional[dict], device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed per-tile counters that the kernel leaves zeroed, one buffer per call site (a layer of a planned
    forward) and tile count, made at its first call (the warm-up before capture); without a site, new ones.

    Not shared between layers or models: no two kernels, of one graph or of two, ever count in the same buffer.
    """
    if site is None:
        return torch.zeros(tiles, device=device, dtype=torch.int32)
    if tiles not in site:
        site[tiles] = torch.zeros(tiles, device=device, dtype=torch.int32)
    return site[tiles]


def _backward(g: torch.Tensor, y: Optional[torch.Tensor], x: torch.Tensor, w: torch.Tensor, has_bias: bool, in_relu: bool, want_x: bool) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]:
    k = _build()
    if g.stride(1) != 1:
        g = g.contiguous()
    m, kin = x.shape
    n = w.shape[0]
    gw = torch.empty_like(w)
    gb = torch.empty((n,), device=w.device, dtype=w.dtype) if has_bias else None
    gx = torch.empty((m, kin), device=x.device, dtype=x.dtype) if want_x else None
    cw, cx = BWD_W, BWD_X
    tiles_k = k["cdiv"](kin, cw["BK"])
    tiles_w = k["cdiv"](n, cw["BN"]) * tiles_k
    xtiles_k = k["cdiv"](kin, cx["BK"])
    tiles_x = k["cdiv"](m, cx["BM"]) * xtiles_k if want_x else 0
    k["bwd"][(tiles_w + tiles_x,)](
        g, y if y is not None else g, x, w, gx if gx is not None else gw, gw, gb if gb is not None else gw,
        m, n, kin, g.stride(0), x.stride(0), w.stride(0), tiles_k, tiles_w, xtiles_k,
        RELU=y is not None, IN_RELU=in_relu, HAS_BIAS=has_bias, WANT_X=want_x,
        WN=cw["BN"], WK=cw["BK"], WM=cw["BM"], XM=cx["BM"], XK=cx["BK"], XN=cx["BN"], PREC=PRECISION, num_warps=max(cw["warps"], cx["warps"]),
    )
    return gx, gw, gb


class _LinearAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], relu: bool, in_relu: bool, site: Optional[dict] = None) -> torch.Tensor:  # type: ignore[override]
        y = _forward(x, w, b, relu, site)
        ctx.save_for_backward(x, w, y if relu else None)
        ctx.flags = (b is not None, in_relu)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w, y = ctx.saved_tensors
        has_bias, in_relu = ctx.flags
        gx, gw, gb = _backward(g, y, x, w, has_bias, in_relu, want_x=ctx.needs_input_grad[0])
        return gx, gw, gb, None, None, None


def linear(x: torch.Tensor, layer: nn.Linear, relu: bool = False, in_relu: bool = False, site: Optional[dict] = None) -> torch.Tensor:
    """`relu(layer(x))` (or `layer(x)`), fused; `in_relu` when x is a ReLU's output, whose mask backward then applies.

    Falls back to torch's ops for inputs the kernels are not for (not 2-D fp32 CUDA, too many rows).
    """
    if not fits(x, layer):
        y = nn.functional.linear(x, layer.weight, layer.bias)
        return torch.relu(y) if relu else y
    if x.stride(1) != 1:
        x = x.contiguous()
    return _LinearAct.apply(x, layer.weight, layer.bias, relu, in_relu, site)


def fits(x: torch.Tensor, layer: nn.Linear) -> bool:
    w = layer.weight
    return (x.dim() == 2 and x.is_cuda and x.dtype == torch.float32 and w.dtype == torch.float32 and w.is_contiguous()
            and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1] and torch.is_grad_enabled()
            and (layer.bias is None or layer.bias.dtype == torch.float32))


def why_not(model: nn.Module, device: torch.device, precision: str, graphs: bool, compiled: bool, batch_size: int) -> Optional[str]:
    """None when `plan` can fuse this model's layers; else why not (for the run's notes).

    An empty string means there is nothing to say (no Linear layers to fuse, not CUDA): the
    note is for runs where a user would expect the fused layers and does not get them.
    """
    if device.type != "cuda" or not isinstance(model, nn.Sequential) or not any(type(m) is nn.Linear for m in model):
        return ""
    if type(model).forward is not nn.Sequential.forward:  # a subclass with its own forward: the plan would skip it
        return ""
    if precision != "fp32":
        return f"precision {precision} (the fused layers are exact fp32)"
    if not graphs:
        return "CUDA graphs are off (each Triton launch from Python costs more than the kernel saves)"
    if compiled:
        return "compile is on"
    if batch_size > MAX_ROWS:
        return f"batch {batch_size} is above {MAX_ROWS} rows, where cuBLAS fills the GPU"
    if any(hooked(m) for m in model.modules()):
        return "the model has module hooks, which a fused forward would skip"
    if any(p.dtype != torch.float32 or not p.requires_grad for p in model.parameters()):
        return "a parameter is not trainable fp32"
    try:
        import triton  # noqa: F401
    except Exception as e:  # pragma: no cover - CUDA torch ships triton
        return f"triton is not importable ({type(e).__name__})"
    return None


class Mismatch(RuntimeError):
    """The fused kernels disagreed with torch's on this GPU: the run uses torch's (said in its notes)."""


class Planned:
    """The fused forward for one model, and the check that its kernels compute what torch's do.

    Its layers' split-K counters (each step's `site`) are device memory that captured graphs write: whoever
    holds graphs captured through this plan holds the plan too (GraphTrainer keeps it as long as
    its graphs), so the counters are never freed and reused while a graph can still replay.
    """

    def __init__(self, model: nn.Sequential) -> None:
        self.layers: list[tuple[nn.Linear, bool, bool]] = []  # (layer, ReLU after it, its input a ReLU's output)
        self.steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.checked: set[int] = set()
        mods = list(model)
        i, after = 0, False  # after: the next module's input is a ReLU's output (a Flatten passes that on)
        while i < len(mods):
            m = mods[i]
            if type(m) is nn.Linear:
                relu = i + 1 < len(mods) and type(mods[i + 1]) is nn.ReLU
                self.layers.append((m, relu, after))
                site: dict = {}  # this layer's split-K counters, held by its step
                self.steps.append(functools.partial(linear, layer=m, relu=relu, in_relu=after, site=site))
                after = relu
                i += 2 if relu else 1
            else:
                after = type(m) is nn.ReLU or (after and type(m) is nn.Flatten)
                self.steps.append(m)
                i += 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x

    def check(self, rows: int, tolerance: float = 1e-4) -> None:
        """Each fused layer at `rows` rows against torch's ops on the same random inputs; raises Mismatch.

        Why: MPS has shown silent wrong answers, and a kernel written here could too on a GPU it was
        not measured on. Once per batch size, before capture, with a private generator (the run's
        random streams are untouched) and on copies (the model's gradients are untouched).
        """
        if rows in self.checked or rows > MAX_ROWS:
            return
        for i, (layer, relu, in_relu) in enumerate(self.layers):
            w = layer.weight.detach().clone().requires_grad_()
            b = layer.bias.detach().clone().requires_grad_() if layer.bias is not None else None
            gen = torch.Generator(device=w.device).manual_seed(i)
            x = torch.randn((rows, w.shape[1]), device=w.device, generator=gen)
            x = (torch.relu(x) if in_relu else x).requires_grad_()
            with torch.enable_grad():
                got = _LinearAct.apply(x, w, b, relu, in_relu)
                want = nn.functional.linear(x, w, b)
                want = torch.relu(want) if relu else want
                g = torch.randn(got.shape, device=w.device, generator=gen)
                grads = vjp(got, [t for t in (x, w, b) if t is not None], g)
                refs = vjp(want, [t for t in (x, w, b) if t is not None], g)
            if in_relu:
                refs = (torch.where(x > 0, refs[0], 0.0), *refs[1:])  # the fused input gradient carries the ReLU's mask
            for what, a, r in zip(("output", "input gradient", "weight gradient", "bias gradient"), (got, *grads), (want, *refs)):
                err = ((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
                if not err <= tolerance:
                    raise Mismatch(f"layer {i + 1} ({w.shape[1]}->{w.shape[0]}, {rows} rows): {what} differs from torch's by {err:.1e} (relative)")
        self.checked.add(rows)


def plan(model: nn.Sequential) -> Planned:
    """A forward for `model` (checked by `why_not`) that runs each Linear, and a ReLU after it, as one fused layer."""
    return Planned(model)
