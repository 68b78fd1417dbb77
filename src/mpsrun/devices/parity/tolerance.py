"""How parity judges a difference: tolerances, floors per precision, and the one `Diff`.

See `mpsrun.devices.parity.run` for the reasoning behind the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

NOISE_FACTOR = 4.0
QUANTITIES = ("loss", "grad_norm", "logits", "params")


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    noise_factor: float = NOISE_FACTOR
    caps: dict[str, float] = field(default_factory=dict)  # quantity -> NOISE_CAPS; empty: no cap


FLOORS = {  # precision -> (atol, rtol); see the module docstring
    "fp32": (1e-6, 1e-3),
    "bf16": (1e-5, 1e-2),
    "fp16": (1e-5, 2e-3),
}


# The most yardstick noise the precision can explain, per quantity (relative, like the
# differences). Why a cap: the yardstick is itself a replica of the same model, so a model
# (or device A) that computes wrongly makes the yardstick disagree with A, and an uncapped
# allowance (noise_factor x noise) would grow to fit the error: a model whose later copies
# computed 5% differently "agreed". Widening stops at the cap, and a yardstick further
# from A than the cap means A itself is off: a divergence ("A suspect").
# fp32 (fp64 yardstick, CPU, benchmarks/parity_calibrate.py): loss and logits <= 2e-7 and
# the gradient norm <= 4e-6 over 20 steps, the gradient norm 9e-5 over 200, the weights
# 8e-4 of their update; the caps sit 10-500x above that. bf16 (fp32 yardstick): up to 4e-3
# (loss), 0.12 (logits), 0.35 (weights' update) with Adam after 20 steps; caps ~4x that.
# fp16 (fp32 yardstick, CPU autocast, digits/Adam, 20 steps): loss 1.1e-3, gradient norm
# 1.2e-2, logits 2.4e-2, weights 5.3e-2. On the H100 (benchmarks/parity_gpu.sh, A and B
# on cuda, digits/Adam, 200 steps) low precision drifts much further: bf16 loss 0.14,
# gradient norm 0.20, logits 0.12, weights 0.36; fp16 loss 5.1e-2, gradient norm 8.7e-2,
# logits 2.0e-2, weights 0.11 (docs/benchmarks.md). The bf16/fp16 caps sit ~3x above
# those: low precision over many Adam steps is chaotic, and only fp32 can catch a
# difference of a few percent (its caps stay tight).
NOISE_CAPS = {
    "fp32": {"loss": 1e-4, "grad_norm": 1e-3, "logits": 1e-4, "params": 2e-2},
    "bf16": {"loss": 4e-1, "grad_norm": 6e-1, "logits": 5e-1, "params": 1.5},
    "fp16": {"loss": 1.5e-1, "grad_norm": 3e-1, "logits": 2e-1, "params": 5e-1},
}


def _host(t: torch.Tensor) -> torch.Tensor:
    """To the CPU first, then float64: MPS has no float64, so the order matters."""
    return t.detach().cpu().to(torch.float64)



@dataclass(kw_only=True)
class Diff:
    """How far a result is from its reference; the one difference type of canaries and parity.

    Canaries fill `limit` (an absolute limit, atol + rtol * max|ref|); parity fills
    `noise` and `allowed` (the yardstick's measured relative noise and the relative
    difference it allows). Either way `ratio` above 1 means out of tolerance.
    """

    abs: float  # largest absolute difference
    rel: float  # relative difference (canary: max-norm; parity: ||B - A|| / ||A||)
    ratio: float = 0.0  # how much of the tolerance is used: above 1 means out of tolerance
    limit: float = 0.0  # canary: the absolute limit atol + rtol * max|ref|
    noise: float = 0.0  # parity: the yardstick's relative difference from A (running max); 0 without one
    allowed: float = 0.0  # parity: allowed relative difference, max(rtol, noise_factor * min(noise, cap))
    note: str = ""
    suspect: bool = False  # parity: the yardstick disagrees with A beyond the noise cap (A is off)

    @property
    def exceeded(self) -> bool:
        return not self.ratio <= 1.0  # NaN counts as exceeded

    @staticmethod
    def worst(diffs: Sequence["Diff"]) -> "Diff":
        """The largest of each measure, with the tolerance of the one that used most of its own."""
        if not diffs:
            return Diff(abs=0.0, rel=0.0)
        top = max(diffs, key=lambda d: d.ratio if not math.isnan(d.ratio) else math.inf)
        return Diff(
            abs=max(d.abs for d in diffs),
            rel=max(d.rel for d in diffs),
            ratio=top.ratio,
            limit=top.limit,
            noise=max(d.noise for d in diffs),
            allowed=top.allowed,
            note="; ".join(sorted({d.note for d in diffs if d.note})),
            suspect=any(d.suspect for d in diffs),
        )


def _flat64(x: Any) -> torch.Tensor:
    if not torch.is_tensor(x):
        return torch.as_tensor(x, dtype=torch.float64).flatten()  # as_tensor(2.3) would round to fp32
    return _host(x).flatten()


def _pair(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor, str, torch.Tensor] | None:
    """Float64 CPU copies with agreeing non-finite positions removed (and the mask kept); None if they disagree."""
    a, b = _flat64(a), _flat64(b)
    if a.shape != b.shape:
        return None
    same = (a.isnan() & b.isnan()) | (a.isinf() & (a == b))
    finite = a.isfinite() & b.isfinite()
    if not bool((finite | same).all()):
        return None
    note = f"{int(same.sum())} non-finite value(s) on both devices" if bool(same.any()) else ""
    return a[finite], b[finite], note, finite


def relative(value: Any, ref: Any, start: Any = None) -> float:
    """||value - ref|| / ||ref - start|| (start: zero unless given); inf when shapes or non-finite values disagree."""
    p = _pair(ref, value)
    if p is None:
        return math.inf
    a, b, _, keep = p
    d = float(torch.linalg.vector_norm(b - a))
    n = float(torch.linalg.vector_norm(a if start is None else a - _flat64(start)[keep]))
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


def diff(value: Any, ref: Any, tol: Tolerance, noise: float = 0.0, start: Any = None, quantity: str = "") -> Diff:
    """Compare `value` (device B) with `ref` (device A), allowing for the measured noise.

    With `start` (the weights before training) the relative difference is taken
    against the update ref - start rather than against ref itself. With `quantity`
    named in `tol.caps`, the noise widens the tolerance only up to its cap, and noise
    beyond the cap is itself a divergence: A disagrees with the higher-precision yardstick.
    """
    cap = tol.caps.get(quantity, math.inf)
    allowed = max(tol.rtol, tol.noise_factor * min(noise, cap))
    suspect = noise > cap
    why = f"A suspect: the yardstick differs from A by {noise:.2g}, beyond the {cap:g} its precision explains" if suspect else ""
    p = _pair(ref, value)
    if p is None:
        inf = math.inf
        note = "; ".join(x for x in ("shape or non-finite values differ", why) if x)
        return Diff(abs=inf, rel=inf, ratio=inf, noise=noise, allowed=allowed, note=note, suspect=suspect)
    a, b, note, _ = p
    dmax = float((b - a).abs().max()) if a.numel() else 0.0
    rel = relative(b, a) if start is None else relative(value, ref, start)
    by_abs = dmax / tol.atol if tol.atol > 0 else (0.0 if dmax == 0 else math.inf)
    by_rel = rel / allowed if allowed > 0 else (0.0 if rel == 0 else math.inf)
    ratio = min(by_abs, by_rel)
    if suspect:  # out of tolerance whatever B did: the reference itself is off
        ratio = max(ratio if not math.isnan(ratio) else math.inf, noise / cap)
    return Diff(abs=dmax, rel=rel, ratio=ratio, noise=noise, allowed=allowed, note="; ".join(x for x in (note, why) if x), suspect=suspect)
