"""Where a study lives and who may count in it: Optuna storages, lost trials, the trial budget.

Default: a journal file beside the MLflow store (`mlruns/optuna.journal` for the embedded
store, `./optuna.journal` for a server), which any number of processes on this machine
share. `--storage postgresql://...` (or any SQLAlchemy URL) is Optuna's RDBStorage, which
workers on other machines join; its heartbeat fails the trials of a worker that stopped
beating (a lost machine) and retries them.

A trial whose process died (kill -9) is found two ways: on this machine by its pid
(`mpsrun.host`/`mpsrun.pid`/`mpsrun.pid_start`, the liveness tags runs carry, as trial
attributes), and through Optuna's heartbeat for RDB storages. Either way it is failed,
marked `mpsrun.lost` (it does not count towards `trials`) and enqueued again with the
same parameters. `trials` counts COMPLETE, PRUNED, and FAILED trials that failed by
their own doing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from mpsrun.track.store import liveness

LOST = "mpsrun.lost"  # user attr: why the trial was failed for it (worker died, interrupted): not counted
RETRY_OF = "mpsrun.retry_of"  # user attr: the lost trial this one repeats
SURPLUS = "mpsrun.surplus"  # user attr: asked for after the budget was reached by another worker
RUN_ID = "mpsrun.run_id"  # user attr: the trial's MLflow run
PARENT = "mpsrun.parent_run_id"  # study user attr: the sweep's MLflow parent run
HEARTBEAT_S = 10
GRACE_S = 40


def default_url(tracking_uri: str) -> str:
    """A journal file beside the MLflow store (the embedded store's folder, else the working folder)."""
    if tracking_uri.startswith("sqlite:///"):
        folder = Path(tracking_uri.removeprefix("sqlite:///")).parent
    else:
        folder = Path.cwd()
    return f"journal:{folder / 'optuna.journal'}"


def shown(url: str) -> str:
    """The URL without a password, for tags and the screen."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        return f"{scheme}://{cred.split(':', 1)[0]}@{host}"
    return url


def _sqlalchemy_url(url: str) -> str:
    """`postgresql://` means psycopg2 to SQLAlchemy; use psycopg 3 where that is what is installed."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        import importlib.util

        if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def _quiet_heartbeat_warnings() -> None:
    """Optuna warns that its heartbeat is experimental and meant for `study.optimize`; the ask/tell
    loop here runs Optuna's own heartbeat thread per trial (`heartbeat_thread`), so users are not told."""
    import warnings

    from optuna.exceptions import ExperimentalWarning

    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    warnings.filterwarnings("ignore", category=ExperimentalWarning, message=".*(heartbeat|fail_stale_trials).*")


def open_storage(url: str, on_failed: Callable[[Any, Any], None] | None = None, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> Any:
    """An Optuna storage for `url` (journal:PATH, or a database URL with a heartbeat)."""
    import optuna

    _quiet_heartbeat_warnings()
    if url.startswith("journal:"):
        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = optuna.storages.journal.JournalFileBackend(str(path), lock_obj=_open_lock()(str(path)))
        return optuna.storages.JournalStorage(backend)

    def failed(study: Any, trial: Any) -> None:  # Optuna's heartbeat failed it: ours to retry and account for
        mark_lost(study, trial, "its worker stopped sending heartbeats (process or machine lost)", already_failed=True)
        if on_failed is not None:
            on_failed(study, trial)

    import inspect

    # Optuna 4.9 renamed the callback (the old name warns); either is called with the trial already FAILED.
    params = inspect.signature(optuna.storages.RDBStorage.__init__).parameters
    callback = {"heartbeat_stale_trial_callback": failed} if "heartbeat_stale_trial_callback" in params else {"failed_trial_callback": failed}
    return optuna.storages.RDBStorage(
        _sqlalchemy_url(url), heartbeat_interval=heartbeat_s, grace_period=grace_s, engine_kwargs={"pool_pre_ping": True}, **callback,
    )


LOCK_POLL_S = 0.002  # the longest sleep between two tries for the journal's lock file


def _open_lock() -> type:
    """Optuna's JournalFileOpenLock (the same lock file, so any Optuna process on the journal is excluded alike),
    polled every few milliseconds instead of with Optuna's backoff, which doubles each sleep up to one second.

    Why: the lock is held for milliseconds, but a worker that found it taken a few times in a row then slept
    0.25-1 s while it was free; N workers asking, reporting and telling on one journal queued behind those
    sleeps, which is contention the GPU cannot hide. A lock left by a killed process is still broken after
    Optuna's grace period (its file's mtime unchanged for 30 s).
    """
    import errno
    import os
    import time

    from optuna.storages.journal import JournalFileOpenLock

    class PolledOpenLock(JournalFileOpenLock):  # type: ignore[misc]
        def acquire(self) -> bool:
            mtime, since = None, time.monotonic()
            while True:
                try:
                    os.close(os.open(self._lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    return True
                except OSError as err:
                    if err.errno != errno.EEXIST:
                        raise
                try:
                    now_mtime = os.stat(self._lock_file).st_mtime
                except OSError:
                    continue  # released meanwhile
                if now_mtime != mtime:
                    mtime, since = now_mtime, time.monotonic()
                elif self.grace_period is not None and time.monotonic() - since > self.grace_period:
                    try:
                        self.release()  # its holder died holding it
                    except RuntimeError:
                        pass
                    continue
                time.sleep(LOCK_POLL_S)

    return PolledOpenLock


def lost_trials(study: Any) -> dict[int, str]:
    """Trial number -> why it was lost. Kept on the study as well as the trial: a trial Optuna's
    heartbeat already failed can take no more attributes (finished trials are immutable)."""
    attrs = study.user_attrs
    return {int(k.rsplit(".", 1)[1]): str(v) for k, v in attrs.items() if k.startswith(LOST + ".") and k.rsplit(".", 1)[1].isdigit()}


def why_lost(trial: Any, lost: dict[int, str]) -> str | None:
    return trial.user_attrs.get(LOST) or lost.get(trial.number)


def counted(trial: Any, lost: dict[int, str]) -> bool:
    from optuna.trial import TrialState

    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and why_lost(trial, lost) is None and SURPLUS not in trial.user_attrs


def mark_lost(study: Any, trial: Any, why: str, already_failed: bool = False) -> None:
    """Fail a trial that did not fail by its own doing, keep it out of the count, and queue it again."""
    from optuna.trial import TrialState

    storage = study._storage
    tid = trial._trial_id
    study.set_user_attr(f"{LOST}.{trial.number}", why)  # first: the count must never include it
    if not already_failed:
        try:
            storage.set_trial_user_attr(tid, LOST, why)
            storage.set_trial_state_values(tid, TrialState.FAIL)
        except Exception:  # noqa: BLE001 - another worker failed it first (it is finished now)
            return
    if trial.params:
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number}, skip_if_exists=False)


def fail_bad_input(study: Any, t: Any) -> None:
    """A trial the sweep's bad input stopped before training: failed, not counted (the command exits 2)."""
    from optuna.trial import TrialState

    t.set_user_attr(LOST, "bad input: the sweep stopped before training")
    study.set_user_attr(f"{LOST}.{t.number}", "bad input: the sweep stopped before training")
    study.tell(t, state=TrialState.FAIL)


def lost_run(t: Any, why: str, on_lost_run: Callable[[str, str], None]) -> None:
    """A lost trial's MLflow run, where it kept its id, handed to `on_lost_run(run_id, why)`."""
    run_id = t.user_attrs.get(RUN_ID)
    if run_id:
        on_lost_run(run_id, why)


def reap(study: Any, on_lost: Callable[[Any, str], None]) -> int:
    """Fail the RUNNING trials whose process on this machine is gone; `on_lost(trial, why)` for each."""
    from optuna.trial import TrialState

    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        tags = {k: str(v) for k, v in t.user_attrs.items() if k.startswith("mpsrun.")}
        v = liveness.check(tags)
        if not v.gone or tags.get(liveness.HOST) != liveness.identity()[liveness.HOST]:
            continue  # alive, or on another machine: that is the heartbeat's to judge
        mark_lost(study, t, f"its worker died ({v.reason})")
        on_lost(t, v.reason)
        n += 1
    if hasattr(study._storage, "fail_stale_trials") or hasattr(study._storage, "record_heartbeat"):
        import optuna

        if optuna.storages._heartbeat.is_heartbeat_enabled(study._storage):  # noqa: SLF001 - no public way to ask
            optuna.storages.fail_stale_trials(study)
    return n


def me() -> dict[str, str]:
    """This worker, as trial attributes (the same fields runs carry)."""
    ident = liveness.identity()
    return {k: ident[k] for k in (liveness.HOST, liveness.PID, liveness.PID_START)}


def budget(study: Any, target: int) -> tuple[int, int]:
    """(counted trials, trials running now) in the study."""
    from optuna.trial import TrialState

    trials, lost = study.get_trials(deepcopy=False), lost_trials(study)
    return sum(1 for t in trials if counted(t, lost)), sum(1 for t in trials if t.state == TrialState.RUNNING)


def over_budget(study: Any, trial: Any, target: int) -> bool:
    """Whether `trial` (just asked) is beyond the first `target` trials that count or run (a race between workers)."""
    from optuna.trial import TrialState

    lost = lost_trials(study)
    alive = sorted(t.number for t in study.get_trials(deepcopy=False) if counted(t, lost) or t.state == TrialState.RUNNING)
    return trial.number not in alive[:target]


def ask(study: Any, target: int) -> Any | None:
    """A new trial, marked as this worker's (`me`); None where other workers took the budget's last place at the same
    moment: that trial is then failed as surplus (SURPLUS says why; not counted) and this worker asks no more."""
    from optuna.trial import TrialState

    t = study.ask()
    for k, v in me().items():
        t.set_user_attr(k, v)
    if not over_budget(study, t, target):
        return t
    t.set_user_attr(SURPLUS, "the budget was reached by other workers")
    study.tell(t, state=TrialState.FAIL)
    return None


def heartbeat_thread(study: Any, trial_id: int) -> Any:
    """Optuna's own heartbeat for a trial asked outside `study.optimize` (RDB storages); a no-op elsewhere."""
    import optuna

    thread = optuna.storages._heartbeat.get_heartbeat_thread(trial_id, study._storage)  # noqa: SLF001 - ask/tell has no public one
    thread.start()
    return thread

