"""What a parity check found: per-step records, per-quantity summaries, the verdict,
and the metrics they become in MLflow."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field

from mpsrun.devices.parity.tolerance import Diff, Tolerance
from mpsrun.track.store import client as tracking


@dataclass
class StepRecord:
    """One training step on both devices; step 0 is the probe before any training."""

    step: int
    loss: tuple[float, float] | None = None
    grad_norm: tuple[float, float] | None = None
    diffs: dict[str, Diff] = field(default_factory=dict)
    argmax_agreement: float | None = 1.0  # share of probe samples whose predicted class agrees; None: regression

    def exceeded(self) -> list[str]:
        return [q for q, d in self.diffs.items() if d.exceeded]


@dataclass
class Summary:
    """One quantity over the whole check."""

    max_abs: float
    max_rel: float
    max_noise: float
    max_ratio: float
    first_step: int | None  # first step where the tolerance was exceeded


@dataclass
class ParityResult:
    recipe: str
    devices: tuple[str, str]
    precision: str
    steps: int
    tolerance: Tolerance
    records: list[StepRecord]
    params: Diff  # every parameter tensor after the last step, the worst one
    worst_param: str
    notes: list[str]
    yardstick: str  # e.g. "cpu fp64", or "none"
    run: tracking.RunInfo | None = None
    task: str = "classification"  # regression: "logits" are the probe's predictions (standardised target)

    def label(self, quantity: str) -> str:
        """What a quantity is called on screen: a regression model's outputs are predictions, not logits."""
        return "outputs" if quantity == "logits" and self.task == "regression" else quantity

    def summary(self) -> dict[str, Summary]:
        out = {}
        for q in ("loss", "grad_norm", "logits"):
            diffs = [(r.step, r.diffs[q]) for r in self.records if q in r.diffs]
            first = next((s for s, d in diffs if d.exceeded), None)
            w = Diff.worst([d for _, d in diffs])
            out[q] = Summary(w.abs, w.rel, w.noise, w.ratio, first)
        p = self.params
        out["params"] = Summary(p.abs, p.rel, p.noise, p.ratio, self.steps if p.exceeded else None)
        return out

    @property
    def first_divergence(self) -> tuple[int, list[str]] | None:
        """(step, quantities out of tolerance at that step), or None when all agree."""
        for r in self.records:
            if r.exceeded():
                return r.step, r.exceeded()
        if self.params.exceeded:
            return self.steps, ["params"]
        return None

    @property
    def a_suspect(self) -> bool:
        """At the first divergence, the yardstick disagreed with A beyond what the precision explains."""
        fd = self.first_divergence
        if fd is None:
            return False
        step, qs = fd
        if qs == ["params"] and not any(r.exceeded() for r in self.records):
            return self.params.suspect
        rec = next(r for r in self.records if r.step == step)
        return any(rec.diffs[q].suspect for q in qs)

    @property
    def verdict(self) -> str:
        return "agree" if self.first_divergence is None else "diverge"

    def divergence_text(self) -> str:
        fd = self.first_divergence
        if fd is None:
            return "none"
        step, qs = fd
        where = "step 0 (initial weights)" if step == 0 else f"step {step}"
        suspect = f" (A suspect: the {self.yardstick} yardstick disagrees with {self.devices[0]})" if self.a_suspect else ""
        return f"{where}: {', '.join(qs)}{suspect}"

    def as_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "devices": list(self.devices),
            "precision": self.precision,
            "task": self.task,
            "steps": self.steps,
            "tolerance": asdict(self.tolerance),
            "yardstick": self.yardstick,
            "verdict": self.verdict,
            "a_suspect": self.a_suspect,
            "first_divergence": self.divergence_text(),
            "summary": {q: asdict(s) for q, s in self.summary().items()},
            "params": asdict(self.params),
            "worst_param": self.worst_param,
            "notes": self.notes,
            "records": [
                {
                    "step": r.step,
                    "loss": r.loss,
                    "grad_norm": r.grad_norm,
                    "argmax_agreement": r.argmax_agreement,
                    "diffs": {q: asdict(d) for q, d in r.diffs.items()},
                }
                for r in self.records
            ],
        }


def _step_metrics(rec: StepRecord) -> dict[str, float]:
    m: dict[str, float] = {}
    if rec.loss is not None:
        m["loss_a"], m["loss_b"] = rec.loss
    if rec.grad_norm is not None:
        m["grad_norm_a"], m["grad_norm_b"] = rec.grad_norm
    for q, d in rec.diffs.items():
        m[f"{q}_abs_diff"] = d.abs
        m[f"{q}_rel_diff"] = d.rel
        m[f"{q}_noise_rel"] = d.noise
        m[f"{q}_tol_ratio"] = d.ratio
    if rec.argmax_agreement is not None:
        m["probe_argmax_agreement"] = rec.argmax_agreement
    return {k: _finite(v) for k, v in m.items()}


def _finite(v: float) -> float:
    """MLflow stores metrics as floats; clamp infinities to the largest float."""
    if math.isnan(v):
        return v
    return max(min(v, sys.float_info.max), -sys.float_info.max)
