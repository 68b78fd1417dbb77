"""What a run leaves in MLflow beyond metrics: the pieces MLflow's UI is built to show.

The runner calls three hooks: `begin` right after the run starts (experiment kind,
standard tags, dataset inputs, system metrics), `callback` among the epoch
callbacks (learning curves refreshed every few epochs on long runs) and `end` once
training is over (figures, the description, the logged and registered model).
`stop` always runs, so the system-metrics thread never outlives the run.

This module only gathers what the training objects know (tensors, plugin names);
every MLflow call lives in `mpsrun.track`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mpsrun.plugins import registry as plugins
from mpsrun.track import datasets as track_datasets
from mpsrun.track import figures, model_log, standard
from mpsrun.track.system import SystemMetrics
from mpsrun.train.callbacks import Callback, RunState
from mpsrun.train.data import raw_tensors

if TYPE_CHECKING:
    from mpsrun.track.store import Tracker
    from mpsrun.train.engine import TrainResult
    from mpsrun.train.runner import Setup

FIGURE_EVERY = 5  # epochs between learning-curve refreshes on runs longer than this
EXAMPLE_ROWS = 5  # validation samples in the logged input example
MAX_PREDICT = 100_000  # validation samples the end-of-run figures look at


@dataclass
class Recorder:
    tracker: "Tracker"
    setup: "Setup"
    system: SystemMetrics | None = None
    notes: list[str] = field(default_factory=list)  # fallbacks and skips: printed and tagged by the runner
    timings: dict[str, float] = field(default_factory=dict)  # mpsrun/... bookkeeping metrics
    model: model_log.ModelLogResult | None = None


def default_run_name(setup: "Setup") -> str:
    r = setup.resolved.recipe
    return standard.run_name(r.model.name, r.dataset.name, str(setup.choice.device))


def _title(setup: "Setup", tracker: "Tracker") -> str:
    r = setup.resolved.recipe
    return f"{r.model.name} on {r.dataset.name}, {setup.choice.device} (run {(tracker.run_id or '')[:8]})"


def _splits(setup: "Setup") -> tuple[list[track_datasets.Split], list[str]]:
    out, skipped = [], []
    s = setup.splits
    for context, ds in (("training", s.train), ("validation", s.val), ("test", getattr(s, "test", None))):
        if ds is None:
            continue
        t = raw_tensors(ds)
        if t is None:
            skipped.append(context)
        else:
            out.append(track_datasets.Split(context, t[0], t[1]))
    return out, skipped


def _source_path(setup: "Setup") -> str | None:
    """The folder or file the dataset plugin read, when its arguments name one."""
    kwargs = setup.resolved.recipe.dataset.kwargs
    for key in ("path", "root", "file", "csv"):
        v = kwargs.get(key)
        if isinstance(v, str) and v:
            p = Path(v).expanduser()
            return str(p if p.is_absolute() else setup.resolved.path.resolve().parent / p)
    return None


def _plugin(kind: str, name: str) -> plugins.PluginRef | None:
    try:
        return plugins.find(kind, name)
    except plugins.PluginError:
        return None


def begin(tracker: "Tracker", setup: "Setup", system_metrics: bool = True) -> Recorder:
    """Experiment kind, standard tags, dataset inputs, and the system-metrics monitor."""
    rec = Recorder(tracker, setup)
    r = setup.resolved.recipe
    c, run_id = tracker.c, tracker.run_id
    assert run_id is not None
    standard.mark_experiment(c, tracker.experiment_id)
    tracker.set_tags(standard.source_tags(setup.resolved.path))
    t0 = time.perf_counter()
    splits, skipped = _splits(setup)
    ref = _plugin("dataset", r.dataset.name)
    tags = {"mpsrun.plugin": f"{ref.distribution} {ref.version} ({ref.value})" if ref else r.dataset.name,
            "mpsrun.arguments": json.dumps(r.dataset.kwargs, default=str)}
    try:
        track_datasets.log_datasets(c, run_id, r.dataset.name, splits, _source_path(setup), tags)
    except Exception as e:  # the run goes on; the gap is said and tagged
        rec.notes.append(f"datasets: not logged as MLflow inputs ({type(e).__name__}: {e})")
    for context in skipped:
        rec.notes.append(f"datasets: the {context} split is not a TensorDataset; not logged as an MLflow dataset input")
    rec.timings["datasets_log_time_s"] = time.perf_counter() - t0
    if system_metrics:
        rec.system = SystemMetrics(tracker.uri, run_id, setup.choice.device.type).start()
        rec.notes += rec.system.notes
    return rec


class _Curves(Callback):
    """Refresh the learning-curve figure every FIGURE_EVERY epochs (long runs only)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        done = epoch + 1
        if run.epochs > FIGURE_EVERY and done % FIGURE_EVERY == 0 and done < run.epochs:
            try:
                figures.log_learning_curves(self.rec.tracker.c, self.rec.tracker.run_id, run.history, _title(self.rec.setup, self.rec.tracker) + f", epoch {done}/{run.epochs}")
            except Exception as e:
                self.rec.notes.append(f"figures: learning curves not refreshed at epoch {done} ({type(e).__name__}: {e})")


def callback(rec: Recorder) -> Callback:
    return _Curves(rec)


@torch.no_grad()
def predict_val(setup: "Setup") -> tuple[np.ndarray, np.ndarray]:
    """The model's outputs on the validation split (after training; one host copy at the end)."""
    model, plan = setup.model, setup.plan
    was_training = model.training
    model.eval()
    outs, ys, seen = [], [], 0
    for x, y in plan.val:
        if plan.transform is not None:
            x = plan.transform(x)
        if setup.options.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        outs.append(model(x).float())
        ys.append(y)
        seen += y.shape[0]
        if seen >= MAX_PREDICT:
            break
    model.train(was_training)
    return torch.cat(ys).cpu().numpy(), torch.cat(outs).cpu().numpy()


def _example(setup: "Setup") -> torch.Tensor:
    t = raw_tensors(setup.splits.val)
    if t is not None:
        return t[0][:EXAMPLE_ROWS]
    n = min(EXAMPLE_ROWS, len(setup.splits.val))  # type: ignore[arg-type]
    return torch.stack([torch.as_tensor(setup.splits.val[i][0]) for i in range(n)])


def _classes(setup: "Setup") -> list[str] | None:
    names = setup.splits.info.get("classes") if isinstance(setup.splits.info, dict) else None
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else None


def end(rec: Recorder, result: "TrainResult") -> None:
    """Figures, the run's description, and the model (logged, and registered when asked)."""
    setup, tracker = rec.setup, rec.tracker
    r = setup.resolved.recipe
    c, run_id = tracker.c, tracker.run_id
    t0 = time.perf_counter()
    title = _title(setup, tracker)
    try:
        figures.log_learning_curves(c, run_id, [e.metrics() for e in result.epochs], title)
        y_true, outputs = predict_val(setup)
        figures.log_predictions(c, run_id, y_true, outputs, title, _classes(setup))
    except Exception as e:
        rec.notes.append(f"figures: not logged ({type(e).__name__}: {e})")
    rec.timings["figures_time_s"] = time.perf_counter() - t0
    summary = result.summary()
    tracker.set_tags({"mlflow.note.content": standard.note(r.model.name, r.dataset.name, str(setup.choice.device), len(result.epochs), summary, result.stop_reason)})
    if not r.tracking.log_model:
        return
    dists = {"mpsrun": _mpsrun_version()}
    for kind, name in (("model", r.model.name), ("dataset", r.dataset.name)):
        ref = _plugin(kind, name)
        if ref is not None:
            dists[ref.distribution] = ref.version
    meta = {
        "mpsrun_version": _mpsrun_version(),
        "model": r.model.name,
        "dataset": r.dataset.name,
        "num_classes": setup.splits.num_classes,
        "input_shape": list(setup.splits.input_shape),
        "trained_on": str(setup.choice.device),
        "input": "raw samples as the dataset yields them; the model applies the dataset's transform",
    }
    rec.model = model_log.log_model(
        tracker.uri,
        tracker.experiment_id,
        run_id,  # type: ignore[arg-type]
        setup.model,
        setup.plan.transform,
        _example(setup),
        dists,
        dict(setup.splits.info),
        meta,
        register=r.tracking.register,
        step=result.epochs[-1].epoch if result.epochs else 0,
    )
    rec.timings["log_model_time_s"] = rec.model.seconds
    rec.notes += rec.model.notes
    tags = {"mpsrun.model_uri": rec.model.model_uri}
    if rec.model.model_id:
        tags["mpsrun.model_id"] = rec.model.model_id
    if rec.model.registered:
        tags["mpsrun.registered_model"] = rec.model.registered
    tracker.set_tags(tags)


def stop(rec: Recorder | None) -> None:
    """Stop the system-metrics monitor and write its last samples (safe to call twice)."""
    if rec is not None and rec.system is not None:
        rec.system.stop()
        rec.notes += [n for n in rec.system.notes if n not in rec.notes]


def _mpsrun_version() -> str:
    from mpsrun import __version__

    return __version__
