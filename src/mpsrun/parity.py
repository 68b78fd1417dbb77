"""`mpsrun parity`: does device B compute what device A (usually the CPU) computes?

How. The model is built once, on the CPU, from the recipe through the plugins;
each device gets a deep copy of that one state, so initial weights are identical.
Batches are drawn from the dataset on the CPU in one seeded order, and the same
raw batch goes to both devices, where the dataset's transform runs (as in
training). Each device takes N training steps with the recipe's optimizer and
precision (autocast for bf16/fp16, a grad scaler for fp16), interleaved step by
step. After every step we compare the loss, the gradient norm and the logits on a
fixed probe batch (the first validation samples, eval mode; also before the first
step, with the initial weights), and after the last step every parameter.

Measured how. Per quantity and step: the largest absolute difference
max|B - A|, and the relative difference ||B - A|| / ||A|| (L2 over the tensor;
|b - a| / |a| for the loss and gradient norm), A being the first device. L2
rather than elementwise: an element that is near zero by cancellation has a
meaningless relative error, and a handful of Adam weights whose gradient is
noise (Adam's update has the size of the learning rate whatever the gradient's
size) must not outvote the whole tensor. A quantity is out of tolerance when
its absolute difference exceeds atol *and* its relative difference exceeds
the allowed relative difference (next paragraph). Dropout is switched off: the
devices' random generators differ, so their masks would too. Steps run eager (no
torch.compile, no CUDA graphs): parity checks the device's arithmetic.

Tolerances, and why. Two correct devices differ by rounding only: their kernels
add the same terms in different orders. One step's difference is tiny, but
training feeds each step's difference into the next and can amplify it: how much
depends on the precision, the optimizer, the learning rate, the step count.
A fixed tolerance is either too loose for a stable recipe or too tight for a
sensitive one. So parity measures the precision's own noise as it goes: a third
replica, the *yardstick*, trains on the CPU in higher precision (fp64 for an
fp32 check, fp32 for bf16/fp16), and the allowed relative difference at each
step is

    allowed = max(rtol, noise_factor * noise)

where noise is the yardstick's relative difference from A on that quantity
(a running maximum over the steps so far: the drift of a correct computation
grows, and so does the allowance). Two devices of one precision differ from each
other by about as much as each differs from the exact result (up to ~1.4x when
their errors are independent), so noise_factor 4 passes correct devices with
room, while a wrong answer stands out: bugs of the kind the canaries guard
(wrong argmax, lost optimizer updates, 32-bit integer sums, wrong results on
transposed tensors) are off by O(1e-2..1) from the first affected step.
Floors (rtol, atol) follow the precision: fp32 1e-3, 1e-6 (fp32 round-off is
~6e-8; the floor leaves room for kernels with other algorithms, e.g. cuDNN's
Winograd/FFT convolutions; TF32 is switched off on CUDA for the check, since
PyTorch leaves it on for cuDNN convolutions and its 10-bit mantissa would add
~1e-3 of deliberate imprecision); bf16 1e-2, 1e-5 (8 significant bits: one
rounding step is 0.4%); fp16 2e-3, 1e-5 (11 bits). The weights are compared
by what training did to them: ||B_end - A_end|| / ||A_end - start||, since the
start is shared and a plain SGD update is ~1e-4 of the weights, far below any
tolerance relative to the weights themselves.

Measured (benchmarks/parity_calibrate.py, CPU, the shipped recipes). The fp32
noise (fp64 yardstick) over 20 steps: loss and logits <= 2e-7, gradient norm
<= 4e-6, weights <= 8e-4 of the update (SGD's tiny updates show fp32's rounding
of w + update); over 200 steps the gradient norm reaches 9e-5. The bf16 noise
(fp32 yardstick) depends on the optimizer: with Adam (digits) 4e-3 on the loss,
0.12 on the logits and 0.35 on the weights' update after 20 steps; with SGD
(fashion) 2e-5, 3e-3 and 3e-2. No single bf16 number fits both; the yardstick
does. A stand-in for another correct device (the same batches with the samples
reordered, so every reduction over the batch adds in another order) stays below
0.003 of the tolerance (20 and 200 steps; in bf16 the reordering is mostly
absorbed by bf16's rounding, so there a real second device, e.g.
benchmarks/parity_gpu.sh, is the test that counts). Stand-ins for broken
devices: an optimizer update that never lands (the MPS `addcdiv_` bug's
effect) diverges at step 1 (Adam) or 3 (SGD) in fp32, and at the end, on the
weights, in bf16 with SGD; logits 1% off diverge at step 0 in fp32, while in
bf16 1% is bf16's own resolution (caught with Adam, 0.9 of the tolerance with
SGD). `--atol` / `--rtol` replace the floors; `--noise-factor 0` turns the
yardstick off (fixed tolerances, one replica less).

Exit codes (set by the CLI): 0 agree, 1 diverge (or failure), 2 bad input.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import sys
import tempfile
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import devices, runner, sysinfo, tracking
from .canary import strict_math
from .recipe import DEVICE_PATTERN, Resolved, flatten

DEFAULT_STEPS = 20
PROBE_SIZE = 128
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
# precision -> (precision, dtype) of the yardstick replica: higher precision, on the CPU
YARDSTICK = {"fp32": ("fp32", torch.float64), "bf16": ("fp32", torch.float32), "fp16": ("fp32", torch.float32)}


class ParityFailed(Exception):
    """The check itself crashed after the MLflow run started; the run is marked FAILED."""

    def __init__(self, message: str, run_id: str | None) -> None:
        super().__init__(message)
        self.run_id = run_id


# ----------------------------------------------------------------------------- differences


@dataclass
class Diff:
    """B against A for one quantity at one step (see the module docstring)."""

    abs: float  # max |B - A|
    rel: float  # ||B - A|| / ||A||
    noise: float = 0.0  # the yardstick's relative difference from A (running max); 0 without one
    allowed: float = 0.0  # allowed relative difference: max(rtol, noise_factor * noise)
    ratio: float = 0.0  # min(abs / atol, rel / allowed): above 1 means out of tolerance
    note: str = ""

    @property
    def exceeded(self) -> bool:
        return not self.ratio <= 1.0  # NaN counts as exceeded

    @staticmethod
    def worst(diffs: Sequence["Diff"]) -> "Diff":
        if not diffs:
            return Diff(0.0, 0.0)
        top = max(diffs, key=lambda d: d.ratio if not math.isnan(d.ratio) else math.inf)
        return Diff(
            max(d.abs for d in diffs),
            max(d.rel for d in diffs),
            max(d.noise for d in diffs),
            top.allowed,
            top.ratio,
            "; ".join(sorted({d.note for d in diffs if d.note})),
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
        return Diff(inf, inf, noise, allowed, inf, "shape or non-finite values differ")
    a, b, note, _ = p
    dmax = float((b - a).abs().max()) if a.numel() else 0.0
    rel = relative(b, a) if start is None else relative(value, ref, start)
    by_abs = dmax / tol.atol if tol.atol > 0 else (0.0 if dmax == 0 else math.inf)
    by_rel = rel / allowed if allowed > 0 else (0.0 if rel == 0 else math.inf)
    return Diff(dmax, rel, noise, allowed, min(by_abs, by_rel), note)


# ----------------------------------------------------------------------------- results


@dataclass
class StepRecord:
    """One training step on both devices; step 0 is the probe before any training."""

    step: int
    loss: tuple[float, float] | None = None
    grad_norm: tuple[float, float] | None = None
    diffs: dict[str, Diff] = field(default_factory=dict)
    argmax_agreement: float = 1.0  # share of probe samples whose predicted class agrees

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
    def verdict(self) -> str:
        return "agree" if self.first_divergence is None else "diverge"

    def divergence_text(self) -> str:
        fd = self.first_divergence
        if fd is None:
            return "none"
        step, qs = fd
        where = "step 0 (initial weights)" if step == 0 else f"step {step}"
        return f"{where}: {', '.join(qs)}"

    def as_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "devices": list(self.devices),
            "precision": self.precision,
            "steps": self.steps,
            "tolerance": asdict(self.tolerance),
            "yardstick": self.yardstick,
            "verdict": self.verdict,
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


# ----------------------------------------------------------------------------- replicas


class Replica:
    """One device's copy of the model and optimizer, stepped as the engine steps."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        resolved: Resolved,
        precision: str,
        channels_last: bool,
        transform: Callable[[torch.Tensor], torch.Tensor] | None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.model = copy.deepcopy(model).to(device=device, dtype=dtype)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.channels_last = channels_last
        self.optimizer = runner.build_optimizer(resolved.recipe, self.model, graphs=False)
        self.transform = transform
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        if self.transform is not None:
            x = self.transform(x)
        if x.is_floating_point() and x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One training step (as engine.Trainer.train_step); returns (loss, gradient norm)."""
        self.model.train()
        _dropout_off(self.model)
        x, y = self._input(x), y.to(self.device)
        with self._autocast():
            loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)  # the norm of the true gradient
            norm = _grad_norm(self.model)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            norm = _grad_norm(self.model)
            self.optimizer.step()
        return float(_host(loss)), float(_host(norm))

    @torch.no_grad()
    def probe(self, x: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        with self._autocast():
            out = self.model(self._input(x))
        return _host(out)

    def parameters(self) -> dict[str, torch.Tensor]:
        return {k: _host(v) for k, v in self.model.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}


def _host(t: torch.Tensor) -> torch.Tensor:
    """To the CPU first, then float64: MPS has no float64, so the order matters."""
    return t.detach().cpu().to(torch.float64)


def _dropout_off(model: nn.Module) -> None:
    """Dropout in eval mode: devices' random generators differ, so their masks would too."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()


def _grad_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]  # in the params' dtype
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def batches(ds: Dataset, batch_size: int, seed: int, steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` raw CPU batches in one seeded shuffled order, epoch after epoch as needed."""
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    if len(loader) == 0:
        return
    n = 0
    while True:
        for x, y in loader:
            yield x, y
            n += 1
            if n == steps:
                return


# ----------------------------------------------------------------------------- the check


def parse_devices(text: str) -> tuple[str, str]:
    """`cpu,cuda` -> ('cpu', 'cuda'); a bad list is an InputError (exit 2)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise runner.InputError(f"--devices takes two devices separated by a comma, e.g. cpu,cuda (got '{text}')")
    for p in parts:
        if not re.match(DEVICE_PATTERN, p):
            raise runner.InputError(f"'{p}' is not a device (expected auto, cpu, mps, cuda or cuda:N)")
    return parts[0], parts[1]


def _device(name: str) -> torch.device:
    try:
        return devices.resolve(name).device
    except devices.DeviceUnavailable as e:
        raise runner.InputError(str(e)) from None


def _precision(resolved: Resolved, device: torch.device, model: nn.Module) -> tuple[str, bool, list[str]]:
    """The engine's own choice of precision and channels_last for this device."""
    plan = types.SimpleNamespace(resident=False)  # only the graphs choice reads it; parity runs eager
    opts = runner.resolve_options(resolved.recipe, device, model, plan)  # type: ignore[arg-type]
    notes = [n for n in opts.notes if n.startswith("precision")]
    return opts.precision, opts.channels_last, notes


@dataclass
class Prepared:
    """Everything built before the first step: bad input shows up here, before any MLflow run."""

    resolved: Resolved
    devices: tuple[torch.device, torch.device]
    model: nn.Module
    splits: Any  # DataSplits
    precision: str
    channels_last: tuple[bool, bool]
    tolerance: Tolerance
    steps: int
    probe_x: torch.Tensor
    notes: list[str]


def prepare(
    resolved: Resolved,
    device_names: tuple[str, str],
    steps: int = DEFAULT_STEPS,
    atol: float | None = None,
    rtol: float | None = None,
    noise_factor: float | None = None,
) -> Prepared:
    """Devices, data, the one model, precision and tolerances; raises runner.InputError."""
    if steps < 1:
        raise runner.InputError(f"--steps must be at least 1 (got {steps})")
    for name, v in (("--atol", atol), ("--rtol", rtol), ("--noise-factor", noise_factor)):
        if v is not None and not (v >= 0 and math.isfinite(v)):
            raise runner.InputError(f"{name} must be a finite number >= 0 (got {v})")
    recipe = resolved.recipe
    devs = (_device(device_names[0]), _device(device_names[1]))
    runner.seed_everything(recipe.seed)
    splits = runner.build_data(recipe, resolved)
    runner.seed_everything(recipe.seed)
    model = runner.build_model(recipe, splits)  # built once; each device gets a copy of this state
    notes: list[str] = []
    prec_a, cl_a, notes_a = _precision(resolved, devs[0], model)
    prec_b, cl_b, notes_b = _precision(resolved, devs[1], model)
    notes += notes_a + [n for n in notes_b if n not in notes_a]
    if prec_a != prec_b:
        raise runner.InputError(
            f"precision differs between the devices ({devs[0]}: {prec_a}, {devs[1]}: {prec_b}; "
            + "; ".join(notes)
            + "); compare with a precision both support, e.g. precision=fp32"
        )
    floor_atol, floor_rtol = FLOORS[prec_a]
    tol = Tolerance(
        floor_atol if atol is None else atol,
        floor_rtol if rtol is None else rtol,
        NOISE_FACTOR if noise_factor is None else noise_factor,
    )
    if recipe.compile is True or recipe.graphs is True:
        notes.append("parity runs eager steps: torch.compile and CUDA graphs are not used")
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        notes.append("dropout is off during parity: the devices' random generators differ, so would their masks")
    if len(splits.train) == 0:
        raise runner.InputError("the training split is empty")
    try:
        probe_x = next(iter(DataLoader(splits.val, batch_size=PROBE_SIZE, shuffle=False)))[0]
    except StopIteration:
        raise runner.InputError("the validation split is empty: parity needs its first samples as a probe batch") from None
    return Prepared(resolved, devs, model, splits, prec_a, (cl_a, cl_b), tol, steps, probe_x, notes)


def replicas(
    prep: Prepared,
    dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    precisions: tuple[str, str] | None = None,
) -> tuple[Replica, Replica]:
    """The two devices' copies of the one model. Differing dtypes or precisions are
    for calibrating tolerances only (benchmarks/parity_calibrate.py)."""
    transform = prep.splits.transform
    precisions = precisions or (prep.precision, prep.precision)
    a, b = (
        Replica(prep.model, d, prep.resolved, pr, cl, transform, dt)
        for d, cl, dt, pr in zip(prep.devices, prep.channels_last, dtypes, precisions)
    )
    return a, b


def yardstick(prep: Prepared) -> Replica | None:
    """The higher-precision CPU replica that measures the precision's own noise."""
    if prep.tolerance.noise_factor == 0:
        return None
    precision, dtype = YARDSTICK[prep.precision]
    return Replica(prep.model, torch.device("cpu"), prep.resolved, precision, False, prep.splits.transform, dtype)


def execute(
    prep: Prepared,
    on_step: Callable[[StepRecord], None] | None = None,
    reps: tuple[Replica, Replica] | None = None,
    ruler: Replica | None | bool = True,
) -> ParityResult:
    """Step both replicas (and the yardstick) in lockstep and compare; no MLflow here.

    `ruler=True` builds the default yardstick; None or False runs without one.
    """
    recipe = prep.resolved.recipe
    tol = prep.tolerance
    a, b = reps or replicas(prep)
    y = yardstick(prep) if ruler is True else (ruler or None)
    envelope = dict.fromkeys(("loss", "grad_norm", "logits"), 0.0)
    records: list[StepRecord] = []

    def noise(q: str, value: Any, ref: Any) -> float:
        envelope[q] = max(envelope[q], relative(value, ref))
        return envelope[q]

    def probe(rec: StepRecord) -> None:
        la, lb = a.probe(prep.probe_x), b.probe(prep.probe_x)
        n = noise("logits", y.probe(prep.probe_x), la) if y is not None else 0.0
        rec.diffs["logits"] = diff(lb, la, tol, n)
        if la.dim() == 2 and la.shape == lb.shape:
            rec.argmax_agreement = float((la.argmax(1) == lb.argmax(1)).double().mean())
        records.append(rec)
        if on_step:
            on_step(rec)

    with strict_math():
        probe(StepRecord(0))
        n_steps = 0
        for i, (x, yb) in enumerate(batches(prep.splits.train, recipe.batch_size, recipe.seed, prep.steps), start=1):
            outs = []
            for r in (a, b, y):
                if r is not None:
                    torch.manual_seed(recipe.seed + i)  # same seed per step: host-side randomness matches
                    outs.append(r.step(x, yb))
            (loss_a, gn_a), (loss_b, gn_b) = outs[0], outs[1]
            rec = StepRecord(i, (loss_a, loss_b), (gn_a, gn_b))
            nl = noise("loss", outs[2][0], loss_a) if y is not None else 0.0
            ng = noise("grad_norm", outs[2][1], gn_a) if y is not None else 0.0
            rec.diffs["loss"] = diff(loss_b, loss_a, tol, nl)
            rec.diffs["grad_norm"] = diff(gn_b, gn_a, tol, ng)
            probe(rec)
            n_steps = i
        pa, pb = a.parameters(), b.parameters()
        py = y.parameters() if y is not None else {}
    # Weights are compared by what training did to them: relative to A's update from the shared start.
    p0 = {k: v.detach().double() for k, v in prep.model.state_dict().items()}
    per_param = {
        k: diff(pb.get(k, math.nan), pa[k], tol, relative(py[k], pa[k], p0[k]) if k in py else 0.0, p0[k])
        for k in pa
    }
    worst = max(per_param, key=lambda k: per_param[k].ratio if not math.isnan(per_param[k].ratio) else math.inf) if per_param else "none"
    return ParityResult(
        str(prep.resolved.path),
        (str(prep.devices[0]), str(prep.devices[1])),
        prep.precision,
        n_steps,
        tol,
        records,
        Diff.worst(list(per_param.values())),
        worst,
        list(prep.notes),
        f"cpu {'fp64' if y.dtype == torch.float64 else YARDSTICK[prep.precision][0]}" if y is not None else "none",
    )


def check(
    resolved: Resolved,
    device_names: tuple[str, str],
    steps: int = DEFAULT_STEPS,
    atol: float | None = None,
    rtol: float | None = None,
    noise_factor: float | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> ParityResult:
    """Prepare and execute, without MLflow (for library use)."""
    return execute(prepare(resolved, device_names, steps, atol, rtol, noise_factor), on_step)


# ----------------------------------------------------------------------------- MLflow


def run(
    resolved: Resolved,
    device_names: tuple[str, str],
    steps: int = DEFAULT_STEPS,
    atol: float | None = None,
    rtol: float | None = None,
    noise_factor: float | None = None,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
) -> ParityResult:
    """Check parity and record it as an MLflow run of its own."""
    recipe = resolved.recipe
    names = parse_devices(",".join(device_names))
    prep = prepare(resolved, names, steps, atol, rtol, noise_factor)  # bad input: exit 2 before any run exists
    uri, artifact_root = tracking.resolve_uri(tracking_uri)
    exp = experiment or recipe.tracking.experiment or resolved.path.stem
    tracker = tracking.Tracker(uri, exp, artifact_root)
    dev_a, dev_b = prep.devices
    tags = sysinfo.run_tags(dev_b)
    tags.update(
        {
            "mpsrun.kind": "parity",
            "mpsrun.recipe": str(resolved.path),
            "mpsrun.overrides": " ".join(resolved.overrides),
            "mpsrun.command": " ".join(sys.argv),
            "mpsrun.version": runner._version(),
            "parity.device_a": str(dev_a),
            "parity.device_b": str(dev_b),
            "parity.requested": ",".join(names),
        }
    )
    tags.update(recipe.tracking.tags)
    info = tracker.start(f"parity {names[0]} vs {names[1]} ({prep.precision})", tags)
    tol = prep.tolerance
    tracker.log_params(
        {
            **flatten(resolved.as_dict()),
            "parity.steps": steps,
            "parity.atol": tol.atol,
            "parity.rtol": tol.rtol,
            "parity.noise_factor": tol.noise_factor,
        }
    )
    tracker.log_text(resolved.as_yaml(), "recipe.yaml")

    def logged(rec: StepRecord) -> None:
        tracker.log_metrics(_step_metrics(rec), step=rec.step)
        if on_step:
            on_step(rec)

    try:
        result = execute(prep, logged)
    except KeyboardInterrupt:
        tracker.finish("KILLED")
        raise
    except Exception as e:
        tracker.finish("FAILED", e)
        raise ParityFailed(f"{type(e).__name__}: {e}", info.run_id) from e
    result.run = info
    try:
        _record(tracker, result)
    except Exception as e:
        tracker.finish("FAILED", e)
        raise ParityFailed(f"recording the result failed: {type(e).__name__}: {e}", info.run_id) from e
    tracker.finish("FINISHED")
    return result


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
    m["probe_argmax_agreement"] = rec.argmax_agreement
    return {k: _finite(v) for k, v in m.items()}


def _finite(v: float) -> float:
    """MLflow stores metrics as floats; clamp infinities to the largest float."""
    if math.isnan(v):
        return v
    return max(min(v, sys.float_info.max), -sys.float_info.max)


def _record(tracker: tracking.Tracker, result: ParityResult) -> None:
    p = result.params
    tracker.log_metrics(
        {
            "params_abs_diff": _finite(p.abs),
            "params_rel_diff": _finite(p.rel),
            "params_noise_rel": _finite(p.noise),
            "params_tol_ratio": _finite(p.ratio),
        },
        step=result.steps,
    )
    summary = {}
    for q, s in result.summary().items():
        summary[f"max_{q}_abs_diff"] = _finite(s.max_abs)
        summary[f"max_{q}_rel_diff"] = _finite(s.max_rel)
        summary[f"max_{q}_tol_ratio"] = _finite(s.max_ratio)
    tracker.log_metrics(summary)
    errors = tracker.flush()
    fd = result.first_divergence
    tags = {
        "parity.verdict": result.verdict,
        "parity.first_divergence": result.divergence_text(),
        "parity.first_divergent_step": str(fd[0]) if fd else "none",
        "parity.precision": result.precision,
        "parity.steps": str(result.steps),
        "parity.atol": f"{result.tolerance.atol:g}",
        "parity.rtol": f"{result.tolerance.rtol:g}",
        "parity.noise_factor": f"{result.tolerance.noise_factor:g}",
        "parity.yardstick": result.yardstick,
        "parity.worst_param": result.worst_param,
        "mpsrun.notes": " | ".join(result.notes) or "none",
    }
    for i, note in enumerate(result.notes):
        tags[f"mpsrun.note.{i}"] = note
    if errors:
        tags["mpsrun.logging_errors"] = " | ".join(errors)
    tracker.set_tags(tags)
    tracker.log_text(json.dumps(result.as_json(), indent=2, default=str), "parity.json")
    with tempfile.TemporaryDirectory() as d:
        png = Path(d) / "parity_loss.png"
        plot(result, png)
        tracker.log_file(png)


def plot(result: ParityResult, path: Path) -> None:
    """Loss per device, and each quantity's difference as a share of its tolerance."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    a, b = result.devices
    recs = [r for r in result.records if r.loss is not None]
    steps = [r.step for r in recs]
    fig = Figure(figsize=(8, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps, [r.loss[0] for r in recs], "o-", label=f"A: {a}", linewidth=2.5, alpha=0.6)  # type: ignore[index]
    top.plot(steps, [r.loss[1] for r in recs], "x--", label=f"B: {b}", linewidth=1.2, color="black")  # type: ignore[index]
    top.set_ylabel("training loss")
    top.legend()
    top.set_title(
        f"parity {a} vs {b} ({result.precision}, {result.steps} steps): {result.verdict}; first divergence: {result.divergence_text()}",
        fontsize=9,
    )
    floor = 1e-6  # equal values are drawn here (a log axis has no zero)
    all_steps = [r.step for r in result.records]
    top_ratio = 1.0
    for q, style in (("loss", "o-"), ("grad_norm", "s-"), ("logits", "^-")):
        ys = [min(max(r.diffs[q].ratio, floor), 1e6) if q in r.diffs else math.nan for r in result.records]
        top_ratio = max([top_ratio] + [v for v in ys if not math.isnan(v)])
        bottom.plot(all_steps, ys, style, label=q, markersize=4)
    pr = min(max(result.params.ratio, floor), 1e6) if not math.isnan(result.params.ratio) else 1e6
    bottom.plot([result.steps], [pr], "D", label="params (end)")
    bottom.axhline(1.0, color="red", linestyle=":", label="tolerance")
    bottom.set_yscale("log")
    bottom.set_ylim(floor / 3, max(30.0, 3 * max(top_ratio, pr)))
    t = result.tolerance
    bottom.set_ylabel("difference / tolerance")
    bottom.set_xlabel(
        "training step (0: initial weights)\n"
        f"out of tolerance: abs diff > {t.atol:g} and rel diff > max({t.rtol:g}, {t.noise_factor:g} x noise of a {result.yardstick} replica); "
        f"equal values drawn at {floor:g}",
        fontsize=8,
    )
    bottom.legend(fontsize=8, ncol=5, loc="upper left")
    fig.savefig(path, dpi=110)
