"""The MLflow UI server that `mpsrun ui` starts: `mlflow server`, one worker, in one process.

    python -m mpsrun.track.ui_app --backend-store-uri URI --host 127.0.0.1 --port 5000 [mlflow server options]

Why not `mlflow ui`. On the 2-core machine it took 14 to 30 s to answer (mpsrun 307428c: 27 s): the
mlflow CLI imports MLflow and opens the store, then starts uvicorn, which starts four workers that each
import MLflow and its server again, while MLflow's job runner starts its own processes (huey consumers)
for GenAI jobs a training-runs browser never uses. One person browsing needs one worker, and the
process that opened the store can serve it. So this runs MLflow's own `server` command (its options,
defaults, security middleware, store set-up), with:

- job execution off (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`, unless the environment sets it);
- the uvicorn command it would start run here instead (`uvicorn.main` with the same arguments and
  environment): no second interpreter, no second import of MLflow, the opened store reused. With
  `--workers` above 1, or a MLflow whose server does not start uvicorn through `_exec_cmd`, the
  command is started as MLflow starts it (slower, the same server).

Measured on the 2-core machine, 2026-11-28, shared with other work (load average 6 to 11): the server
alone to its first 200 of `/` (median of 2): `mlflow ui` 14.0 s; with `--workers 1` 19.0 s (the job
runner's processes still start); plus job execution off 6.2 s; this module 2.9 s. The whole `mpsrun ui`
(`benchmarks/ui_start.py --repeats 5 --compare`, alternating with 307428c): the page answered after a
median 29.8 s before (13.8 to 55.5), 4.95 s after (3.2 to 7.6).

It also stops when `mpsrun ui` is gone however it ended (SIGKILL included): a watcher thread sees the
parent change and ends this process with SIGTERM, uvicorn's graceful shutdown, so no server is orphaned.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

JOBS_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


class _Finished:
    """What MLflow's `_run_server` expects back from starting the server: it waits on it after the server stopped."""

    returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: Any = None) -> int:
        return 0

    def send_signal(self, signum: int) -> None:
        pass


def _uvicorn_here(real: Any) -> Any:
    """A stand-in for `mlflow.server._exec_cmd` that runs a one-worker uvicorn command in this process."""

    def start(cmd: list[str], extra_env: Any = None, **kwargs: Any) -> Any:
        args = [str(a) for a in cmd]
        if args[1:3] != ["-m", "uvicorn"] or _workers(args) != 1:
            return real(cmd, extra_env=extra_env, **kwargs)
        os.environ.update({k: str(v) for k, v in (extra_env or {}).items()})  # what the worker would have been given
        import uvicorn.main

        uvicorn.main.main(args=args[3:], prog_name="uvicorn", standalone_mode=False)
        return _Finished()

    return start


def _workers(args: list[str]) -> int:
    for i, a in enumerate(args):
        if a == "--workers" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--workers="):
            return int(a.split("=", 1)[1])
    return 1


def _watch_parent(parent: int) -> None:
    """SIGTERM to this process once its parent (`mpsrun ui`) is gone: re-parented, the server would be an orphan."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="mpsrun-ui-parent", daemon=True).start()


def main(argv: list[str]) -> None:
    os.environ.setdefault(JOBS_ENV, "false")
    _watch_parent(os.getppid())
    import mlflow.server as server
    from mlflow.cli import cli

    real = getattr(server, "_exec_cmd", None)
    if real is not None:
        server._exec_cmd = _uvicorn_here(real)  # type: ignore[attr-defined]
    cli.main(args=["server", *argv], prog_name="mlflow")


if __name__ == "__main__":
    main(sys.argv[1:])
