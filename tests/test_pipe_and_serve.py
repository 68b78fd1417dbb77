"""A FashionMNIST run as someone outside a terminal meets it (issue 26, items 4, 5b and 6).

One real run, shared by the module: the console script with its output through a pipe (as
CI logs, Slurm, `docker logs` or `| tee` get it), from a recipe in a git checkout of its
own. Then what that run left: `mpsrun runs` through a pipe, the logged model's source, and
the model served by `mlflow models serve` answering a real HTTP request.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import RECIPES
from .proc_helpers import MPSRUN, free_port, wait_http

LONG_EXPERIMENT = "fashion_outside_a_terminal_with_a_rather_long_experiment_name"
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


@dataclass
class PipedRun:
    path: Path
    uri: str
    recipe: Path
    stdout: str
    run_id: str
    env: dict[str, str]
    stderr: str = ""

    def client(self) -> Any:
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def mpsrun(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([MPSRUN, *args], cwd=self.path, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)


def _stop(server: subprocess.Popen) -> None:
    """The server's whole process group (uvicorn and its worker), SIGKILL after 30 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            continue
    server.wait()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def piped(tmp_path_factory: pytest.TempPathFactory, template_db: Path) -> PipedRun:
    from mpsrun.testing.idx import write_idx_dataset

    path = tmp_path_factory.mktemp("piped")
    fashion_root = path / "data"
    write_idx_dataset(fashion_root, "FashionMNIST", n_train=640, n_test=128, seed=0)  # torchvision's on-disk format
    (path / "mlruns").mkdir()
    shutil.copy(template_db, path / "mlruns" / "mlflow.db")
    repo = path / "project"  # the user's own checkout: not mpsrun's
    (repo / "recipes").mkdir(parents=True)
    recipe = repo / "recipes" / "fashion.yaml"
    shutil.copy(RECIPES / "fashion_mlp_mps.yaml", recipe)
    _git(repo, "init", "-q", "-b", "trial")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "recipe")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(
        [MPSRUN, "run", str(recipe), "epochs=2", f"dataset.root={fashion_root}", "dataset.download=false",
         f"tracking.experiment={LONG_EXPERIMENT}", "model.hidden=[64]"],  # no -q: the default, outside a terminal
        cwd=path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    run_id = re.search(r"\brun ([0-9a-f]{32})\b", p.stdout).group(1)  # type: ignore[union-attr]
    return PipedRun(path, f"sqlite:///{path / 'mlruns' / 'mlflow.db'}", recipe, p.stdout, run_id, env, p.stderr)


def test_run_output_through_a_pipe_is_one_whole_line_per_epoch_and_message(piped: PipedRun) -> None:
    lines = piped.stdout.splitlines()
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 2, piped.stdout
    for line in epochs:  # the whole epoch on its line: samples/s never left alone on the next one
        assert re.fullmatch(r"epoch [12]/2  train_loss \S+  val_loss \S+  val_acc \S+  \S+ s  [\d,]+ samples/s", line), line
    assert not [line for line in lines if line.strip() == "samples/s"]
    (head,) = [line for line in lines if line.startswith("mpsrun ")]
    import torch

    graphs = "graphs=on" if torch.cuda.is_available() else "graphs=off"  # the recipe's mps falls back to CUDA where there is one
    assert str(piped.recipe) in head and head.rstrip().endswith(graphs), head  # the headline whole
    (warning,) = [line for line in lines if "device 'mps' is unusable" in line]
    assert warning.startswith("warning:") and len(warning) > 80, warning  # a long message, not folded at 80 columns
    assert all(not line.startswith(" ") for line in lines if line.strip()), piped.stdout  # no continuation lines
    assert "\x1b[" not in piped.stdout  # no colour codes in a log
    # the model takes uint8 images by design: MLflow's hint about integer columns is not shown to the user
    assert "Inferred schema contains integer" not in piped.stdout + piped.stderr, piped.stderr


def test_runs_through_a_pipe_is_plain_aligned_lines_with_whole_ids(piped: PipedRun) -> None:
    p = piped.mpsrun("runs")
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    header, *rows = lines
    assert header.split() == ["run", "id", "experiment", "name", "status", "device", "epochs/trials", "best", "started"]
    (row,) = [line for line in rows if piped.run_id in line]  # one line per run, with the whole id
    assert row.startswith(piped.run_id) and LONG_EXPERIMENT in row and "FINISHED" in row
    for col, value in (("experiment", LONG_EXPERIMENT), ("status", "FINISHED"), ("epochs", "2/2")):
        assert header.index(col) == row.index(value), (col, header, row)  # aligned under its heading
    assert "\x1b[" not in p.stdout
    listed = json.loads(piped.mpsrun("runs", "--json").stdout)  # --json stays
    assert [r["run_id"] for r in listed] == [piped.run_id] and listed[0]["epochs_done"] == 2


def test_run_and_logged_model_name_the_recipe_and_its_checkout(piped: PipedRun) -> None:
    c = piped.client()
    run = c.get_run(piped.run_id)
    (model,) = c.search_logged_models(experiment_ids=[run.info.experiment_id])
    repo = piped.recipe.parents[1]
    want = {
        "mlflow.source.name": str(piped.recipe.resolve()),
        "mlflow.source.git.commit": _git(repo, "rev-parse", "HEAD"),
        "mlflow.source.git.branch": "trial",
        "mpsrun.source.git.dirty": "false",
    }
    for tags in (run.data.tags, model.tags):
        assert {k: tags.get(k) for k in want} == want, tags
    # not mpsrun's own helper module, nor mpsrun's checkout
    mpsrun_head = subprocess.run(["git", "-C", str(RECIPES), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert model.tags["mlflow.source.git.commit"] != mpsrun_head
    assert "mpsrun" not in model.tags["mlflow.source.name"].split("/")[-1]


def test_served_classifier_answers_class_probability_and_named_scores(piped: PipedRun) -> None:
    import mlflow
    import numpy as np
    import torch
    from mlflow.models import Model

    mlflow.set_tracking_uri(piped.uri)
    uri = f"runs:/{piped.run_id}/model"
    local = mlflow.artifacts.download_artifacts(uri, dst_path=str(piped.path / "model"))
    example = Model.load(local).load_input_example(local)
    logits = mlflow.pytorch.load_model(uri)(torch.from_numpy(example)).detach().numpy()  # the raw module: scores
    port = free_port()
    # as from an activated venv: MLflow starts the scoring server with `uvicorn` from PATH
    env = {**piped.env, "MLFLOW_TRACKING_URI": piped.uri, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{piped.env.get('PATH', '')}"}
    with open(piped.path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", uri, "--env-manager", "local", "--host", "127.0.0.1", "-p", str(port)],
            cwd=piped.path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        assert wait_http(f"http://127.0.0.1:{port}/ping", 240, server), (piped.path / "serve.log").read_text()[-3000:]
        body = json.dumps({"inputs": example.tolist()}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.load(r)["predictions"]
    finally:
        _stop(server)
    assert len(answer) == len(example) == len(logits)
    scores = [f"score_{name}" for name in FASHION_CLASSES]
    for row, z in zip(answer, logits):
        assert list(row) == ["class", "class_index", "probability", *scores], row
        i = int(np.argmax(z))
        assert row["class_index"] == i and row["class"] == FASHION_CLASSES[i]
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        assert row["probability"] == pytest.approx(float(p[i]), rel=1e-5) and 0 < row["probability"] <= 1
        assert [row[k] for k in scores] == pytest.approx(z.tolist(), rel=1e-5, abs=1e-6)
    sig = mlflow.models.get_model_info(uri).signature.outputs.input_names()
    assert sig == ["class", "class_index", "probability", *scores]
