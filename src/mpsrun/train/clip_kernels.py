"""The Triton kernels behind train/clipping.py's two-stage clip (imported only where they run).

Apart from clipping.py because importing triton costs time and does not exist on every
machine (Macs): this module is imported only when a CUDA run clips. Triton resolves a
kernel's helpers from its module's globals, so they live at the top level here.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_squares(acc, g, n, pid, step, BLOCK: tl.constexpr):  # pragma: no cover - CUDA
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(g + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
    return acc


@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"])
def sumsq(out, g0, n0, g1, n1, g2, n2, g3, n3, g4, n4, g5, n5, g6, n6, g7, n7, BLOCK: tl.constexpr):  # pragma: no cover - CUDA
    """Each program's partial sum of squares over up to 8 gradients (grid-stride; fixed order)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc = add_squares(acc, g0, n0, pid, step, BLOCK)
    acc = add_squares(acc, g1, n1, pid, step, BLOCK)
    acc = add_squares(acc, g2, n2, pid, step, BLOCK)
    acc = add_squares(acc, g3, n3, pid, step, BLOCK)
    acc = add_squares(acc, g4, n4, pid, step, BLOCK)
    acc = add_squares(acc, g5, n5, pid, step, BLOCK)
    acc = add_squares(acc, g6, n6, pid, step, BLOCK)
    acc = add_squares(acc, g7, n7, pid, step, BLOCK)
    tl.store(out + pid, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["n"])
def finalize(partials, n, peak, scale, inv, max_norm, BLOCK: tl.constexpr):  # pragma: no cover - CUDA
    """One program: the norm from the partial sums, the running max, the clip scale and its inverse."""
    offs = tl.arange(0, BLOCK)
    total = tl.sqrt(tl.sum(tl.load(partials + offs, mask=offs < n, other=0.0), axis=0))
    tl.store(peak, tl.maximum(tl.load(peak), total))
    s = tl.maximum(total / max_norm, 1.0)
    tl.store(scale, s)
    tl.store(inv, 1.0 / s)
