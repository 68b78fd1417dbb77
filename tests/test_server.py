"""The shared server, for real: `mpsrun run --tracking-uri http://...` against `mlflow server`
on PostgreSQL 15 with artifacts in an S3 bucket (moto's server), as docker/compose.yaml runs it.

What is checked is where things land, read from the stores themselves (psycopg on the
database, boto3 on the bucket), not what MLflow's client says about them; and that the
runner needs nothing but the server's URL (no S3 credentials, no endpoint, no local store).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import servers

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "digits_mlp.yaml"
MPSRUN = [sys.executable, "-m", "mpsrun"]

pytestmark = pytest.mark.skipif(servers.missing_parts() is not None, reason=f"shared-server stack unavailable: {servers.missing_parts()}")


@pytest.fixture(scope="module")
def stack():
    s = servers.start_stack()
    yield s
    s.stop()


def _mpsrun(stack: servers.Stack, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*MPSRUN, *args], cwd=cwd, env=stack.client_env(), capture_output=True, text=True, timeout=timeout)


def _run_id(output: str) -> str:
    m = re.search(r"\brun ([0-9a-f]{32})\b", output)
    assert m, f"no run id in the output:\n{output}"
    return m.group(1)


def _run_row(stack: servers.Stack, run_id: str) -> tuple[str, str, str]:
    rows = stack.pg.query("SELECT status, artifact_uri, experiment_id::text FROM runs WHERE run_uuid = %s", (run_id,))
    assert rows, f"run {run_id} is not in PostgreSQL"
    return rows[0]


def _server_artifacts(stack: servers.Stack, run_id: str) -> list[str]:
    """Every artifact file of the run, listed through the server (the client's only way in)."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=stack.url)
    out, todo = [], [None]
    while todo:
        for f in c.list_artifacts(run_id, todo.pop()):
            (todo.append(f.path) if f.is_dir else out.append(f.path))
    return sorted(out)


def _bucket_artifacts(stack: servers.Stack, run_id: str) -> list[str]:
    """The run's objects in the bucket, as paths relative to its artifact root."""
    marker = f"/{run_id}/artifacts/"
    return sorted(k.split(marker, 1)[1] for k in stack.s3.keys(servers.ARTIFACTS_PREFIX + "/") if marker in k)


def test_run_lands_in_postgres_and_the_bucket(stack, tmp_path) -> None:
    r = _mpsrun(stack, tmp_path, "run", str(RECIPE), "epochs=2", "device=cpu", "tracking.experiment=server_run", "-q", "--tracking-uri", stack.url)
    assert r.returncode == 0, r.stdout + r.stderr
    run_id = _run_id(r.stdout)

    status, artifact_uri, exp_id = _run_row(stack, run_id)
    assert status == "FINISHED"
    # proxied artifacts: the client was handed an mlflow-artifacts URI, never s3://
    assert artifact_uri.startswith("mlflow-artifacts:"), artifact_uri
    assert stack.pg.query("SELECT name FROM experiments WHERE experiment_id = %s", (int(exp_id),)) == [("server_run",)]

    params = dict(stack.pg.query("SELECT key, value FROM params WHERE run_uuid = %s", (run_id,)))
    assert params["epochs"] == "2" and params["model.name"] == "mlp" and params["dataset.name"] == "digits"
    losses = stack.pg.query("SELECT step, value FROM metrics WHERE run_uuid = %s AND key = 'val_loss' ORDER BY step", (run_id,))
    assert [s for s, _ in losses] == [0, 1] and all(math.isfinite(v) for _, v in losses)
    assert losses[1][1] < losses[0][1], "digits val_loss should fall from epoch 0 to 1"
    accuracy = stack.pg.query("SELECT value FROM latest_metrics WHERE run_uuid = %s AND key = 'val_accuracy'", (run_id,))
    assert accuracy and accuracy[0][0] > 0.5
    tags = dict(stack.pg.query("SELECT key, value FROM tags WHERE run_uuid = %s", (run_id,)))
    assert tags["device.actual"] == "cpu" and tags["mlflow.runName"]

    in_bucket = _bucket_artifacts(stack, run_id)
    assert "recipe.yaml" in in_bucket
    assert "checkpoints/last.pt" in in_bucket, in_bucket
    # the logged model (MLflow 3: a LoggedModel with artifacts of its own, beside the run's)
    from mlflow.tracking import MlflowClient

    models = MlflowClient(tracking_uri=stack.url).search_logged_models(experiment_ids=[exp_id], filter_string=f"source_run_id = '{run_id}'")
    assert [m.name for m in models] == ["model"]
    location = models[0].artifact_location
    assert location.startswith("mlflow-artifacts:/"), location
    model_prefix = f"{servers.ARTIFACTS_PREFIX}/{location.removeprefix('mlflow-artifacts:/').strip('/')}/"
    assert f"{model_prefix}MLmodel" in stack.s3.keys(model_prefix), f"no MLmodel in the bucket under {model_prefix}"
    # every artifact the server knows of (checkpoints included, where the run has them) is an object in the bucket
    assert _server_artifacts(stack, run_id) == in_bucket
    assert not (tmp_path / "mlruns").exists(), "the client wrote a local store"


def _wait_for_checkpoint(stack: servers.Stack, proc: subprocess.Popen, run_id_box: list[str], log: Path, timeout: float = 120) -> str:
    """The run id once the run has a checkpoint artifact on the server, the process still training."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=stack.url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before it could be killed:\n{log.read_text()}"
        if not run_id_box:
            m = re.search(r"\b([0-9a-f]{32})\b", log.read_text())
            runs = c.search_runs(
                [e.experiment_id for e in c.search_experiments(filter_string="name = 'server_resume'")],
                filter_string="attributes.status = 'RUNNING'",
            ) if c.get_experiment_by_name("server_resume") else []
            if runs:
                run_id_box.append(runs[0].info.run_id)
            elif m:
                run_id_box.append(m.group(1))
        if run_id_box and any(re.search(r"ckpt|checkpoint", p, re.I) for p in _server_artifacts(stack, run_id_box[0])):
            return run_id_box[0]
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint artifact within {timeout:.0f} s:\n{log.read_text()}")


def test_killed_run_resumes_from_another_folder_through_the_server(stack, tmp_path) -> None:
    first, second = tmp_path / "laptop", tmp_path / "another"
    first.mkdir()
    second.mkdir()
    epochs = 12
    log = first / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*MPSRUN, "run", str(RECIPE), f"epochs={epochs}", "device=cpu", "tracking.experiment=server_resume",
             "model.hidden=[512,512]", "batch_size=16", "tracking.log_model=false", "tracking.figures=false",  # epochs are what it checks
             "--tracking-uri", stack.url],
            cwd=first, env=stack.client_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        run_id = _wait_for_checkpoint(stack, proc, [], log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no handler runs: the run stays RUNNING, as after a power cut
        proc.wait(timeout=30)
    assert _run_row(stack, run_id)[0] == "RUNNING"

    # another machine: nothing local, only the server's URL
    r = _mpsrun(stack, second, "resume", run_id, "--tracking-uri", stack.url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _run_row(stack, run_id)[0] == "FINISHED"
    steps = [s for (s,) in stack.pg.query("SELECT DISTINCT step FROM metrics WHERE run_uuid = %s AND key = 'val_loss' ORDER BY step", (run_id,))]
    assert steps == list(range(epochs)), "the resumed run does not cover every epoch once"
    runs = stack.pg.query("SELECT count(*) FROM runs r JOIN experiments e USING (experiment_id) WHERE e.name = 'server_resume'")
    assert runs == [(1,)], "resume started a new run instead of continuing the killed one"
    assert not (second / "mlruns").exists()
