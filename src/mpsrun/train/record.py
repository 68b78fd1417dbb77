"""What a run leaves in MLflow beyond metrics: the pieces MLflow's UI is built to show.

The runner calls three hooks: `open_for` right after the run starts (experiment kind,
standard tags, dataset inputs, system metrics; `begin` on the recording rank),
`callbacks` among the epoch callbacks (learning curves refreshed every few epochs on
long runs) and `finish` once training is over (figures, the description, the logged and
registered model: `end`). `stop` always runs, so the system-metrics thread never
outlives the run.

This module only gathers what the training objects know (tensors, plugin names,
the epoch history, the validation outputs, a CPU copy of the model) and hands it,
as plain data, to `tracker.hook(...)` (`track/records/hooks.py`): every MLflow call lives in
`mpsrun.track`, and with the MLflow helper process (the default for `mpsrun run`)
it runs there, so this process imports neither mlflow nor matplotlib.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from mpsrun.plugins import registry as plugins
from mpsrun.track.records import datasets as track_datasets
from mpsrun.track.records import hooks
from mpsrun.track.records import model_log
from mpsrun.track.records import standard
from mpsrun.train.controls.callbacks import Callback, RunState
from mpsrun.train.ranks import distributed
from mpsrun.train.loop.data import raw_tensors
from mpsrun.train.loop.metrics import target_units

if TYPE_CHECKING:
    from mpsrun.track.store.client import Tracker
    from mpsrun.train.loop.engine import TrainResult
    from mpsrun.train.setup import Setup

FIGURE_EVERY = 5  # epochs between learning-curve refreshes on runs longer than this
EXAMPLE_ROWS = 5  # validation samples in the logged input example
MAX_PREDICT = 100_000  # validation samples the end-of-run figures look at


@dataclass
class Recorder:
    tracker: "Tracker"
    setup: "Setup"
    system: bool = False  # the system-metrics monitor runs (beside the tracker: `hooks.stop_system`)
    notes: list[str] = field(default_factory=list)  # fallbacks and skips: printed and tagged by the runner
    timings: dict[str, float] = field(default_factory=dict)  # mpsrun's bookkeeping: into mpsrun_timings.json
    model: model_log.ModelLogResult | None = None
    pending: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)  # hooks the helper works on while training goes on

    def settle(self) -> None:
        """Read the answers of hooks started during training (a failure is a note, not the run's end)."""
        while self.pending:
            what, answer = self.pending.pop(0)
            try:
                answer()
            except Exception as e:  # noqa: BLE001
                self.notes.append(f"{'records' if what == 'dataset inputs' else 'figures'}: {what} failed ({type(e).__name__}: {e})")


def default_run_name(setup: "Setup") -> str:
    r = setup.resolved.recipe
    return standard.run_name(r.model.name, r.dataset.name, str(setup.choice.device))


def _title(setup: "Setup", tracker: "Tracker") -> str:
    r = setup.resolved.recipe
    return f"{r.model.name} on {r.dataset.name}, {setup.choice.device} (run {(tracker.run_id or '')[:8]})"


INPUT_SAMPLE_BYTES = 64 * 2**20  # above this, a split's MLflow dataset input describes its first rows only


def input_splits(setup: "Setup") -> tuple[list[track_datasets.Split], list[str]]:
    """Each split's raw tensors for its MLflow dataset input (a run's here; a fused sweep group's, sweep/fused/record.py).

    A large split (an image cache of gigabytes) is cut to its first rows: the whole of it would
    be pickled to the helper process and flattened by MLflow's digest (which reads only its first
    10,000 values anyway); the run says so in its notes.
    """
    out, skipped = [], []
    s = setup.splits
    for context, ds in (("training", s.train), ("validation", s.val), ("test", getattr(s, "test", None))):
        if ds is None:
            continue
        t = raw_tensors(ds)
        if t is None:
            skipped.append(context)
            continue
        x, y = t
        row = max(1, x[:1].numel() * x.element_size())
        if len(x) * row > INPUT_SAMPLE_BYTES:
            keep = max(1, INPUT_SAMPLE_BYTES // row)
            skipped.append(f"{context}:sample:{keep}:{len(x)}")
            x, y = x[:keep], y[:keep]
        out.append(track_datasets.Split(context, track_datasets.Head.of(x), _host(y)))
    return out, skipped


def _splits_key(setup: "Setup") -> str:
    """Which tensors the splits are (object, storage, shape): equal for the trials of a sweep worker's cached dataset."""
    parts = []
    s = setup.splits
    for context, ds in (("training", s.train), ("validation", s.val), ("test", getattr(s, "test", None))):
        t = raw_tensors(ds) if ds is not None else None
        if t is None:
            parts.append(f"{context}:-:{id(ds)}")
            continue
        parts.append(":".join(f"{id(a)}/{a.data_ptr()}/{tuple(a.shape)}/{a.dtype}" for a in t))
    return "|".join(parts)


def _source_path(setup: "Setup") -> str | None:
    """The folder or file the dataset plugin read, when its arguments name one."""
    info = setup.splits.info if isinstance(setup.splits.info, dict) else {}
    if isinstance(info.get("source"), str) and info["source"]:  # the plugin says what it read (image_folder, image_csv)
        return info["source"]
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


def dataset_source(setup: "Setup") -> tuple[str | None, dict[str, str]]:
    """What the MLflow dataset inputs say of their source: the path the plugin read (if any), and the plugin and its arguments."""
    r = setup.resolved.recipe
    ref = _plugin("dataset", r.dataset.name)
    tags = {"mpsrun.plugin": f"{ref.distribution} {ref.version} ({ref.value})" if ref else r.dataset.name,
            "mpsrun.arguments": json.dumps(r.dataset.kwargs, default=str)}
    return _source_path(setup), tags


def _host(a: Any) -> np.ndarray:
    return a.detach().to("cpu").numpy() if torch.is_tensor(a) else np.asarray(a)


def hook(tracker: Any, name: str, *args: Any) -> Any:
    """Run a `track.hooks` function beside the tracker: in its helper process where it has one."""
    if hasattr(type(tracker), "hook") or hasattr(tracker, "_remote"):
        return tracker.hook(name, *args)
    return getattr(hooks, name)(tracker, *args)  # a bare stand-in with `.c` and `.run_id` (tests)


def hook_later(tracker: Any, name: str, *args: Any) -> Any:
    """`hook`, its answer read when called: with the helper process, it works while this process goes on."""
    if hasattr(type(tracker), "hook_later"):
        return tracker.hook_later(name, *args)
    value = hook(tracker, name, *args)
    return lambda: value


def begin(tracker: "Tracker", setup: "Setup", system_metrics: bool = True) -> Recorder:
    """Experiment kind, standard tags, dataset inputs, and the system-metrics monitor."""
    rec = Recorder(tracker, setup)
    r = setup.resolved.recipe
    assert tracker.run_id is not None
    sweep_trial = getattr(tracker, "keep_open", False) is True and hasattr(type(tracker), "hook_later")
    key = _splits_key(setup) if sweep_trial else None
    splits: list[track_datasets.Split] | None
    if key is not None and getattr(tracker, "_mpsrun_splits", (None, []))[0] == key:
        # The same tensors as the worker's previous trial: its helper keeps them; not copied and pickled again
        # (60,000 images: ~50 MB through the pipe, a tenth of a second of the trial's CPU time).
        splits, skipped = None, tracker._mpsrun_splits[1]
    else:
        splits, skipped = input_splits(setup)
        if key is not None:
            tracker._mpsrun_splits = (key, skipped)
    source, tags = dataset_source(setup)
    args = (str(setup.resolved.path), r.dataset.name, splits, source, tags, system_metrics, setup.choice.device.type, key)
    if hasattr(type(tracker), "hook_later"):
        # With the helper (a sweep's trial, or `mpsrun run`): the dataset inputs are written while the run trains
        # (MLflow's digest of 60,000 images is a quarter of a second in the helper, which this process used to
        # wait for before its canary); the answer is read before the run ends, and the helper writes in order,
        # so every record is in before the run's status.
        answer = tracker.hook_later("begin", *args)

        def begun() -> None:
            out = answer()
            rec.notes += out["notes"]
            rec.timings.update(out["timings"])
        rec.pending.append(("dataset inputs", begun))
    else:
        out = hook(tracker, "begin", *args)
        rec.notes += out["notes"]
        rec.timings.update(out["timings"])
    for context in skipped:
        if ":sample:" in context:
            name, _, keep, total = context.split(":")
            rec.notes.append(f"datasets: the {name} split's MLflow dataset input describes its first {int(keep):,} of {int(total):,} rows (digest, schema, profile)")
        else:
            rec.notes.append(f"datasets: the {context} split is not a TensorDataset; not logged as an MLflow dataset input")
    rec.system = system_metrics
    return rec


class _Curves(Callback):
    """Refresh the learning-curve figure every FIGURE_EVERY epochs (long runs only), while training goes on.

    Not done: importing torch.export on a thread during training (a second of the run's
    end on the H100). Measured there, the thread's imports held the GIL between graph
    replays and made the epochs it overlapped 1.2 to 2.5x slower: the epoch times the run
    reports would no longer be the training's own.
    """

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        done = epoch + 1
        r = self.rec.setup.resolved.recipe
        wanted = getattr(getattr(r, "tracking", None), "figures", True)  # tracking.figures: false skips them
        if run.epochs > FIGURE_EVERY and done % FIGURE_EVERY == 0 and done < run.epochs and wanted:
            what = f"learning curves at epoch {done}"
            try:  # drawn by the helper while the next epochs train; the answer is read at the end
                self.rec.pending.append((what, hook_later(self.rec.tracker, "curves", list(run.history), _title(self.rec.setup, self.rec.tracker) + f", epoch {done}/{run.epochs}")))
            except Exception as e:
                self.rec.notes.append(f"figures: {what} failed ({type(e).__name__}: {e})")


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
    t0 = time.perf_counter()
    title = _title(setup, tracker)
    if r.tracking.figures:
        try:
            predictions: Any = predict_val(setup)
            if setup.objective is not None and setup.objective.task == "regression":  # the figure in the target's units
                predictions = target_units(*predictions, setup.splits.info or {})
        except Exception as e:  # the learning curves are still drawn
            predictions = f"{type(e).__name__}: {e}"
        drawn = hook_later(tracker, "end_figures", [e.metrics() for e in result.epochs], title, predictions, _classes(setup))
    else:
        tracker.set_tags({"mpsrun.figures": "skipped (tracking.figures: false)"})
        drawn = list  # no notes
    summary = result.summary()
    tracker.set_tags({"mlflow.note.content": standard.note(r.model.name, r.dataset.name, str(setup.choice.device), len(result.epochs), summary, result.stop_reason)})
    try:
        if r.tracking.log_model:  # exported here while the helper draws
            _log_model(rec, result)
    finally:
        rec.settle()
        rec.notes += drawn()
        rec.timings["figures_time_s"] = time.perf_counter() - t0  # with the helper: until drawn, beside the model


def model_ahead(tracker: Any, setup: "Setup") -> None:
    """Before training: hand the untrained model to the tracker's exporter process, where it has one
    (`track/helper/exporter.py`: the export is done by the time training ends; the weights come then)."""
    if hasattr(type(tracker), "model_ahead") and setup.resolved.recipe.tracking.log_model and distributed.is_main_process():
        size = sum(t.numel() * t.element_size() for t in (*setup.model.parameters(), *setup.model.buffers()))
        tracker.model_ahead(lambda: (model_log.served_copy(setup.model, setup.plan.transform), _host(_example(setup))), size)


def _log_model(rec: Recorder, result: "TrainResult") -> None:
    setup, tracker = rec.setup, rec.tracker
    r = setup.resolved.recipe
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
    t0 = time.perf_counter()
    served = model_log.served_copy(setup.model, setup.plan.transform)
    out = hook(tracker, "log_model", served, _host(_example(setup)), dists, dict(setup.splits.info), meta,
               r.tracking.register, result.epochs[-1].epoch if result.epochs else 0)
    rec.model = model_log.ModelLogResult(out["model_uri"], out["model_id"], time.perf_counter() - t0, out["registered"], out["notes"])
    rec.timings["log_model_time_s"] = rec.model.seconds
    rec.notes += rec.model.notes
    tags = {"mpsrun.model_uri": rec.model.model_uri}
    if rec.model.model_id:
        tags["mpsrun.model_id"] = rec.model.model_id
    if rec.model.registered:
        tags["mpsrun.registered_model"] = rec.model.registered
    tracker.set_tags(tags)


def finish(rec: Recorder, result: "TrainResult") -> list[str]:
    """After training: figures, description and model on the main process, then the monitor stopped.

    Returns the notes this added (the runner prints and tags them). The one place that
    knows rank 0 alone records, and that a store gone away takes metrics but not models.
    """
    seen = len(rec.notes)
    if distributed.is_main_process():
        distributed.for_recording(rec.setup)  # the user's module and the whole validation set, on rank 0
        away = getattr(rec.tracker, "store_away", None)
        if away is not None and away():  # the spool keeps metrics, params, tags and status, not models
            rec.notes.append("the tracking store is away at the end of training: figures and the logged model are skipped (metrics, params, tags and the final status are spooled)")
        else:
            end(rec, result)
    stop(rec)
    return rec.notes[seen:]


def open_for(tracker: "Tracker", setup: "Setup") -> Recorder:
    """`begin` on the process that records (rank 0 of a job, or the only one); a silent Recorder elsewhere."""
    if distributed.is_main_process():
        return begin(tracker, setup, setup.resolved.recipe.tracking.system_metrics)
    return Recorder(tracker, setup)


def callbacks(rec: Recorder) -> list[Callback]:
    """The epoch callbacks recording adds (none on a rank that does not record)."""
    return [callback(rec)] if distributed.is_main_process() else []


def stop(rec: Recorder | None) -> None:
    """Stop the system-metrics monitor and write its last samples (safe to call twice)."""
    if rec is not None:
        rec.settle()
    if rec is not None and rec.system:
        rec.system = False
        rec.notes += [n for n in hook(rec.tracker, "stop_system") if n not in rec.notes]


def _mpsrun_version() -> str:
    from mpsrun import __version__

    return __version__
