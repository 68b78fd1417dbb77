"""One trial, in this process: the trial's recipe through `runner.prepare` and `runner.execute`.

Exactly the path of `mpsrun run` (same records, same per-epoch metrics), with three
differences: the dataset comes from the worker's cache when the `dataset:` section and
seed are the same as a trial before (`prepare(..., splits=)`); the run is a child of the
sweep's parent run; and a callback hands the metric to Optuna every epoch, which may
prune the trial: the run then stops at that epoch's end like an early stop (FINISHED,
its records complete) and is tagged PRUNED.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from mpsrun.recipe.load import Resolved
from mpsrun.train import runner
from mpsrun.train.controls.callbacks import Callback, RunState
from mpsrun.train.loop.engine import Listener

from mpsrun.sweep.parent import STATE_TAG, TRIAL_TAG  # noqa: F401 - the tags a trial's run carries


def trial_tags(study_name: str, t: Any, values: dict[str, Any]) -> dict[str, str]:
    """The tags a trial's run carries: its number, the study, its values (fused or not)."""
    return {TRIAL_TAG: str(t.number), "mpsrun.sweep.study": study_name, "mpsrun.sweep": "trial",
            **{f"mpsrun.sweep.param.{k}": json.dumps(v) for k, v in values.items()}}


def check_metric(metric: str, names: list[str]) -> None:
    """BadInput (exit 2) when the sweep's metric is not among the ones this run logs."""
    if metric not in names:
        from mpsrun.recipe.problems import did_you_mean

        raise BadInput(f"sweep.metric: this run never logs '{metric}'{did_you_mean(metric, names)}; it logs {', '.join(names)}")


class BadInput(Exception):
    """Bad input found once the data is known (a metric this task never logs, data that cannot load): exit 2."""


class Report(Callback):
    """Feeds the sweep's metric to the Optuna trial every epoch; stops the run when the pruner says so."""

    def __init__(self, trial: Any, metric: str, pruner_name: str, phases: Any = None) -> None:
        self.trial = trial
        self.phases = phases  # trace.Phases when MPSRUN_SWEEP_TRACE is set: `open` ends here, `train` at each epoch's end
        self.metric = metric
        self.pruner_name = pruner_name
        self.last: float | None = None
        self.pruned_at: int | None = None
        self.run_id: str | None = None

    def on_fit_start(self, run: RunState) -> None:
        if self.phases is not None:
            self.phases.lap("open")
        self.run_id = getattr(run.log, "run_id", None)
        if self.run_id:
            from mpsrun.sweep.storage import RUN_ID

            self.trial.set_user_attr(RUN_ID, self.run_id)

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        if self.phases is not None:
            self.phases.lap("train")
        if self.metric not in metrics:
            raise KeyError(f"sweep.metric '{self.metric}' is not among this run's metrics: {', '.join(sorted(metrics))}")
        self.last = float(metrics[self.metric])
        if not math.isfinite(self.last):
            return  # the non-finite guard (on_nonfinite) decides; a NaN is never reported to the pruner
        self.trial.report(self.last, epoch)
        if epoch + 1 < run.epochs and self.trial.should_prune():
            self.pruned_at = epoch
            why = f"pruned by Optuna's {self.pruner_name} pruner after epoch {epoch + 1} ({self.metric} {self.last:.6g})"
            run.log.set_tags({"mpsrun.sweep.pruned": why})
            run.request_stop(why)


@dataclass
class Outcome:
    state: str  # COMPLETE, PRUNED or FAILED
    value: float | None
    run_id: str | None
    message: str = ""


def data_key(resolved: Resolved) -> str:
    """What a trial's dataset depends on: its `dataset:` section, its seed and its recipe's folder."""
    r = resolved.recipe
    return json.dumps([r.dataset.model_dump(mode="json"), r.seed, str(resolved.path.resolve().parent)], sort_keys=True, default=str)


class DataCache:
    """The dataset built once per (`dataset:` section, seed, recipe folder) and reused by later trials."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.splits: Any = None
        self.hits = 0

    def get(self, resolved: Resolved) -> Any:
        r = resolved.recipe
        key = data_key(resolved)
        if key != self.key:
            self.splits = None  # one dataset held at a time
            runner.seed_everything(r.seed)
            self.splits = runner.build_data(r, resolved)
            self.key = key
        else:
            self.hits += 1
        return self.splits


def run(
    resolved: Resolved, trial: Any, metric: str, pruner_name: str, parent_run_id: str, tracking_uri: str | None,
    cache: DataCache, tags: dict[str, str], listener: Listener | None = None, tracker: Any = None, phases: Any = None,
) -> Outcome:
    """Train one trial's recipe as a child run; FAILED outcomes carry the error (the run holds its traceback).

    KeyboardInterrupt (a signal) propagates with the run marked KILLED. `phases`: a trace.Phases to lap.
    """
    lap = phases.lap if phases is not None else (lambda name: None)
    report = Report(trial, metric, pruner_name, phases)
    setup = None
    failed = True
    try:
        try:
            splits = cache.get(resolved)
        except runner.InputError as e:  # the data every trial needs: the sweep stops
            raise BadInput(str(e)) from None
        lap("data")
        try:
            setup = runner.prepare(resolved, splits=splits)
            lap("prepare")
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - out of memory moving the model, a plugin raising: this trial fails
            run_id = record_failed(resolved, tracker, parent_run_id, tags, e, report)
            return Outcome("FAILED", None, run_id, f"{type(e).__name__}: {e}")
        check_metric(metric, metric_names(setup))
        setup.callbacks.append(report)
        if phases is not None:
            from mpsrun.devices import canary

            canary.LAST_S = 0.0
        try:
            summary = runner.execute(setup, tracking_uri, listener, parent_run_id=parent_run_id, tags=tags, tracker=tracker)
        except runner.RunFailed as e:
            return Outcome("FAILED", report.last, e.run_id or report.run_id, str(e))
        finally:
            lap("close")
            if phases is not None:
                phases.add("canary", canary.LAST_S)  # part of `open`
        run_id = summary.run.run_id
        del summary
        failed = False
        if report.pruned_at is not None:
            return Outcome("PRUNED", report.last, run_id, f"pruned after epoch {report.pruned_at + 1}")
        if report.last is None or not math.isfinite(report.last):
            return Outcome("FAILED", report.last, run_id, f"{metric} is {report.last} at the last epoch")
        return Outcome("COMPLETE", report.last, run_id)
    finally:
        device = setup.choice.device.type if setup is not None else None
        del setup
        release(device, failed)
        lap("release")


def record_failed(resolved: Resolved, tracker: Any, parent_run_id: str, tags: dict[str, str], error: BaseException, report: Report) -> str | None:
    """A child run for a trial that failed before training could start, holding its params and error (as bench cells get)."""
    if tracker is None:
        return None
    from mpsrun.recipe.load import flatten

    try:
        info = tracker.start(resolved.recipe.tracking.run_name, {**tags, "device.requested": resolved.recipe.device, "device.actual": "none",
                                                                 "mpsrun.recipe": str(resolved.path), "mpsrun.overrides": " ".join(resolved.overrides)}, parent_run_id)
        tracker.log_params(flatten(resolved.as_dict()))
        tracker.log_text(resolved.as_yaml(), "recipe.yaml")
        tracker.finish("FAILED", error)
    except Exception:  # noqa: BLE001 - the trial's outcome is in the study either way
        return None
    report.trial.set_user_attr("mpsrun.run_id", info.run_id)
    return info.run_id


def metric_names(setup: Any) -> list[str]:
    """What every epoch of this run logs, beyond the timings: losses, the task's metrics, lr, grad_norm."""
    from mpsrun.train.assemble import metric_names as names

    return names(setup.objective) if setup.objective is not None else ["train_loss", "val_loss"]


LOW_MEMORY = 0.2  # free fraction of the GPU's memory below which a trial that went well still empties the cache


def release(device_type: str | None, failed: bool = True) -> None:
    """Give back what a trial held, so the next starts clean (an out-of-memory trial must not cascade).

    Only after a trial that failed (an out-of-memory error leaves its tensors on the traceback) or when the
    device runs low: a full collection and emptying the allocator's cache cost ~0.1-0.5 s, a fifth of a
    small trial, and a trial that ended well gave its tensors back as its objects went; the allocator
    reuses the cached blocks for the next trial of the same shapes.
    """
    if device_type not in ("cuda", "mps"):
        return  # the CPU's memory comes back as objects go; a full collection costs ~0.5 s a trial
    import torch

    if not failed and not _low_memory(device_type):
        return
    import gc

    gc.collect()

    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif device_type == "mps":
        try:
            torch.mps.empty_cache()
        except Exception:  # noqa: BLE001 - older torch or no MPS
            pass


def _low_memory(device_type: str) -> bool:
    """Whether the device's free memory is under LOW_MEMORY of its total (CUDA: what every process holds)."""
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        try:
            free, total = torch.cuda.mem_get_info()
        except Exception:  # noqa: BLE001 - cannot tell: play safe
            return True
        return free < LOW_MEMORY * total
    return True  # MPS has no cheap question for it: keep the old behaviour there
