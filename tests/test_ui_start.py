"""`mpsrun ui` as a process, with no browser: what it prints, where its server's output goes, how it stops.

The real `python -m mpsrun ui` in a folder holding a store with one run (./mlruns, no flags), its
stdout and stderr read apart. The screen must hold mpsrun's lines only: "starting..." with the
server log's path, then exactly one link, once the server answers an HTTP request; uvicorn's and
MLflow's lines (its own "Uvicorn running on" URL, deprecation warnings, request lines) go to the
log file. Ctrl-C as a terminal sends it (SIGINT to mpsrun's process group) and SIGTERM stop the
server's whole group and free the port; a killed `mpsrun ui` leaves no server behind; a server
that cannot start is said with its log's last lines. Starting MLflow's server is most of the
time: the UIs that these tests need start side by side in one fixture.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.proc_helpers import alive, descendants, free_port, port_free

SERVER_WORDS = ("uvicorn", "starlette", "info:", "waiting for application", "application startup", "started server process",
                "security middleware", "registry store uri", "deprecat")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


class Ui:
    """One `mpsrun ui --port P` in `folder`, in a process group of its own (as a shell starts a foreground job)."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder, self.port, self.url = folder, port, f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.setdefault("OMP_NUM_THREADS", "1")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "mpsrun", "ui", "--port", str(port)], cwd=folder, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out: list[tuple[str, bool]] = []  # each stdout line, and whether the server answered when it came
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read_out, daemon=True), threading.Thread(target=self._read_err, daemon=True)]
        for t in self.readers:
            t.start()

    def _read_out(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.out.append((line.rstrip("\n"), _answers(self.url)))

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.err.append(line.rstrip("\n"))

    def links(self) -> list[tuple[str, bool]]:
        return [x for x in self.out if x[0].startswith("MLflow UI: ")]

    def wait_link(self, timeout: float = 120) -> float:
        while not self.links():
            assert self.proc.poll() is None, f"mpsrun ui exited {self.proc.returncode}: {self.screen()}"
            assert time.monotonic() - self.t0 < timeout, f"no link in {timeout} s: {self.screen()}"
            time.sleep(0.05)
        return time.monotonic() - self.t0

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self.readers:
            t.join(10)
        return code

    def screen(self) -> str:
        return "\n".join([x for x, _ in self.out] + self.err)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _folder(base: Path, template_db: Path) -> Path:
    (base / "mlruns").mkdir(parents=True)
    shutil.copy(template_db, base / "mlruns" / "mlflow.db")
    return base


@pytest.fixture(scope="module")
def uis(tmp_path_factory: pytest.TempPathFactory, template_db: Path):  # type: ignore[no-untyped-def]
    """`mpsrun ui` started side by side: three on one store with a run in experiment 'demo' (for SIGTERM, Ctrl-C,
    SIGKILL), one on a port already taken."""
    from mlflow.tracking import MlflowClient

    base = tmp_path_factory.mktemp("uistart")
    folder = _folder(base / "work", template_db)
    c = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlruns' / 'mlflow.db'}")
    exp = c.create_experiment("demo")
    run = c.create_run(exp)
    c.set_terminated(run.info.run_id)
    taken = socket.socket()  # a port in use, for the UI that cannot start
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    started = {name: Ui(folder, free_port()) for name in ("term", "int", "kill")}
    started["busy"] = Ui(_folder(base / "busy", template_db), taken.getsockname()[1])
    try:
        for name, u in started.items():
            if name != "busy":
                u.wait_link()
        yield started, exp
    finally:
        for u in started.values():
            u.stop()
        taken.close()


def test_the_screen_holds_mpsruns_lines_one_link_once_it_answers_and_the_log_the_server_s(uis) -> None:  # type: ignore[no-untyped-def]
    started, exp = uis
    u = started["term"]
    with urllib.request.urlopen(f"{u.url}/", timeout=30) as r:  # the page the link opens
        assert r.status == 200 and "<html" in r.read().decode(errors="replace").lower()
    time.sleep(0.5)  # anything the server would still print reaches the readers
    screen = u.screen()
    ((link, answered),) = u.links()  # exactly one link line ...
    assert answered and link.startswith(f"MLflow UI: {u.url}/#/experiments/{exp}/runs") and "'demo'" in link, screen  # ... once it answered
    assert screen.count("http://") == 1, screen  # no second URL (the server's own "Uvicorn running on")
    first = u.out[0][0]
    log = u.folder / "mlruns" / f"mlflow-ui-{u.port}.log"
    assert first.startswith("starting the MLflow UI for sqlite:///") and f"(server log: {log})" in first and not u.out[0][1], screen
    assert not [ln for ln in screen.splitlines() if any(w in ln.lower() for w in SERVER_WORDS)], screen
    text = log.read_text()
    assert f"Uvicorn running on http://127.0.0.1:{u.port}" in text and '"GET / HTTP/1.1" 200' in text, text
    assert "Started parent process" not in text and text.count("Started server process") == 1, text  # one worker, no supervisor


def _stopped_cleanly(u: Ui, tree: set[int], code: int, want: int) -> None:
    assert code == want, u.screen()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if alive(p)], "orphaned server processes"
    assert port_free(u.port)
    assert u.err[-1:] == ["stopped: the MLflow UI server has exited"] and "Traceback" not in u.screen(), u.screen()


def test_sigterm_stops_the_server_s_group_and_frees_the_port(uis) -> None:  # type: ignore[no-untyped-def]
    u = uis[0]["term"]
    tree = descendants(u.proc.pid)
    assert tree and not port_free(u.port)
    u.proc.send_signal(signal.SIGTERM)  # mpsrun alone (docker stop, Slurm): it must pass the signal on
    _stopped_cleanly(u, tree, u.finish(), 143)


def test_ctrl_c_stops_the_server_s_group_and_frees_the_port(uis) -> None:  # type: ignore[no-untyped-def]
    u = uis[0]["int"]
    tree = descendants(u.proc.pid)
    assert tree and not port_free(u.port)
    os.killpg(u.proc.pid, signal.SIGINT)  # as a terminal sends Ctrl-C: to the foreground group (the server has its own)
    _stopped_cleanly(u, tree, u.finish(), 130)


def test_a_killed_mpsrun_ui_leaves_no_server_behind(uis) -> None:  # type: ignore[no-untyped-def]
    u = uis[0]["kill"]
    tree = descendants(u.proc.pid)
    assert tree and not port_free(u.port)
    u.proc.kill()  # SIGKILL: mpsrun cannot pass anything on; the server sees its parent gone
    u.finish()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if alive(p)], "the server outlived mpsrun ui"
    deadline = time.monotonic() + 10
    while not port_free(u.port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert port_free(u.port)


def test_a_server_that_cannot_start_is_said_with_its_log(uis) -> None:  # type: ignore[no-untyped-def]
    """The port is taken: the server's own words (from the log, which the screen no longer shows) and exit 1."""
    u = uis[0]["busy"]
    code = u.finish(timeout=120)
    assert code == 1 and not u.links(), u.screen()
    said = "\n".join(u.err)
    assert "the MLflow UI server exited" in said and f"mlflow-ui-{u.port}.log" in said and "address already in use" in said.lower(), said


def test_a_misspelt_experiment_is_exit_2_at_once_with_a_did_you_mean(uis) -> None:  # type: ignore[no-untyped-def]
    """Checked in the SQLite store while the server starts (no MLflow import): exit 2 in seconds, not once the server is up."""
    folder = uis[0]["int"].folder
    t = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    p = subprocess.run([sys.executable, "-m", "mpsrun", "ui", "--port", str(free_port()), "-e", "demp"], cwd=folder, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "no experiment 'demp'" in p.stderr and "did you mean 'demo'?" in p.stderr, p.stdout + p.stderr
    assert time.monotonic() - t < 30, "an unknown experiment should be said before the server is up"
