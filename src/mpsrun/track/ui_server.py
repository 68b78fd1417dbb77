"""The MLflow UI server that `mpsrun ui` starts, and how it is stopped: leaving nothing behind.

Why. `mlflow ui` is a process tree (the mlflow CLI, then uvicorn or gunicorn with
workers). `subprocess.call` left it running, orphaned and holding the port, when
`mpsrun ui` itself got SIGTERM (`docker stop`, Slurm, a closed terminal), and a
Ctrl-C reached the tree only because the terminal happened to signal the whole
foreground group. So the server runs in a session (process group) of its own,
and on SIGINT or SIGTERM mpsrun stops that whole group (SIGTERM, the server's
graceful shutdown), waits for it to exit (SIGKILL after a grace period), and exits
130 or 143 like every other command.

The URL is printed only once the server answers (`/health`): `mlflow ui` takes tens of
seconds to start on a small machine, and a link printed at once led to "connection
refused". It opens the experiment's training runs (`experiment_page`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from types import FrameType
from typing import Callable, Optional

GRACE_S = 10.0  # after forwarding a signal, how long the server may take before SIGKILL
EXIT_BY_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def command(uri: str, artifacts: str | None, host: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    if artifacts:
        cmd += ["--default-artifact-root", artifacts]
    return cmd


def experiment_page(base_url: str, experiment_id: str | None) -> str:
    """The UI's page of an experiment's training runs (its home page without one)."""
    return f"{base_url}/#/experiments/{experiment_id}/runs" if experiment_id is not None else base_url


def choose_experiment(uri: str, name: str | None) -> tuple[str, str]:
    """(id, name) of the experiment to open: `name`; else the one with the most recent run; else Default.

    LookupError(name) when `name` is not in the store.
    """
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


def warm() -> None:
    """Import MLflow's client while the server starts, so the link follows its first answer closely."""
    from mlflow.tracking import MlflowClient  # noqa: F401


def store_exists(uri: str) -> bool:
    """Whether the store can be read before the server has started: not a SQLite file yet to be created
    (the server creates it; a second process creating it at the same time could collide)."""
    if uri.startswith("sqlite:///"):
        return os.path.exists(uri.removeprefix("sqlite:///"))
    return True


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
          on_started: Optional[Callable[[], None]] = None) -> int:
    """Run the server until it exits or we get SIGINT/SIGTERM; the exit code to use.

    `on_started` runs once the server process is started (work to do while it starts up, e.g.
    choosing the experiment; an exception from it stops the server and is raised); `on_ready`
    once `url` answers its health check. The server's own exit code when it stops by itself;
    130 (SIGINT) or 143 (SIGTERM) when stopped, after the whole process group is gone and the
    port is free.
    """
    got: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in EXIT_BY_SIGNAL}
    try:
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            if on_started is not None:
                on_started()
            ready = url is None
            while not got:
                try:
                    code = proc.wait(timeout=0.2)
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
        for s, h in old.items():
            signal.signal(s, h)
