"""The MLflow pieces one at a time, on a real SQLite store: MPS memory (mocked: no Apple GPU here),
regression figures, the learning-curve refresh, wrapper unwrapping, and a run without a model."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch import nn

from mpsrun.track.records import figures
from mpsrun.track.records.served import ServedModel, unwrap
from mpsrun.track.records.system import SystemMetrics, mps_monitor

from .conftest import RECIPES


@pytest.fixture
def mlflow_run(work):  # type: ignore[no-untyped-def]
    c = work.client()
    exp = c.create_experiment("parts")
    return c, c.create_run(exp).info.run_id


def test_mps_memory_system_metrics_mocked(work, mlflow_run, monkeypatch) -> None:
    """On MPS the monitor adds torch.mps allocated and driver memory (mocked: this Linux box has no MPS)."""
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 300 * 2**20)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 512 * 2**20)
    m = mps_monitor()
    m.collect_metrics()
    assert m.aggregate_metrics() == {"mps_allocated_memory_megabytes": 300.0, "mps_driver_memory_megabytes": 512.0}

    c, run_id = mlflow_run
    sm = SystemMetrics(work.uri, run_id, "mps", interval_s=0.2).start()
    assert sm.notes == []
    time.sleep(0.5)
    sm.stop()
    metrics = c.get_run(run_id).data.metrics
    assert metrics["system/mps_allocated_memory_megabytes"] == 300.0
    assert metrics["system/mps_driver_memory_megabytes"] == 512.0
    assert "system/cpu_utilization_percentage" in metrics
    # a CPU run gets no MPS figures
    run2 = c.create_run(c.get_run(run_id).info.experiment_id).info.run_id
    sm = SystemMetrics(work.uri, run2, "cpu", interval_s=0.2).start()
    sm.stop()  # stopped before the first interval ends: the sample taken at start is still written
    keys = set(c.get_run(run2).data.metrics)
    assert "system/cpu_utilization_percentage" in keys and not any("mps" in k for k in keys)


def test_regression_outputs_get_a_scatter_not_a_confusion_matrix(mlflow_run) -> None:
    c, run_id = mlflow_run
    y = np.linspace(0, 1, 50).astype(np.float32)
    logged = figures.log_predictions(c, run_id, y, (y + 0.05).reshape(-1, 1), "regression")
    assert logged == ["figures/predicted_vs_true.png"]
    history = [{"train_loss": 1.0 / (i + 1), "val_loss": 1.2 / (i + 1), "val_mae": 0.5 / (i + 1)} for i in range(4)]
    assert figures.task_metric(history) == "mae"
    figures.log_learning_curves(c, run_id, history, "regression")
    paths = {a.path for a in c.list_artifacts(run_id, "figures")}
    assert paths == {"figures/predicted_vs_true.png", "figures/learning_curves.png"}


def test_confusion_counts_rows_are_true_classes() -> None:
    m = figures.confusion(np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1]), 3)
    assert m.tolist() == [[1, 1, 0], [0, 1, 0], [0, 1, 0]]
    t = figures.per_class(m, ["a", "b", "c"])
    assert t["accuracy"] == [0.5, 1.0, 0.0] and t["support"] == [2, 1, 1]


def test_learning_curves_refresh_every_few_epochs_on_long_runs(work, mlflow_run) -> None:
    from types import SimpleNamespace

    from mpsrun.train.controls.callbacks import RunState
    from mpsrun.train.record import FIGURE_EVERY, Recorder, callback

    c, run_id = mlflow_run
    tracker = SimpleNamespace(c=c, run_id=run_id)  # the two attributes the refresh uses, on the real store
    setup = SimpleNamespace(resolved=SimpleNamespace(recipe=SimpleNamespace(model=SimpleNamespace(name="mlp"), dataset=SimpleNamespace(name="digits"))), choice=SimpleNamespace(device="cpu"))
    cb = callback(Recorder(tracker, setup))  # type: ignore[arg-type]
    state = RunState(nn.Linear(1, 1), torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1), torch.device("cpu"), epochs=3 * FIGURE_EVERY)
    state.history = [{"train_loss": 1.0, "val_loss": 1.0, "val_accuracy": 0.5}] * FIGURE_EVERY
    cb.on_epoch_end(state, FIGURE_EVERY - 2, state.history[-1])
    assert c.list_artifacts(run_id, "figures") == []  # not yet
    cb.on_epoch_end(state, FIGURE_EVERY - 1, state.history[-1])
    assert [a.path for a in c.list_artifacts(run_id, "figures")] == [figures.LEARNING_CURVES]


def test_unwrap_takes_off_compile_and_ddp_style_wrappers() -> None:
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    assert unwrap(torch.compile(net)) is net

    class DistributedDataParallel(nn.Module):  # the shape of torch's wrapper, without a process group
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    assert unwrap(DistributedDataParallel(net)) is net
    served = ServedModel(net, lambda x: x.float() / 16)
    assert served(torch.full((3, 1, 2, 2), 16, dtype=torch.uint8)).shape == (3, 2)


def test_no_model_logged_when_log_model_is_false_and_run_name_kept(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=1", "device=cpu", "tracking.log_model=false", "tracking.run_name=mine", "tracking.system_metrics=false", "-q", helper=None)
    assert r.exit_code == 0, r.output
    (run,) = work.runs("digits_mlp")
    assert run.info.run_name == "mine"
    assert "mpsrun.model_uri" not in run.data.tags and run.data.tags["mpsrun.model_artifact"].startswith("skipped")
    assert work.client().get_run(run.info.run_id).outputs.model_outputs == []
    from mpsrun.track.records.names import EPOCH_SYSTEM, RUN_SYSTEM

    # MLflow's monitor is off (no system/cpu_utilization_percentage ...); mpsrun's own times and memory are there
    monitor = {k for k in run.data.metrics if k.startswith("system/")} - {f"system/{n}" for n in (*EPOCH_SYSTEM, *RUN_SYSTEM)}
    assert not monitor and "system/epoch_time_s" in run.data.metrics, sorted(run.data.metrics)
    assert "figures/learning_curves.png" in {a.path for a in work.client().list_artifacts(run.info.run_id, "figures")}
    r = work.cli("eval", run.info.run_id, helper=None)
    assert r.exit_code == 2 and "no logged model" in r.stderr
