"""The Triton kernel behind train/controls/clipping.py's clip (imported only where it runs).

Apart from clipping.py because importing triton costs time and does not exist on every
machine (Macs): this module is imported only when a CUDA run clips. Triton resolves a
kernel's helpers from its module's globals, so they live at the top level here.

One launch per 8 gradients. Every program writes its partial sum of squares, then
takes a ticket from a counter; the program holding the last ticket of the last launch
adds the partials up in a fixed order (so a replay gives the same bits), writes the
norm's running max and 1/scale, and resets the counter for the next step. One kernel
instead of two: in a graphed step of a small model each kernel costs about 4 us.
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


@triton.jit(do_not_specialize=["base", "n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"])
def clip_norm(
    partials, counter, peak, inv, max_norm, base,
    g0, n0, g1, n1, g2, n2, g3, n3, g4, n4, g5, n5, g6, n6, g7, n7,
    TOTAL: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr,
):  # pragma: no cover - CUDA
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
    tl.store(partials + base + pid, tl.sum(acc, axis=0))
    ticket = tl.atomic_add(counter, 1, sem="acq_rel")  # release: this program's partial is written
    if ticket == TOTAL - 1:  # the last program of the step: every partial is written
        offs = tl.arange(0, PBLOCK)
        sq = tl.load(partials + offs, mask=offs < TOTAL, other=0.0, cache_modifier=".cg")
        total = tl.sqrt(tl.sum(sq, axis=0))
        tl.store(peak, tl.maximum(tl.load(peak), total))
        tl.store(inv, 1.0 / tl.maximum(total / max_norm, 1.0))
        tl.atomic_xchg(counter, 0)  # ready for the next step


# --- Clip and SGD in one kernel (train/controls/clip_sgd.py) ---------------------------------------
# Gradient clipping needs the global norm before any parameter may move, so clip + SGD is
# two passes over the gradients with a grid-wide wait between them. MODE 0 does both in
# one launch: every program adds its squares, arrives at a counter, spins until all have
# arrived (the grid is at most one program per SM, so all are resident at once), reads
# the partials in a fixed order (every program gets the same norm, bit for bit) and
# updates its blocks. MODE 1 (norm) and MODE 2 (update) split it into two launches for
# Triton's CPU interpreter, which runs programs one after another, and for comparison.
# Blocks are dealt round-robin across all tensors (`first` of each slot), so no program
# walks more than ceil(blocks / programs) of them in a pass.


@triton.jit
def slot_squares(acc, g, n, first, P: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover - CUDA
    for start in range(first * BLOCK, n, P * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(g + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
    return acc


@triton.jit
def slot_update(
    p, g, buf, n, first, inv, lr, momentum, weight_decay,
    P: tl.constexpr, BLOCK: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
):  # pragma: no cover - CUDA
    # torch's SGD after torch's clip: d = g * coef; maximize; weight decay; momentum (dampening 0); p -= lr * d
    for start in range(first * BLOCK, n, P * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        d = tl.load(g + offs, mask=mask, other=0.0) * inv
        if MAXIMIZE:
            d = -d
        w = tl.load(p + offs, mask=mask, other=0.0)
        if HAS_WD:
            d += weight_decay * w
        if HAS_MOMENTUM:
            b = tl.load(buf + offs, mask=mask, other=0.0) * momentum + d
            tl.store(buf + offs, b, mask=mask)
            if NESTEROV:
                d = d + momentum * b
            else:
                d = b
        tl.store(p + offs, w - lr * d, mask=mask)


@triton.jit
def norm_scale(partials, peak, inv_out, max_norm, write, P: tl.constexpr, PBLOCK: tl.constexpr):  # pragma: no cover - CUDA
    # the norm from the partials in a fixed order, and the clip's scale min(max_norm / norm, 1)
    offs = tl.arange(0, PBLOCK)
    sq = tl.load(partials + offs, mask=offs < P, other=0.0, cache_modifier=".cg")
    total = tl.sqrt(tl.sum(sq, axis=0))
    inv = 1.0 / tl.maximum(total / max_norm, 1.0)
    if write:
        tl.store(peak, tl.maximum(tl.load(peak), total))
        tl.store(inv_out, inv)
    return inv


@triton.jit
def first_block(pid, r, P: tl.constexpr):  # pragma: no cover - CUDA
    # this program's first block of a slot whose blocks start at program r (r = blocks before it, mod P)
    return (pid + P - r) % P


@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7", "r1", "r2", "r3", "r4", "r5", "r6", "r7"])
def clip_sgd(
    partials, counters, peak, inv_out, max_norm, lr_ptr, lr, momentum, weight_decay,
    p0, g0, b0, n0, p1, g1, b1, n1, p2, g2, b2, n2, p3, g3, b3, n3,
    p4, g4, b4, n4, p5, g5, b5, n5, p6, g6, b6, n6, p7, g7, b7, n7,
    r1, r2, r3, r4, r5, r6, r7,
    P: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr, MODE: tl.constexpr, LR_PTR: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_WD: tl.constexpr,
):  # pragma: no cover - CUDA
    pid = tl.program_id(0)
    if MODE != 2:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc = slot_squares(acc, g0, n0, pid, P, BLOCK)
        acc = slot_squares(acc, g1, n1, first_block(pid, r1, P), P, BLOCK)
        acc = slot_squares(acc, g2, n2, first_block(pid, r2, P), P, BLOCK)
        acc = slot_squares(acc, g3, n3, first_block(pid, r3, P), P, BLOCK)
        acc = slot_squares(acc, g4, n4, first_block(pid, r4, P), P, BLOCK)
        acc = slot_squares(acc, g5, n5, first_block(pid, r5, P), P, BLOCK)
        acc = slot_squares(acc, g6, n6, first_block(pid, r6, P), P, BLOCK)
        acc = slot_squares(acc, g7, n7, first_block(pid, r7, P), P, BLOCK)
        tl.store(partials + pid, tl.sum(acc, axis=0))
        arrived = tl.atomic_add(counters, 1, sem="acq_rel")  # release: this program's partial is written
        if MODE == 0:
            while arrived < P:  # the grid-wide wait: every partial written
                arrived = tl.atomic_add(counters, 0, sem="acquire")
            inv = norm_scale(partials, peak, inv_out, max_norm, pid == 0, P, PBLOCK)
            left = tl.atomic_add(counters + 1, 1, sem="relaxed")  # departures: each is past the wait
            if left == P - 1:  # the last one out: nobody spins any more; ready for the next step
                tl.atomic_xchg(counters, 0)
                tl.atomic_xchg(counters + 1, 0)
        else:
            if arrived == P - 1:  # the last program of the norm: every partial written
                norm_scale(partials, peak, inv_out, max_norm, True, P, PBLOCK)
                tl.atomic_xchg(counters, 0)
    if MODE != 1:
        if MODE == 2:
            inv = tl.load(inv_out)
        if LR_PTR:
            rate = tl.load(lr_ptr)
        else:
            rate = lr
        slot_update(p0, g0, b0, n0, pid, inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
        slot_update(p1, g1, b1, n1, first_block(pid, r1, P), inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
        slot_update(p2, g2, b2, n2, first_block(pid, r2, P), inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
        slot_update(p3, g3, b3, n3, first_block(pid, r3, P), inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
        slot_update(p4, g4, b4, n4, first_block(pid, r4, P), inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
        slot_update(p5, g5, b5, n5, first_block(pid, r5, P), inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
        slot_update(p6, g6, b6, n6, first_block(pid, r6, P), inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
        slot_update(p7, g7, b7, n7, first_block(pid, r7, P), inv, rate, momentum, weight_decay, P, BLOCK, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_WD)
