"""A real `mlflow server` that is unreachable, or goes away in the middle of a run.

The server is started once for the module (a few seconds); each test that stops
it starts it again on the same port and store before it ends.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from .proc_helpers import MPSRUN, MlflowServer, clean_env, free_port, plugin_site

RECIPE = """\
device: cpu
epochs: {epochs}
batch_size: 64
seed: 0
dataset: {{name: digits}}
model: {{name: held_mlp, hold: "{hold}"}}
optimizer: {{name: sgd, lr: 0.05}}
tracking: {{experiment: remote, run_name: {name}{extra}}}
"""


@pytest.fixture
def server(mlflow_server: MlflowServer):  # type: ignore[no-untyped-def]
    """The session's `mlflow server` (tests/conftest.py); these tests kill it and start it again,
    and one that failed in between leaves it running for the next."""
    yield mlflow_server
    if mlflow_server.proc is None:
        mlflow_server.start()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    site = plugin_site(tmp_path)
    return clean_env(PYTHONPATH=str(site), XDG_CACHE_HOME=str(tmp_path / "cache"))


def _client(uri: str):  # type: ignore[no-untyped-def]
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _run_of(uri: str, name: str):  # type: ignore[no-untyped-def]
    c = _client(uri)
    exp = c.get_experiment_by_name("remote")
    if exp is None:
        return None
    runs = c.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
    return runs[0] if runs else None


def _start_held(tmp_path: Path, server: MlflowServer, env: dict[str, str], name: str, epochs: int, extra: str = ""):  # type: ignore[no-untyped-def]
    """A run that trains slowly while tmp/hold exists; returns (process, hold file, run id) once a metric reached the server.
    `extra`: more `tracking:` keys (", log_model: false" ...)."""
    hold = tmp_path / "hold"
    hold.touch()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(epochs=epochs, hold=hold, name=name, extra=extra))
    proc = subprocess.Popen(
        [MPSRUN, "run", str(recipe), "-q", "--tracking-uri", server.uri],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        run = _run_of(server.uri, name)
        if run is not None and _client(server.uri).get_metric_history(run.info.run_id, "val_loss"):
            return proc, hold, run.info.run_id
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the run never logged a metric to the server")


def _spool_files(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "cache").rglob("*.jsonl"))


def _wait_spooled(tmp_path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while not _spool_files(tmp_path) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    assert _spool_files(tmp_path), "nothing was spooled while the server was down"


def test_unreachable_server_is_refused_fast(tmp_path: Path) -> None:
    """Nothing listening: exit 2 in seconds, naming the URI, no traceback, before any data loads."""
    from tests.conftest import RECIPES

    uri = f"http://127.0.0.1:{free_port()}"
    t = time.monotonic()
    p = subprocess.run(
        [MPSRUN, "run", str(RECIPES / "digits_mlp.yaml"), "epochs=1", "-q", "--tracking-uri", uri],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    took = time.monotonic() - t
    assert p.returncode == 2, p.stdout + p.stderr
    assert took < 30, took  # the bound; the probe itself gives up after 3 s
    assert uri in p.stderr and "not reachable" in p.stderr
    assert "Traceback" not in p.stderr and "mpsrun " not in p.stdout  # refused before the run began
    # the same through the environment variable
    p = subprocess.run(
        [MPSRUN, "run", str(RECIPES / "digits_mlp.yaml"), "epochs=1", "-q"],
        cwd=tmp_path, env=clean_env(MLFLOW_TRACKING_URI=uri), capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 2 and uri in p.stderr


def test_server_lost_mid_run_is_replayed_when_back(tmp_path: Path, server: MlflowServer, env: dict[str, str]) -> None:
    """SIGKILL the server during training: training goes on, writes are spooled, and replayed
    in order once the server is back; every epoch's metrics arrive and the run says what happened."""
    epochs = 12
    # what it checks is the epochs' records: no model or figures (seconds of a 2-core machine; the sync test has them)
    proc, hold, run_id = _start_held(tmp_path, server, env, "replayed", epochs, ", log_model: false, figures: false")
    server.kill(signal.SIGKILL)
    _wait_spooled(tmp_path, proc)
    server.start()
    hold.unlink()  # let training finish; the end of the run replays what is left
    out, errs = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + errs
    assert "spooled" in errs and "replayed" in errs
    run = _client(server.uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    steps = [m.step for m in _client(server.uri).get_metric_history(run_id, "val_loss")]
    assert sorted(steps) == list(range(1, epochs + 1)) or sorted(steps) == list(range(epochs)), steps
    assert "replayed" in run.data.tags["mpsrun.spool"]
    assert not _spool_files(tmp_path)


def test_server_gone_until_the_end_then_mpsrun_sync(tmp_path: Path, server: MlflowServer, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stays down past the end of the run: exit 0 with the sync command on screen;
    `mpsrun sync` replays metrics, tags, artifacts and the FINISHED status once it is back."""
    epochs = 8
    proc, hold, run_id = _start_held(tmp_path, server, env, "synced", epochs)
    server.kill(signal.SIGTERM)
    _wait_spooled(tmp_path, proc)
    hold.unlink()
    out, errs = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + errs
    assert f"mpsrun sync --tracking-uri {server.uri}" in errs
    assert _spool_files(tmp_path)
    server.start()
    assert _client(server.uri).get_run(run_id).info.status == "RUNNING"  # nothing replayed yet
    p = subprocess.run([MPSRUN, "sync", "--tracking-uri", server.uri], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert run_id in p.stdout and "replayed" in p.stdout
    c = _client(server.uri)
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(c.get_metric_history(run_id, "val_loss")) == epochs
    assert "system/steady_epoch_time_s" in run.data.metrics
    assert "mpsrun.spool" in run.data.tags and "mpsrun.spool.synced" in run.data.tags
    assert "recipe.yaml" in [a.path for a in c.list_artifacts(run_id)]
    assert "logged model are skipped" in run.data.tags["mpsrun.notes"]
    assert not _spool_files(tmp_path)
    # again: nothing left (in-process, the same spool folder: a second interpreter start buys nothing here)
    from typer.testing import CliRunner

    from mpsrun.cli import app

    monkeypatch.chdir(tmp_path)
    again = CliRunner().invoke(app, ["sync", "--tracking-uri", server.uri], env={"XDG_CACHE_HOME": env["XDG_CACHE_HOME"]}, catch_exceptions=False)
    assert again.exit_code == 0 and "nothing to sync" in again.stdout, again.output
