"""Runs as `mpsrun runs` and `mpsrun resume` see them: listing, liveness, checkpoint files.

Checkpoint files live in the run's artifacts (`checkpoints/`), so anything that can
reach the tracking store can list, judge and resume a run, from any folder or host.
Into a local artifact store a file is written under a temporary name and renamed
(a half-copied checkpoint is never visible); other stores upload whole objects.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlparse

from mpsrun.track.store import liveness
from mpsrun.track.store.client import client

CHECKPOINTS = "checkpoints"
EPOCHS_DONE_TAG = "mpsrun.epochs_done"  # set at each epoch's end, with its metrics
EPOCHS_DONE = "mpsrun/epochs_done"  # the metric runs before it carried
BEST_TAGS = ("mpsrun.best.monitor", "mpsrun.best.value", "mpsrun.best.epoch")  # set at the end of training
PLANNED = "mpsrun.epochs_planned"


@dataclass
class RunRow:
    """One line of `mpsrun runs`."""

    run_id: str
    experiment: str
    name: str
    status: str  # MLflow's
    shown: str  # what we say: INTERRUPTED for a RUNNING run whose process is gone
    device: str
    epochs_done: int | None
    epochs_planned: int | None
    best: str
    start_time: int | None  # ms since the epoch
    why: str  # how liveness was judged, for RUNNING runs
    resumable: bool
    sweep: str = ""  # a sweep's parent run: its progress, "done/target trials"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def get_run(uri: str, run_id: str) -> Any | None:
    """The run, or None when the store has no run of that id."""
    from mlflow.exceptions import MlflowException

    try:
        return client(uri).get_run(run_id)
    except MlflowException:
        return None


def _int(v: Any) -> int | None:
    try:
        return int(float(v))
    except (TypeError, ValueError):
        return None


def _best(tags: dict[str, str], metrics: dict[str, float]) -> str:
    """"val_loss 0.2413 (epoch 2)": the monitored metric's best (tags; older runs: `mpsrun/best_*` metrics), else the last val_loss."""
    monitor, value, epoch = (tags.get(k) for k in BEST_TAGS)
    if monitor and value:
        return f"{monitor} {float(value):.4g}" + (f" (epoch {epoch})" if epoch else "")
    old = next((k for k in metrics if k.startswith("mpsrun/best_") and k != "mpsrun/best_epoch"), None)
    if old is not None:
        return f"{old.removeprefix('mpsrun/best_')} {metrics[old]:.4g}" + (
            f" (epoch {int(metrics['mpsrun/best_epoch'])})" if "mpsrun/best_epoch" in metrics else "")
    if "val_loss" in metrics:
        return f"val_loss {metrics['val_loss']:.4g} (last)"
    return ""


def row(run: Any, experiment: str) -> RunRow:
    tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
    status = run.info.status
    shown, why = status, ""
    if status == "RUNNING":
        v = liveness.check(tags)
        why = v.reason
        if v.gone:
            shown = "INTERRUPTED"
    best = _best(tags, metrics)
    has_ckpt = "mpsrun.checkpoint.epoch" in tags
    sweep = ""
    if tags.get("mpsrun.sweep") == "parent":  # written by mpsrun.sweep.parent (track knows only the tag names)
        sweep = f"{tags.get('mpsrun.sweep.progress', '0/' + tags.get('mpsrun.sweep.trials', '?'))} trials"
        if "best_value" in metrics:
            best = f"{tags.get('mpsrun.sweep.metric', 'best')} {metrics['best_value']:.4g} (trial {tags.get('mpsrun.sweep.best_trial', '?')})"
        done, _, target = tags.get("mpsrun.sweep.progress", "0/1").partition("/")
        unfinished = not (done.isdigit() and target.isdigit() and int(done) >= int(target))
        has_ckpt = shown in ("INTERRUPTED", "KILLED", "FAILED") or (unfinished and shown != "RUNNING")
    return RunRow(
        run_id=run.info.run_id,
        experiment=experiment,
        name=run.info.run_name or "",
        status=status,
        shown=shown,
        device=tags.get("device.actual", ""),
        epochs_done=_int(tags.get(EPOCHS_DONE_TAG, metrics.get(EPOCHS_DONE))),
        epochs_planned=_int(tags.get(PLANNED, params.get("epochs"))),
        best=best,
        start_time=run.info.start_time,
        why=why,
        resumable=has_ckpt and (shown in ("INTERRUPTED", "KILLED", "FAILED") or bool(sweep)),
        sweep=sweep,
    )


def list_runs(uri: str, experiment: str | None = None, limit: int = 20) -> list[RunRow]:
    """Recent runs, newest first; `experiment` narrows to one (None when it does not exist: caller says so)."""
    c = client(uri)
    if experiment is not None:
        exp = c.get_experiment_by_name(experiment)
        if exp is None:
            raise LookupError(experiment)
        exps = [exp]
    else:
        exps = c.search_experiments()
    names = {e.experiment_id: e.name for e in exps}
    if not names:
        return []
    runs = c.search_runs(list(names), order_by=["attributes.start_time DESC"], max_results=limit)
    return [row(r, names.get(r.info.experiment_id, r.info.experiment_id)) for r in runs]


def experiment_names(uri: str) -> list[str]:
    return [e.name for e in client(uri).search_experiments()]


# ----------------------------------------------------------------------------- artifacts


def _local_dir(artifact_uri: str) -> Path | None:
    """The folder of a local artifact store, or None for a remote one."""
    u = urlparse(artifact_uri)
    if u.scheme == "file":
        return Path(unquote(u.path))
    if u.scheme == "" or (len(u.scheme) == 1 and os.name == "nt"):
        return Path(artifact_uri)
    return None


def whole(path: Path) -> bool:
    """Whether a checkpoint file is complete: `torch.save` writes a zip archive, whose directory is at its
    very end, so a truncated file has none (read without torch, in a moment)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            return bool(z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


class RunFiles:
    """A run's checkpoint files in its artifacts: atomic puts, deletes where the store allows, downloads."""

    def __init__(self, uri: str, run_id: str, artifact_uri: str | None = None, log_artifact: Callable[[str, str], None] | None = None) -> None:
        """`artifact_uri` and `log_artifact(path, folder)` where the caller has them (the run's tracker,
        perhaps in the MLflow helper process): then puts and deletes need no MLflow client here."""
        self.uri = uri
        self.run_id = run_id
        self._c: Any = None
        self._log_artifact = log_artifact
        self.artifact_uri = artifact_uri or self.c.get_run(run_id).info.artifact_uri
        self.local = _local_dir(self.artifact_uri)

    @property
    def c(self) -> Any:
        if self._c is None:
            self._c = client(self.uri)
        return self._c

    def put(self, path: Path, name: str) -> None:
        if self.local is not None:
            folder = self.local / CHECKPOINTS
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{name}.{os.getpid()}.part"
            shutil.copyfile(path, tmp)
            if tmp.stat().st_size != path.stat().st_size or not whole(tmp):  # verified before it replaces the old one
                tmp.unlink(missing_ok=True)
                raise OSError(f"the copy of {name} into {folder} is not whole; the previous {name} stays")
            os.replace(tmp, folder / name)
        else:
            if path.name != name:
                raise ValueError(f"upload name {name} differs from the file's {path.name}")
            if self._log_artifact is not None:
                self._log_artifact(str(path), CHECKPOINTS)
            else:
                self.c.log_artifact(self.run_id, str(path), CHECKPOINTS)

    def rotate(self, name: str, keep_as: str) -> bool:
        """Before a new `name` is put: keep the current one as `keep_as`, if it is whole (a local store:
        a rename). False where the store cannot rename; the caller uploads its own copy instead."""
        if self.local is None:
            return False
        current = self.local / CHECKPOINTS / name
        if current.is_file() and whole(current):  # a damaged one never replaces a good `keep_as`
            os.replace(current, self.local / CHECKPOINTS / keep_as)
        return True

    def remove(self, name: str) -> bool:
        if self.local is None:
            return False
        (self.local / CHECKPOINTS / name).unlink(missing_ok=True)
        return True

    def names(self) -> list[str]:
        try:
            return [Path(f.path).name for f in self.c.list_artifacts(self.run_id, CHECKPOINTS)]
        except Exception:  # noqa: BLE001 - no folder yet
            return []

    def download(self, artifact_path: str, dst: Path) -> Path | None:
        """Fetch one artifact into `dst`; None when the run has no such file."""
        parent = str(Path(artifact_path).parent)
        present = [f.path for f in self.c.list_artifacts(self.run_id, None if parent == "." else parent)]
        if artifact_path not in present:
            return None
        dst.mkdir(parents=True, exist_ok=True)
        return Path(self.c.download_artifacts(self.run_id, artifact_path, str(dst)))
