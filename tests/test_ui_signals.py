"""`mpsrun ui` with no flags browses the default store `mpsrun run` wrote; stopped by a signal,
the MLflow server it started goes too, the port is freed, and the exit code says which signal
(130 SIGINT, 143 SIGTERM). Real processes, real signals.

One `mpsrun ui` serves both checks: starting its MLflow server is most of a test's time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from typing import Any

import pytest

from .conftest import RECIPES
from .proc_helpers import MPSRUN, alive, clean_env, descendants, free_port, port_free, wait_http


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=15) as r:
            return r.status == 200
    except OSError:
        return False


def _experiment_names(port: int, timeout: float = 60) -> list[str]:
    """The experiments the UI's server lists (the page's own API call)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/search",
        data=b'{"max_results": 10}', headers={"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return [e["name"] for e in json.load(r)["experiments"]]
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143)])  # SIGINT (130) takes the same path
def test_ui_serves_the_default_store_and_a_signal_stops_the_server_and_frees_the_port(work: Any, sig: int, code: int) -> None:
    assert work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=1", "-q").exit_code == 0
    port = free_port()
    (exp_id,) = {r.info.experiment_id for r in work.runs("digits_mlp")}
    proc = subprocess.Popen([MPSRUN, "ui", "--port", str(port)], cwd=work.path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[str, bool]] = []  # each line of stdout, and whether the server answered when it arrived

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append((line.rstrip("\n"), _answers(port)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert wait_http(f"http://127.0.0.1:{port}/health", 120, proc), proc.communicate(timeout=5)
        said = lambda: [x for x in lines if x[0].startswith("MLflow UI: ")]  # noqa: E731  (the server's own lines interleave)
        deadline = time.monotonic() + 30
        while not said() and time.monotonic() < deadline:
            time.sleep(0.1)
        # "starting..." at once, before the server answers; the link only once it does, to the experiment's runs
        assert lines and lines[0][0].startswith("starting the MLflow UI") and not lines[0][1], lines
        link = f"http://127.0.0.1:{port}/#/experiments/{exp_id}/runs"
        ((text, answered),) = said()
        assert link in text and answered, lines
        # no flags: the store `mpsrun run` wrote in this folder (./mlruns) is the one browsed
        assert "digits_mlp" in _experiment_names(port)
        tree = descendants(proc.pid)
        assert tree, "the server should run as a child of mpsrun ui"
        assert not port_free(port)
        t = time.monotonic()
        proc.send_signal(sig)  # only mpsrun itself: it must pass the signal on
        proc.wait(timeout=60)
        reader.join(timeout=10)
        out, err = "\n".join(line for line, _ in lines), proc.stderr.read()  # type: ignore[union-attr]
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
