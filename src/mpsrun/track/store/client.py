"""Everything MLflow: store default, experiment, params, metrics, tags, artifacts, status.

Metric logging goes through one background thread so a SQLite write never sits
inside an epoch's timing; the time that thread spends is itself logged
(`mlflow_log_time_s`) so the claim "MLflow is off the hot path" is checkable.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsrun.track.records.names import param_value
from mpsrun.track.store.lock import store_lock
from mpsrun.track.store.spool import Outbox

ENV_URI = "MLFLOW_TRACKING_URI"


def default_store(cwd: Path | None = None) -> tuple[str, str]:
    """(tracking URI, artifact root) of the embedded store under `<cwd>/mlruns`."""
    base = (cwd or Path.cwd()).resolve() / "mlruns"
    return f"sqlite:///{base / 'mlflow.db'}", (base / "artifacts").as_uri()


def resolve_uri(cli_uri: str | None) -> tuple[str, str | None]:
    """`--tracking-uri` wins, then MLFLOW_TRACKING_URI, then the embedded SQLite store.

    Returns the URI and, for the embedded store only, the artifact root to use.
    """
    if cli_uri:
        return cli_uri, None
    if os.environ.get(ENV_URI):
        return os.environ[ENV_URI], None
    uri, artifacts = default_store()
    Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return uri, artifacts


def client(uri: str) -> Any:
    """An MlflowClient for `uri`: SQLite creation/migration under a file lock, writes retried
    on `database is locked`, HTTP retries bounded (see `track.lock`, `track.remote`)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    from mpsrun.track.store import lock

    from mpsrun.track.store import remote

    if remote.is_http(uri):
        remote.bound_http_retries()
    with lock.store_lock(uri):  # MlflowClient opens (and creates, migrates) the store here
        return lock.RetryingClient(MlflowClient(tracking_uri=uri))


def ensure_experiment(c: Any, name: str, artifact_root: str | None) -> str:
    """The experiment's id, created on first use (with artifacts under the store)."""
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            c.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    location = f"{artifact_root}/{name}" if artifact_root else None
    try:
        return c.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another run
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


@dataclass
class RunInfo:
    run_id: str
    experiment_id: str
    experiment: str
    uri: str

    def ui_hint(self) -> str:
        return f"experiment '{self.experiment}', run {self.run_id} in {self.uri}"


class Tracker:
    """One MLflow run. Params, tags and artifacts are written directly (outside the
    timed loop); metrics are buffered and written in batches by a worker thread at
    most every `interval` seconds, so a fast epoch pays nothing for SQLite."""

    def __init__(self, uri: str, experiment: str, artifact_root: str | None = None, interval: float = 5.0) -> None:
        self.uri = uri
        self.experiment = experiment
        self.artifact_root = artifact_root
        self.interval = interval
        self.c = client(uri)
        with store_lock(uri):  # two new runs of a new experiment: one creates it
            self.experiment_id = ensure_experiment(self.c, experiment, artifact_root)
        self.run_id: str | None = None
        self.artifact_uri: str | None = None  # the run's, once started: checkpoints go there
        self._pending: list[Any] = []
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()  # one writer at a time, so `sync` returns only once all is written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors: list[str] = []
        self.log_time_s = 0.0  # wall time spent writing metrics, on the worker thread
        self.log_time_during_s = 0.0  # the part of it spent while training was still running
        self.handoff_time_s = 0.0  # time the training thread spent handing metrics over
        self.outbox = Outbox(uri)  # writes go through it: to the store, or spooled while it is away

    # -- lifecycle
    def start(self, run_name: str | None, tags: dict[str, str], parent_run_id: str | None = None) -> RunInfo:
        tags = dict(tags)
        if parent_run_id:
            tags["mlflow.parentRunId"] = parent_run_id
        run = self.c.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        self.log_time_s = self.log_time_during_s = self.handoff_time_s = 0.0  # per run (a sweep's worker hosts one run after another)
        self._errors = []
        self.artifact_uri = run.info.artifact_uri
        self.outbox.bind(self.run_id)
        self._stop.clear()
        self._thread = threading.Thread(target=self._work, name="mpsrun-mlflow", daemon=True)
        self._thread.start()
        return RunInfo(self.run_id, self.experiment_id, self.experiment, self.uri)

    def _work(self) -> None:
        while not self._stop.wait(self.interval):
            self._write_pending()
        self._write_pending()

    def _write_pending(self) -> None:
        with self._io_lock:
            self._write_pending_locked()

    def _write_pending_locked(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        if not items:
            if self.outbox.pending():
                self.outbox.try_replay(self.c)
            return
        t = time.perf_counter()
        self.outbox.try_replay(self.c)
        try:
            for chunk in _chunks(items, 1000):
                self.outbox.send(
                    lambda chunk=chunk: self.c.log_batch(self.run_id, metrics=chunk), lambda sp, chunk=chunk: sp.batch(metrics=chunk)
                )
        except Exception as e:  # keep training; reported at the end
            self._errors.append(f"{type(e).__name__}: {e}")
        spent = time.perf_counter() - t
        self.log_time_s += spent
        if not self._stop.is_set():
            self.log_time_during_s += spent

    def flush(self) -> list[str]:
        """Write everything buffered and stop the worker; returns errors it met."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self._write_pending()
        return self._errors

    def sync(self) -> list[str]:
        """Write everything buffered now and keep the worker: a checkpoint calls it so its epoch's metrics are durable first."""
        self._write_pending()
        return self._errors

    def attach(self, run_id: str) -> RunInfo:
        """Continue an existing run (`mpsrun resume`): mark it RUNNING again and start the metric writer."""
        self.c.update_run(run_id, status="RUNNING")
        self.artifact_uri = self.c.get_run(run_id).info.artifact_uri
        self.run_id = run_id
        self.outbox.bind(run_id)
        self._stop.clear()
        self._thread = threading.Thread(target=self._work, name="mpsrun-mlflow", daemon=True)
        self._thread.start()
        return RunInfo(run_id, self.experiment_id, self.experiment, self.uri)

    def claim_owner(self, run_id: str, base: int | None, mine: Any) -> dict[str, Any]:
        """Claim `run_id` for the training process `mine` (an `owner.Claim`), before attaching to it.

        Straight to the store, never spooled: the answer decides whether this process may train.
        """
        from mpsrun.track.store import owner

        return owner.try_claim(self.c, run_id, base, mine)

    def finish(self, status: str, error: BaseException | None = None) -> None:
        """Record the outcome: FINISHED, FAILED (with the error) or KILLED."""
        if error is None:
            self.finish_text(status)
        else:
            msg = f"{type(error).__name__}: {error}"
            tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self.finish_text(status, msg, tb)

    def finish_text(self, status: str, message: str | None = None, tb: str | None = None) -> None:
        """`finish` with the error already rendered: the MLflow helper process gets text, not the exception."""
        self.flush()
        if self.run_id is None:
            return
        if message is not None:
            self.set_tags({"mpsrun.error": message})
            self.log_text(tb or message, "error.txt")
        self.outbox.try_replay(self.c)
        if self.outbox.spooled:
            self.set_tags({"mpsrun.spool": self.outbox.summary()})
        run_id = self.run_id
        self.outbox.send(lambda: self.c.set_terminated(run_id, status), lambda sp: sp.terminate(status))
        if self.outbox.pending():
            assert self.outbox.spool is not None
            self.outbox.note(
                f"run {run_id} ended ({status}) while the tracking store {self.uri} was away: "
                f"{self.outbox.spool.count()} writes wait in {self.outbox.spool.path}; "
                f"when the store answers, replay them with: mpsrun sync --tracking-uri {self.uri}"
            )

    def store_away(self) -> bool:
        """Whether writes are waiting in the spool because the store cannot be reached."""
        return self.outbox.pending()

    def hook(self, name: str, *args: Any) -> Any:
        """Run the record hook `track.hooks.NAME` with this tracker (see train/record.py)."""
        from mpsrun.track.records import hooks

        return getattr(hooks, name)(self, *args)

    # -- data
    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, param_value(v)) for k, v in sorted(params.items())]
        for chunk in _chunks(items, 100):
            self.outbox.send(lambda chunk=chunk: self.c.log_batch(self.run_id, params=chunk), lambda sp, chunk=chunk: sp.batch(params=chunk))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:4900]) for k, v in sorted(tags.items())]
        for chunk in _chunks(items, 100):
            self.outbox.send(lambda chunk=chunk: self.c.log_batch(self.run_id, tags=chunk), lambda sp, chunk=chunk: sp.batch(tags=chunk))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None, timestamp_ms: int | None = None) -> None:
        """Buffered: returns at once; written by the worker (or by `flush`).

        `timestamp_ms`: when they were measured (the MLflow helper gets them a moment later).
        """
        from mlflow.entities import Metric

        t = time.perf_counter()
        ts = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items()]
        with self._lock:
            self._pending.extend(items)
        self.handoff_time_s += time.perf_counter() - t
        if self._thread is None:
            self._write_pending()

    def log_text(self, text: str, name: str) -> None:
        self.outbox.send(lambda: self.c.log_text(self.run_id, text, name), lambda sp: sp.text(text, name))

    def log_file(self, path: str | Path, folder: str | None = None) -> None:
        self.outbox.send(lambda: self.c.log_artifact(self.run_id, str(path), folder), lambda sp: sp.artifact(path, folder))

    def log_state_dict(self, state: dict[str, Any], name: str = "model.pt") -> None:
        import torch

        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / name
            torch.save({k: v.detach().cpu() for k, v in state.items()}, p)
            self.log_file(p)
