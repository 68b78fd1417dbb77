"""The MLflow UI server that `mpsrun ui` starts, and how it is stopped: leaving nothing behind.

Why. `mlflow ui` is a process tree (the mlflow CLI, then uvicorn or gunicorn with
workers). `subprocess.call` left it running, orphaned and holding the port, when
`mpsrun ui` itself got SIGTERM (`docker stop`, Slurm, a closed terminal), and a
Ctrl-C reached the tree only because the terminal happened to signal the whole
foreground group. So the server runs in a session (process group) of its own,
and on SIGINT or SIGTERM mpsrun stops that whole group (SIGTERM, the server's
graceful shutdown), waits for it to exit (SIGKILL after a grace period), and exits
130 or 143 like every other command.

The URL is printed only once the server answers (`/health`): a link printed at once led to
"connection refused". It opens the experiment's training runs (`experiment_page`). The server
is MLflow's `server` with one worker in one process (`track.ui_app`, which says why: `mlflow ui`
took 14 to 30 s to answer on the 2-core machine); its stdout and stderr go to a log file whose
path is said (`log_path`), so the screen holds mpsrun's lines only, and the log's last lines are
said if the server ends before answering.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import closing
from pathlib import Path
from types import FrameType
from typing import Callable, Optional

from mpsrun.track.store.lock import sqlite_path

GRACE_S = 10.0  # after forwarding a signal, how long the server may take before SIGKILL
EXIT_BY_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def command(uri: str, artifacts: str | None, host: str, port: int) -> list[str]:
    """MLflow's `server` with one worker, run by `track.ui_app` in one process (why: its docstring)."""
    cmd = [sys.executable, "-m", "mpsrun.track.ui_app", "--backend-store-uri", uri, "--host", host, "--port", str(port), "--workers", "1"]
    if artifacts:
        cmd += ["--default-artifact-root", artifacts]
    return cmd


def log_path(uri: str, port: int) -> Path:
    """Where the server's own output goes: beside a SQLite store (`mlruns/mlflow-ui-PORT.log`), else the temp folder.

    Why a file: uvicorn's and MLflow's lines (a second "running on" URL before the server answers,
    deprecation warnings, a line per request) buried the one line a user needs; the file keeps them
    for when something goes wrong, and its path is said on screen.
    """
    name = f"mlflow-ui-{port}.log"
    db = sqlite_path(uri)
    if db is not None and os.access(db.parent, os.W_OK):
        return db.parent / name
    return Path(tempfile.gettempdir()) / f"mpsrun-{name}"


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of the server's log (said when it exits before answering)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def experiment_page(base_url: str, experiment_id: str | None) -> str:
    """The UI's page of an experiment's training runs (its home page without one)."""
    return f"{base_url}/#/experiments/{experiment_id}/runs" if experiment_id is not None else base_url


def choose_experiment(uri: str, name: str | None) -> tuple[str, str]:
    """(id, name) of the experiment to open: `name`; else the one with the most recent run; else Default.

    LookupError(name) when `name` is not in the store.
    """
    db = sqlite_path(uri)
    if db is not None:
        try:
            return _choose_in_sqlite(db, name)
        except sqlite3.Error:  # not MLflow's tables as expected: ask MLflow
            pass
    from mpsrun.track.store.client import client

    c = client(uri)
    if name is not None:
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise LookupError(name)
        return exp.experiment_id, exp.name
    exps = {e.experiment_id: e.name for e in c.search_experiments()}
    if exps:
        latest = c.search_runs(list(exps), max_results=1, order_by=["attributes.start_time DESC"])
        if latest:
            eid = latest[0].info.experiment_id
            return eid, exps[eid]
    default = c.get_experiment_by_name("Default")
    return (default.experiment_id, default.name) if default is not None else ("0", "Default")


def _read_only(db: Path) -> "closing[sqlite3.Connection]":
    """A read-only connection to the store's database, closed on leaving the `with`."""
    return closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10))


def _choose_in_sqlite(db: Path, name: str | None) -> tuple[str, str]:
    """`choose_experiment` read straight from a SQLite store, read-only: active experiments and runs, as MLflow's
    searches list them by default.

    Why not MLflowClient: importing MLflow and opening the store through it took seconds of the 2-core
    machine's CPU while the server, on the other core, was starting; the link waited for both.
    """
    with _read_only(db) as con:
        if name is not None:
            row = con.execute("SELECT experiment_id, name FROM experiments WHERE name = ? AND lifecycle_stage = 'active'", (name,)).fetchone()
            if row is None:
                raise LookupError(name)
            return str(row[0]), row[1]
        row = con.execute(
            "SELECT e.experiment_id, e.name FROM runs r JOIN experiments e ON r.experiment_id = e.experiment_id "
            "WHERE e.lifecycle_stage = 'active' AND r.lifecycle_stage = 'active' ORDER BY r.start_time DESC LIMIT 1"
        ).fetchone()
        if row is None:
            row = con.execute("SELECT experiment_id, name FROM experiments WHERE name = 'Default'").fetchone()
        return (str(row[0]), row[1]) if row is not None else ("0", "Default")


def experiment_names(uri: str) -> list[str]:
    """The active experiments' names (for a did-you-mean); a SQLite store read without MLflow, as `choose_experiment`."""
    db = sqlite_path(uri)
    if db is not None:
        try:
            with _read_only(db) as con:
                return [r[0] for r in con.execute("SELECT name FROM experiments WHERE lifecycle_stage = 'active'")]
        except sqlite3.Error:
            pass
    from mpsrun.track.store.runs import experiment_names as names

    return names(uri)


def warm(uri: str) -> None:
    """Import MLflow's client while the server starts, so the link follows its first answer closely; not for a
    SQLite store, which is read without MLflow (`_choose_in_sqlite`)."""
    if sqlite_path(uri) is None:
        from mlflow.tracking import MlflowClient  # noqa: F401


def store_exists(uri: str) -> bool:
    """Whether the store can be read before the server has started: not a SQLite file yet to be created
    (the server creates it; a second process creating it at the same time could collide)."""
    db = sqlite_path(uri)
    return db is None or db.exists()


def answers(url: str, timeout: float = 1.0) -> bool:
    """Whether the server at `url` answers its health check with 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop_group(proc: subprocess.Popen, sig: int, grace: float = GRACE_S) -> None:
    """Send `sig` to the server's whole group; SIGKILL whatever is left after `grace` seconds."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    _signal_group(pgid, sig)
    deadline = time.monotonic() + grace
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)
    proc.wait()
    while _group_alive(pgid) and time.monotonic() < deadline + 5:  # reaped by init: wait until gone
        time.sleep(0.05)


def serve(cmd: list[str], url: Optional[str] = None, on_ready: Optional[Callable[[], None]] = None,
          on_started: Optional[Callable[[], None]] = None, log: Optional[Path] = None) -> int:
    """Run the server until it exits or we get SIGINT/SIGTERM; the exit code to use.

    `on_started` runs once the server process is started (work to do while it starts up, e.g.
    choosing the experiment; an exception from it stops the server and is raised); `on_ready`
    once `url` answers its health check. The server's stdout and stderr go to `log` (this
    process's own when None). The server's own exit code when it stops by itself;
    130 (SIGINT) or 143 (SIGTERM) when stopped, after the whole process group is gone and the
    port is free.
    """
    got: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in EXIT_BY_SIGNAL}
    out = open(log, "w") if log is not None else None
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the log follows the server as it goes, not in 8 KiB blocks
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else None, env=env)
        try:
            if on_started is not None:
                on_started()
            ready = url is None
            while not got:
                try:
                    code = proc.wait(timeout=0.2 if ready else 0.1)
                except subprocess.TimeoutExpired:
                    if not ready and answers(url):  # type: ignore[arg-type]
                        ready = True
                        if on_ready is not None:
                            on_ready()
                    continue
                stop_group(proc, signal.SIGTERM, grace=2.0)  # the leader exited: no worker may outlive it
                return code
            # The server is always asked to stop with SIGTERM: its graceful shutdown. (Given
            # SIGINT, the mlflow CLI's threads print KeyboardInterrupt tracebacks.)
            stop_group(proc, signal.SIGTERM)
            return EXIT_BY_SIGNAL[signal.Signals(got[0])]
        except BaseException:
            stop_group(proc, signal.SIGTERM)
            raise
    finally:
        if out is not None:
            out.close()
        for s, h in old.items():
            signal.signal(s, h)
