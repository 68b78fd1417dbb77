"""The MLflow UI server that `mpsrun ui` starts, and how it is stopped: leaving nothing behind.

Why. `mlflow ui` is a process tree (the mlflow CLI, then uvicorn or gunicorn with
workers). `subprocess.call` left it running, orphaned and holding the port, when
`mpsrun ui` itself got SIGTERM (`docker stop`, Slurm, a closed terminal), and a
Ctrl-C reached the tree only because the terminal happened to signal the whole
foreground group. So the server runs in a session (process group) of its own,
and on SIGINT or SIGTERM mpsrun stops that whole group (SIGTERM, the server's
graceful shutdown), waits for it to exit (SIGKILL after a grace period), and exits
130 or 143 like every other command.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

GRACE_S = 10.0  # after forwarding a signal, how long the server may take before SIGKILL
EXIT_BY_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def command(uri: str, artifacts: str | None, host: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    if artifacts:
        cmd += ["--default-artifact-root", artifacts]
    return cmd


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


def serve(cmd: list[str]) -> int:
    """Run the server until it exits or we get SIGINT/SIGTERM; the exit code to use.

    The server's own exit code when it stops by itself; 130 (SIGINT) or 143 (SIGTERM)
    when stopped, after the whole process group is gone and the port is free.
    """
    got: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    old = {s: signal.signal(s, on_signal) for s in EXIT_BY_SIGNAL}
    try:
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            while not got:
                try:
                    code = proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
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
