"""Record hooks for runs other than the one a tracker writes: a fused sweep group's members, each its own child run (and
the sweep's parent, through `client_calls`).

A fused group trains several trials in one process at once; the worker's MLflow helper
writes one run at a time (`store.Tracker`), so these hooks take explicit run ids and
write through the helper's client, in batches: one call creates every member's run (with
its tags), one fills in their params, recipe texts and dataset inputs (the datasets built
and digested once for the group), one call logs every member's metrics of the epochs since
the last, one call ends those that ended. Re-exported by `track.records.hooks` (the helper
looks hooks up there).
"""

from __future__ import annotations

import time
from typing import Any

from mpsrun.track.records.names import param_value


def runs_begin(t: Any, specs: list[dict[str, Any]], data: tuple | None = None, fill: bool = True) -> list[str]:
    """Create each spec's run ({run_name, tags, parent, params, texts}); returns their ids, in order.

    `data`: (dataset name, splits, source path, source tags), logged as every run's dataset inputs.
    `fill` False: the runs only (with their tags); their params, texts and inputs follow with `runs_fill`,
    posted without waiting, so the group trains meanwhile (3/4 of the time here for 16 digits members).
    """
    from mpsrun.track.records import standard

    try:
        standard.mark_experiment(t.c, t.experiment_id)
    except Exception:  # noqa: BLE001
        pass
    ids = [t.c.create_run(t.experiment_id, run_name=s.get("run_name"), tags={**s["tags"], "mlflow.parentRunId": s["parent"]}).info.run_id
           for s in specs]
    if fill:
        _fill(t, ids, specs, data, quiet=False)
    return ids


def runs_fill(t: Any, ids: list[str], specs: list[dict[str, Any]], data: tuple | None = None) -> None:
    """The params, texts and dataset inputs of runs `runs_begin(fill=False)` created. Posted without waiting; never raises:
    a run that misses them says so (`mpsrun.note.fill`)."""
    _fill(t, ids, specs, data, quiet=True)


def _fill(t: Any, ids: list[str], specs: list[dict[str, Any]], data: tuple | None, quiet: bool) -> None:
    from mlflow.entities import DatasetInput, InputTag, Param, RunTag

    from mpsrun.track.records import datasets as track_datasets

    inputs: list[Any] = []
    if data is not None:
        try:
            items = track_datasets.datasets_for(*data)
            inputs = [DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(key="mlflow.data.context", value=ctx)]) for ds, ctx in items]
        except Exception:  # noqa: BLE001 - the runs go on without their inputs (the member's notes say so)
            inputs = []
    for rid, s in zip(ids, specs):
        try:
            params = [Param(k, param_value(v)) for k, v in sorted(s.get("params", {}).items())]
            for i in range(0, len(params), 100):
                t.c.log_batch(rid, params=params[i : i + 100])
            for name, text in s.get("texts", {}).items():
                t.c.log_text(rid, text, name)
            if inputs:
                try:
                    t.c.log_inputs(rid, datasets=inputs)
                except Exception:  # noqa: BLE001
                    t.c.log_batch(rid, tags=[RunTag("mpsrun.note.datasets", "datasets: not logged as MLflow inputs")])
        except Exception as e:  # noqa: BLE001 - posted: the next run's still go in
            if not quiet:
                raise
            try:
                t.c.set_tag(rid, "mpsrun.note.fill", f"params, recipe or dataset inputs not all logged ({type(e).__name__}: {e})"[:5000])
            except Exception:  # noqa: BLE001
                pass


def runs_epoch(t: Any, rows: list[tuple[str, dict[str, float], int, dict[str, str]]]) -> None:
    """Each (run id, metrics, step, tags): one batch per run, whatever the epochs its rows span (the later tag
    wins). Posted without waiting; never raises."""
    from mlflow.entities import Metric, RunTag

    ts = int(time.time() * 1000)
    per: dict[str, tuple[list[Any], dict[str, str]]] = {}
    for rid, metrics, step, tags in rows:
        ms, tg = per.setdefault(rid, ([], {}))
        ms += [Metric(k, float(v), ts, step) for k, v in metrics.items()]
        tg.update({k: str(v) for k, v in tags.items()})
    for rid, (ms, tg) in per.items():
        try:
            for i in range(0, max(len(ms), 1), 1000):  # MLflow takes at most 1000 metrics a batch
                t.c.log_batch(rid, metrics=ms[i : i + 1000], tags=[RunTag(k, v) for k, v in tg.items()] if i == 0 else [])
        except Exception:  # noqa: BLE001 - a metric is not worth the group; the study holds the value
            continue


def runs_end(t: Any, ends: list[tuple[str, str, dict[str, str], str | None, str | None]]) -> None:
    """Each (run id, status, tags, error message, traceback): tags, the error as `mpsrun.error` and error.txt, the status."""
    from mlflow.entities import RunTag

    for rid, status, tags, message, tb in ends:
        try:
            extra = {"mpsrun.error": message} if message else {}
            t.c.log_batch(rid, tags=[RunTag(k, str(v)[:5000]) for k, v in {**tags, **extra}.items()])
            if message:
                t.c.log_text(rid, tb or message, "error.txt")
            t.c.set_terminated(rid, status)
        except Exception:  # noqa: BLE001 - the next run's end still goes in
            continue


def client_calls(t: Any, calls: list[tuple[str, tuple, dict]], quiet: bool = False) -> list[Any]:
    """MLflow client calls ((method, args, kwargs), in order) for a run the tracker does not write: a sweep's parent.

    Why in the helper: the command that runs a sweep then never imports mlflow itself (seconds on
    2 cores, before its first trial could start). Returns each call's answer; `quiet` (a call posted
    without waiting): a failure skips that call and the next still goes in, never raised on a later call.
    """
    out: list[Any] = []
    for method, args, kwargs in calls:
        try:
            out.append(_plain(getattr(t.c, method)(*args, **kwargs)))
        except Exception:  # noqa: BLE001 - raised to the caller that waits; a posted call's failure is not worth a trial
            if not quiet:
                raise
            out.append(None)
    return out


def _plain(value: Any) -> Any:
    """MLflow's runs and experiments as plain namespaces with the same attributes (`.info.run_id`, `.data.tags`, ...):
    unpickling MLflow's own entities would import mlflow (and pandas, protobuf) in the caller, seconds on 2 cores."""
    from types import SimpleNamespace as NS

    from mlflow.entities import Experiment, Run

    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Run):
        i, d = value.info, value.data
        info = NS(**{k: getattr(i, k, None) for k in ("run_id", "run_name", "experiment_id", "status", "start_time", "end_time",
                                                       "artifact_uri", "lifecycle_stage", "user_id")})
        return NS(info=info, data=NS(tags=dict(d.tags), params=dict(d.params), metrics=dict(d.metrics)))
    if isinstance(value, Experiment):
        return NS(**{k: getattr(value, k, None) for k in ("experiment_id", "name", "artifact_location", "lifecycle_stage")},
                  tags=dict(value.tags or {}))
    return value
