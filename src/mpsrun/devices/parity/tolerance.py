"""How parity judges a difference: tolerances, floors per precision, and the one `Diff`.

See `mpsrun.devices.parity.run` for the reasoning behind the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

NOISE_FACTOR = 4.0
QUANTITIES = ("loss", "grad_norm", "logits", "params")


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    noise_factor: float = NOISE_FACTOR


FLOORS = {  # precision -> (atol, rtol); see the module docstring
    "fp32": (1e-6, 1e-3),
    "bf16": (1e-5, 1e-2),
    "fp16": (1e-5, 2e-3),
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
    allowed: float = 0.0  # parity: allowed relative difference, max(rtol, noise_factor * noise)
    note: str = ""

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


def diff(value: Any, ref: Any, tol: Tolerance, noise: float = 0.0, start: Any = None) -> Diff:
    """Compare `value` (device B) with `ref` (device A), allowing for the measured noise.

    With `start` (the weights before training) the relative difference is taken
    against the update ref - start rather than against ref itself.
    """
    allowed = max(tol.rtol, tol.noise_factor * noise)
    p = _pair(ref, value)
    if p is None:
        inf = math.inf
        return Diff(abs=inf, rel=inf, ratio=inf, noise=noise, allowed=allowed, note="shape or non-finite values differ")
    a, b, note, _ = p
    dmax = float((b - a).abs().max()) if a.numel() else 0.0
    rel = relative(b, a) if start is None else relative(value, ref, start)
    by_abs = dmax / tol.atol if tol.atol > 0 else (0.0 if dmax == 0 else math.inf)
    by_rel = rel / allowed if allowed > 0 else (0.0 if rel == 0 else math.inf)
    return Diff(abs=dmax, rel=rel, ratio=min(by_abs, by_rel), noise=noise, allowed=allowed, note=note)
