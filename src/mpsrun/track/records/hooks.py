"""The run's record hooks on the MLflow side, fed plain data: where MLflow's client lives.

`train/record.py` gathers what the training objects know (numpy arrays of the data,
the epoch history, the validation outputs, a CPU copy of the model) and calls these
through `tracker.hook(NAME, ...)`. With the in-process `store.Tracker` they run right
there; with the MLflow helper process (`track/helper/background.py`, the default for
`mpsrun run`) they run in the helper, so the training process never imports mlflow,
matplotlib or torch.export, and the slow parts (dataset digests, figures, the pt2
export) use the other core.

Each hook takes the tracker first (`.c`, `.run_id`, `.uri`, `.experiment_id`) and
returns plain values (notes, timings) a pipe can carry.
"""

from __future__ import annotations

import time
from typing import Any

from mpsrun.track.records import datasets as track_datasets
from mpsrun.track.records import figures

# What the run's hooks need, imported by the helper while the training process trains, in the
from mpsrun.track.records import standard
from mpsrun.track.apart import client_calls, runs_begin, runs_end, runs_epoch, runs_fill  # noqa: F401 - hooks: a fused sweep group's member runs, its parent
# order they are asked for: dataset inputs at the start, figures, then the model (torch, pt2).
WARM_MODULES = ("mlflow.data", "mlflow.entities", "matplotlib.figure", "matplotlib.backends.backend_agg",
                "mlflow.models", "mlflow.pyfunc", "mlflow.utils.environment", "mlflow.utils.model_utils", "mlflow.system_metrics.system_metrics_monitor",
                # what logging the model imports on its way (0.26 s and 0.09 s of the helper's log_exported in a
                # py-spy profile on the H100 machine): GitPython, for the LoggedModel's source commit tag, and
                # the tracing processors that `set_tracking_uri` retires
                "git", "mlflow.tracing.processor.base_mlflow", "mlflow.tracing.processor.otel")


BEGIN_MODULES = 2  # the first WARM_MODULES: what `begin` needs (dataset inputs); the rest serve the end


def warm(mark: Any = None, begin_only: bool = False) -> None:
    """Import what `begin` and `end` will need, so the end of a run is only its work.

    `begin_only`: a sweep worker's helper whose trials log no model and no figures (the default for
    trials): the rest would only compete, on the helper's interpreter lock, with the first trial's calls.
    """
    import importlib

    for name in WARM_MODULES[:BEGIN_MODULES] if begin_only else WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the hook that needs it reports the failure itself
            pass
        if mark is not None:
            mark(f"warm: imported {name}")
    if begin_only:
        return
    # A first draw loads matplotlib's fonts: one tiny figure, thrown away. (No torch here: the
    # training process exports the model, `model_pt2` logs it without importing torch.)
    try:
        import io

        fig = figures.learning_curves([{"train_loss": 1.0, "val_loss": 1.0, "val_accuracy": 0.5}], "warm-up")
        fig.savefig(io.BytesIO(), format="png")
    except Exception:  # noqa: BLE001
        pass
    if mark is not None:
        mark("warm: a tiny figure")
    # Logging the model checks its pip requirements against what is installed, and the first
    # check maps every installed distribution to its modules: about a second on a machine
    # with a large site-packages (the H100's), paid at the end of the run unless done here.
    try:
        from mlflow.utils import requirements_utils

        requirements_utils._init_packages_to_modules_map()
    except Exception:  # noqa: BLE001 - a private helper of mlflow's: without it the check builds the map itself
        pass
    if mark is not None:
        mark("warm: installed distributions mapped")


def begin(t: Any, recipe_path: str | None, dataset_name: str, splits: list[track_datasets.Split] | None, source_path: str | None,
          input_tags: dict[str, str], system_metrics: bool, device_type: str, splits_key: str | None = None) -> dict[str, Any]:
    """Experiment kind, standard tags, dataset inputs, and the system-metrics monitor (kept on `t`).

    `splits_key` (a sweep worker's trials): the splits are kept on `t` under it, and a later trial with
    the same key sends None instead of the same arrays again.
    """
    notes: list[str] = []
    standard.mark_experiment(t.c, t.experiment_id)
    t.set_tags(standard.source_tags(recipe_path))
    t0 = time.perf_counter()
    if splits_key is not None:
        if splits is not None:
            t._mpsrun_splits = (splits_key, splits)
        else:
            kept = getattr(t, "_mpsrun_splits", (None, None))
            splits = kept[1] if kept[0] == splits_key else None
    try:
        if splits is None:
            raise RuntimeError("the worker's data was sent to an MLflow helper that has since been replaced")
        track_datasets.log_datasets(t.c, t.run_id, dataset_name, splits, source_path, input_tags)
    except Exception as e:  # the run goes on; the gap is said and tagged
        notes.append(f"datasets: not logged as MLflow inputs ({type(e).__name__}: {e})")
    timings = {"datasets_log_time_s": time.perf_counter() - t0}
    if system_metrics:
        from mpsrun.track.records.system import SystemMetrics

        t._system = SystemMetrics(t.uri, t.run_id, device_type).start()
        notes += t._system.notes
    return {"notes": notes, "timings": timings}


def stop_system(t: Any) -> list[str]:
    """Stop the system-metrics monitor and write its last samples; its notes (safe to call twice)."""
    system = getattr(t, "_system", None)
    if system is None:
        return []
    t._system = None
    system.stop()
    return list(system.notes)


def curves(t: Any, history: list[dict[str, float]], title: str) -> None:
    figures.log_learning_curves(t.c, t.run_id, history, title)


def end_figures(t: Any, history: list[dict[str, float]], title: str, predictions: Any, classes: list[str] | None) -> list[str]:
    """Learning curves and the prediction figures; notes for what failed.

    `predictions`: (y_true, outputs) as numpy arrays, or an exception text from the
    training process (the curves are still drawn).
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mpsrun-figures-") as folder:  # drawn as the exporter draws them, logged here
        return log_drawn(t, figures.draw_end(history, title, predictions, classes, folder))


def log_drawn(t: Any, drawn: dict[str, Any]) -> list[str]:
    """The end-of-run figures another process drew (`figures.draw_end`): logged as artifacts; notes."""
    return figures.log_drawn(t.c, t.run_id, drawn)


def log_model(t: Any, served: Any, example: Any, distributions: dict[str, str], info: dict[str, Any], metadata: dict[str, Any],
              register: str | None, step: int) -> dict[str, Any]:
    """The logged (and registered) model; `served` is a `ServedModel` or the path of one saved with torch.save."""
    from mpsrun.track.records import model_log

    if isinstance(served, str):
        import torch

        served = torch.load(served, map_location="cpu", weights_only=False)
    res = model_log.log_served(t.uri, t.experiment_id, t.run_id, served, example, distributions, info, metadata, register=register, step=step)
    _source(t, res.model_id, res.notes)
    return {"model_uri": res.model_uri, "model_id": res.model_id, "seconds": res.seconds, "registered": res.registered, "notes": res.notes}


def log_exported(t: Any, pt2_file: str, example: Any, outputs: Any, torch_version: str, distributions: dict[str, str],
                 info: dict[str, Any], metadata: dict[str, Any], register: str | None, step: int) -> dict[str, Any]:
    """The logged (and registered) model from a pt2 file the training process exported (no torch here)."""
    from mpsrun.track.records import model_pt2

    res = model_pt2.log_exported(t.uri, t.experiment_id, t.run_id, pt2_file, example, outputs, torch_version, "model",
                                 distributions, info, metadata, register=register, step=step)
    _source(t, res["model_id"], res["notes"])
    return res


def _source(t: Any, model_id: str | None, notes: list[str]) -> None:
    """The logged model's source tags: the run's (the recipe and its git state), not the logging process's."""
    try:
        standard.model_source(t.c, t.run_id, model_id)
    except Exception as e:  # noqa: BLE001 - the model is logged; its "Logged from" is wrong, said and tagged
        notes.append(f"model: source tags not set ({type(e).__name__}: {e})")


def tag_run(t: Any, run_id: str, tags: dict[str, str]) -> None:
    """Tags on a run other than the one `t` writes (a sweep's finished trial: its state), in the helper; never raises:
    it is posted without waiting, and a failure would otherwise surface on the next trial's first call."""
    for k, v in tags.items():
        try:
            t.c.set_tag(run_id, k, v)
        except Exception:  # noqa: BLE001 - a tag is not worth a trial; the study holds the truth (and the owner's
            continue  # publish settles lost trials' runs from it: sweep/parent.settle_lost); the next tag may still go in
