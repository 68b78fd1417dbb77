"""Eight `mpsrun run` processes started at once on a new folder: all finish, nothing is lost.

Before the store lock, 7 or 8 of 8 died in MLflow's alembic migration
(`table _alembic_tmp_latest_metrics already exists`) and the store could be left
broken. Real processes, a real SQLite store created by them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .conftest import Workdir
from .proc_helpers import MPSRUN, clean_env

N = 8
RECIPE = """\
device: cpu
epochs: 2
batch_size: 128
seed: {seed}
dataset: {{name: digits}}
model: {{name: mlp, hidden: [16]}}
optimizer: {{name: sgd, lr: 0.05}}
tracking: {{experiment: crowd, log_model: false, figures: false}}
"""


def test_eight_runs_at_once_on_a_new_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not (tmp_path / "mlruns").exists()
    procs = []
    for i in range(N):
        r = tmp_path / f"r{i}.yaml"
        r.write_text(RECIPE.format(seed=i))
        procs.append(
            subprocess.Popen([MPSRUN, "run", str(r), "-q"], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [(p.wait(timeout=400), p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    for code, out in outs:
        assert code == 0, out
        assert "Traceback" not in out
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    exps = [e for e in c.search_experiments() if e.name == "crowd"]
    assert len(exps) == 1  # one experiment, created once
    runs = c.search_runs([exps[0].experiment_id])
    assert len(runs) == N and {r.info.status for r in runs} == {"FINISHED"}
    for r in runs:  # every epoch's metrics of every run arrived
        assert [m.step for m in c.get_metric_history(r.info.run_id, "val_loss")] == [0, 1]
    # and the store still works for the next run (in-process: the 8 above were the processes)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    again = Workdir(tmp_path).cli("run", tmp_path / "r0.yaml", "-q")
    assert again.exit_code == 0, again.output
    assert len(c.search_runs([exps[0].experiment_id])) == N + 1
