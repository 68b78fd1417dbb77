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

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from mpsrun.devices import sysinfo
from mpsrun.devices.canary import strict_math
from mpsrun.devices.parity.replica import (  # noqa: F401 - the parity API, in one place for its callers
    DEFAULT_STEPS,
    YARDSTICK,
    Prepared,
    Replica,
    batches,
    parse_devices,
    prepare,
    replicas,
    yardstick,
)
from mpsrun.devices.parity.report import (  # noqa: F401
    ParityResult,
    StepRecord,
    Summary,
    _finite,
    _step_metrics,
)
from mpsrun.devices.parity.tolerance import (  # noqa: F401
    FLOORS,
    QUANTITIES,
    Diff,
    Tolerance,
    diff,
    relative,
)
from mpsrun.recipe.load import Resolved, flatten
from mpsrun.track.store import client as tracking
from mpsrun.train import runner


class ParityFailed(Exception):
    """The check itself crashed after the MLflow run started; the run is marked FAILED."""

    def __init__(self, message: str, run_id: str | None) -> None:
        super().__init__(message)
        self.run_id = run_id


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
        rec.diffs["logits"] = diff(lb, la, tol, n, quantity="logits")
        if prep.task != "classification":  # a regression output has no class to agree on
            rec.argmax_agreement = None
        elif la.dim() == 2 and la.shape == lb.shape:
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
            rec.diffs["loss"] = diff(loss_b, loss_a, tol, nl, quantity="loss")
            rec.diffs["grad_norm"] = diff(gn_b, gn_a, tol, ng, quantity="grad_norm")
            probe(rec)
            n_steps = i
        pa, pb = a.parameters(), b.parameters()
        py = y.parameters() if y is not None else {}
    # Weights are compared by what training did to them: relative to A's update from the shared start.
    p0 = {k: v.detach().double() for k, v in prep.model.state_dict().items()}
    per_param = {
        k: diff(pb.get(k, math.nan), pa[k], tol, relative(py[k], pa[k], p0[k]) if k in py else 0.0, p0[k], quantity="params")
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
        task=prep.task,
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
        "parity.a_suspect": str(result.a_suspect).lower(),
        "parity.task": result.task,
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
        bottom.plot(all_steps, ys, style, label=result.label(q), markersize=4)
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
