"""SGD's update for stacked members as one Triton kernel a parameter (CUDA fused groups).

Why: optim.FusedOptimizer's device path runs SGD as torch's in-place ops with each member's hyperparameters as
a [M, 1, ...] tensor: a broadcast op can not take torch's vectorised kernels, and momentum takes three passes over
the parameter, its gradient and its buffer (`buf.mul_`, `buf.addcmul_`, `p.addcmul_`). On an H200, 16 small-CNN
members in bf16: 50-80 ms of a 543 ms epoch's GPU time. Here one pass reads p, g and buf and writes p and buf;
each element finds its member's hyperparameters by its index (a member's values are contiguous in the stack).

The formula is `_sgd_device`'s, op for op in fp32: g += wd * p; buf = mom * buf + damp1 * g (damp1 = 1 at the
first step where dampening is set); the update is nesterov's g + mom * buf, or buf, or g without momentum; p -= lr *
update. Checked against those torch ops once per shape, outside any capture (kernels/checked.py); a mismatch or a
kernel Triton cannot build leaves the group on torch's ops, said once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from mpsrun.sweep.fused.kernels.checked import Checked

BLOCK = 1024
_kernels: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def sgd_k(p_ptr, g_ptr, buf_ptr, lr_ptr, wd_ptr, mom_ptr, damp1_ptr, has_mom_ptr, nest_ptr, step_ptr, N, PER,
              WD: tl.constexpr, MOM: tl.constexpr, DAMP: tl.constexpr, NEST: tl.constexpr, SOME: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        m = offs // PER
        p = tl.load(p_ptr + offs, mask=ok, other=0.0)
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if WD:
            g = g + p * tl.load(wd_ptr + m, mask=ok, other=0.0)
        upd = g
        if MOM:
            mom = tl.load(mom_ptr + m, mask=ok, other=0.0)
            d1 = tl.load(damp1_ptr + m, mask=ok, other=1.0)
            if DAMP:
                d1 = tl.where(tl.load(step_ptr) == 1.0, 1.0, d1)
            b = tl.load(buf_ptr + offs, mask=ok, other=0.0) * mom + g * d1
            tl.store(buf_ptr + offs, b, mask=ok)
            upd = b
            if NEST:
                upd = tl.where(tl.load(nest_ptr + m, mask=ok, other=0) != 0, g + b * mom, b)
            if SOME:
                upd = tl.where(tl.load(has_mom_ptr + m, mask=ok, other=0) != 0, upd, g)
        tl.store(p_ptr + offs, p - tl.load(lr_ptr + m, mask=ok, other=0.0) * upd, mask=ok)

    _kernels.update(sgd=sgd_k, cdiv=triton.cdiv)
    return _kernels


def step(opt: Any, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None) -> None:
    """One member-stacked parameter's update in place (p, buf); `opt`: the FusedOptimizer whose tensors it reads."""
    k = _build()
    n = p.numel()
    mom = buf is not None
    k["sgd"][(k["cdiv"](n, BLOCK),)](p, g, buf if mom else p, opt.lr, opt.wd, opt.mom, opt.damp1, opt.has_mom8, opt.nesterov8, opt.step_t,
                                     n, n // p.shape[0], WD=opt.any_wd, MOM=mom, DAMP=opt.any_damp, NEST=opt.any_nesterov,
                                     SOME=not opt.all_mom, BLOCK=BLOCK, num_warps=4)


def fits(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """fp32 contiguous parameters and buffers (as the fused group keeps them), gradients contiguous, 32-bit offsets."""
    return (p.is_cuda and p.dtype == torch.float32 and p.is_contiguous() and g.is_contiguous() and g.shape == p.shape
            and (buf is None or (buf.is_contiguous() and buf.dtype == torch.float32)) and p.numel() < 2**31)


class Mismatch(RuntimeError):
    """The kernel disagreed with torch's ops: the group keeps torch's (said)."""


class Sgd(Checked):
    """Whether a parameter's update takes the kernel: its shape checked once against `reference` (the torch ops)."""

    fallback = "optimizer: SGD's update as torch's ops for this group, not the fused Triton kernel"
    mismatch = (Mismatch,)
    together = False

    def __init__(self, say: Callable[[str], None], reference: Callable[..., None]) -> None:
        super().__init__(say)
        self.reference = reference

    def expect(self, opt: Any) -> None:
        """Under `checked.discovering`: every parameter's check pending, to run beside the others' (a forward alone
        does not reach the update)."""
        if opt.params:
            p = opt.params[0]
            self.use(opt, p, p, torch.zeros_like(p) if opt.any_mom else None)

    def use(self, opt: Any, p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor | None) -> bool:
        if self.off is not None or not fits(p, g, buf):
            return False
        # one check a variant of the kernel, not a shape: an elementwise update whose sizes are arguments
        key = (g.dtype, buf is not None, opt.any_wd, opt.any_damp, opt.any_nesterov, opt.all_mom)
        shape, gtype, mom = p, g.dtype, buf is not None
        return self.ready(key, lambda: check(opt, shape, gtype, mom, self.reference), True)


def check(opt: Any, like: torch.Tensor, gtype: torch.dtype, mom: bool, reference: Callable[..., None]) -> None:
    """The kernel and the torch ops on random tensors shaped as `like` (the run's hyperparameters); raises Mismatch
    past fp32 rounding of a few operations. Nothing of the run's tensors is read or written."""
    gen = torch.Generator(device=like.device).manual_seed(0)
    rnd = lambda dtype: torch.randn(like.shape, device=like.device, generator=gen).to(dtype)  # noqa: E731
    p1, g1 = rnd(torch.float32), rnd(gtype)
    b1 = rnd(torch.float32) if mom else None
    p2, g2, b2 = p1.clone(), g1.clone(), (b1.clone() if b1 is not None else None)
    step(opt, p1, g1, b1)
    reference(p2, g2, b2)
    for what, a, r in (("parameter", p1, p2), ("momentum buffer", b1, b2)):
        if a is None or r is None:
            continue
        err = float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))
        if not err <= 1e-5:  # a NaN fails too
            raise Mismatch(f"SGD {tuple(like.shape)}: the {what} is {err:.2g} from torch's (relative to its largest)")
