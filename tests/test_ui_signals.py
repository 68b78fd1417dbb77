"""`mpsrun ui` stopped by a signal: the MLflow server it started goes too, the port is freed,
and the exit code says which signal (130 SIGINT, 143 SIGTERM). Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .proc_helpers import MPSRUN, alive, clean_env, descendants, free_port, port_free, wait_http


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143)])  # SIGINT (130) takes the same path
def test_ui_signal_stops_the_server_and_frees_the_port(tmp_path: Path, template_db: Path, sig: int, code: int) -> None:
    import shutil

    (tmp_path / "mlruns").mkdir()
    shutil.copy(template_db, tmp_path / "mlruns" / "mlflow.db")
    port = free_port()
    proc = subprocess.Popen([MPSRUN, "ui", "--port", str(port)], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_http(f"http://127.0.0.1:{port}/health", 120, proc), proc.communicate(timeout=5)
        tree = descendants(proc.pid)
        assert tree, "the server should run as a child of mpsrun ui"
        assert not port_free(port)
        t = time.monotonic()
        proc.send_signal(sig)  # only mpsrun itself: it must pass the signal on
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == code, out + err
        assert time.monotonic() - t < 30
        deadline = time.monotonic() + 10
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in tree if alive(p)], "orphaned server processes"
        assert port_free(port)
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in descendants(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
