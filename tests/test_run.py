"""`mpsrun run` end to end: real training, real MLflow store, the real CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .conftest import RECIPES, digits_recipe, run_subprocess

METRICS = ("train_loss", "val_loss", "val_accuracy", "system/epoch_time_s", "system/train_samples_per_s")
TAGS = ("mpsrun.recipe", "device.requested", "device.type", "device.name", "torch.version", "python.version", "os.platform")


def test_digits_recipe_acceptance(work) -> None:
    """The README's promise: the offline recipe trains and the default store holds the run."""
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "--quiet", helper=None)  # the default: a helper process
    assert r.exit_code == 0, r.output
    assert "epoch 20/20" in r.stdout and "steady epoch" in r.stdout
    runs = work.runs("digits_mlp")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    for key in METRICS:
        steps = [s for s, _ in work.history(run.info.run_id, key)]
        assert steps == list(range(20)), key
    acc = work.history(run.info.run_id, "val_accuracy")
    assert all(0.0 <= v <= 1.0 for _, v in acc)
    assert acc[-1][1] > 0.8
    for tag in TAGS:
        assert run.data.tags.get(tag), tag
    assert run.data.tags["device.requested"] == "auto"
    assert run.data.params["optimizer.name"] == "adam"
    assert run.data.params["model.hidden"] == "[128, 64]"
    assert "system/steady_epoch_time_s" in run.data.metrics and "system/first_epoch_time_s" in run.data.metrics
    timings = json.loads(Path(work.client().download_artifacts(run.info.run_id, "mpsrun_timings.json", str(work.path))).read_text())
    # the writer thread's time is measured and recorded (its size against training's follows the CPU, the load and the
    # device: 0.95 s of writing against 0.84 s of training on a loaded 2-core EPYC with one torch thread, so no bound)
    assert timings["mlflow_log_time_s"] > 0
    arts = {a.path for a in work.client().list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "figures"} <= arts
    assert run.data.tags["mpsrun.model_uri"] == f"runs:/{run.info.run_id}/model"
    # artifacts live under the embedded store, next to the database
    assert (work.path / "mlruns" / "artifacts").is_dir()


def test_same_recipe_same_device_same_metrics(work) -> None:
    for _ in range(2):
        assert work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=3", "-q").exit_code == 0
    a, b = work.runs("digits_mlp")
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert work.history(a.info.run_id, key) == work.history(b.info.run_id, key)


def test_dataloader_path_trains_and_is_recorded(work) -> None:
    r = work.cli(
        "run", RECIPES / "digits_mlp.yaml", "epochs=2", "resident=false", "loader.num_workers=1", "tracking.log_model=false", "-q"
    )
    assert r.exit_code == 0, r.output
    run = work.runs("digits_mlp")[0]
    assert run.data.tags["data.path"] == "dataloader"
    assert "mpsrun.model_uri" not in run.data.tags
    assert run.data.tags["mpsrun.model_artifact"].startswith("skipped")
    assert run.data.metrics["val_accuracy"] > 0.2


def test_fashion_recipe_falls_back_from_mps_and_records_both(work, fashion_root) -> None:
    """On this Linux machine MPS is really absent: the recipe's fallback must kick in."""
    r = work.cli("run", RECIPES / "fashion_mlp_mps.yaml", "epochs=1", f"dataset.root={fashion_root}", "-q")
    assert r.exit_code == 0, r.output
    assert "warning:" in r.stdout and "device 'mps' is unusable" in r.stdout
    run = work.runs("fashion_mlp_mps")[0]
    tags = run.data.tags
    assert tags["device.requested"] == "mps"
    assert tags["device.actual"] in ("cpu", "cuda", "cuda:0")
    assert tags["device.fallback"] == "true"
    assert "mps:" in tags["device.skipped"]
    assert run.data.params["data.train_size"] == "576"  # 640 less the 10% validation hold-out


def test_missing_data_is_bad_input_naming_the_path(work) -> None:
    r = work.cli("run", RECIPES / "fashion_mlp_mps.yaml", "dataset.root=nowhere", "dataset.download=false")
    assert r.exit_code == 2
    assert "FashionMNIST files not found in" in r.stderr and "nowhere" in r.stderr
    assert not work.runs("fashion_mlp_mps")


def test_unusable_device_without_fallback_exits_2_with_reason(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "device=mps")
    assert r.exit_code == 2
    assert "device 'mps' is unusable" in r.stderr and "macOS" in r.stderr
    assert "device_fallback" in r.stderr


FLAKY_MODEL = """
import torch
from torch import nn

class Boom(nn.Module):
    def __init__(self, input_shape, num_classes, fail_at: int = 5, interrupt: bool = False):
        super().__init__()
        self.lin = nn.Linear(64, num_classes)
        self.calls = 0
        self.fail_at = fail_at
        self.interrupt = interrupt

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.interrupt:
                raise KeyboardInterrupt
            raise RuntimeError("simulated failure in forward")
        return self.lin(x.flatten(1))

def boom(input_shape: tuple, num_classes: int, fail_at: int = 5, interrupt: bool = False):
    return Boom(input_shape, num_classes, fail_at, interrupt)
"""


def test_failure_marks_run_failed_with_error(work, fake_dist) -> None:
    fake_dist("boom-models", FLAKY_MODEL, models={"boom": "boom"})
    r = work.cli("run", digits_recipe(work, "boom"), "model.fail_at=30", "-q")
    assert r.exit_code == 1
    assert "simulated failure" in r.stderr and "FAILED" in r.stderr
    run = work.runs("plugtest")[0]
    assert run.info.status == "FAILED"
    assert "simulated failure in forward" in run.data.tags["mpsrun.error"]
    assert "error.txt" in {a.path for a in work.client().list_artifacts(run.info.run_id)}


def test_interrupt_marks_run_killed_exit_130(work, fake_dist) -> None:
    fake_dist("boom-models", FLAKY_MODEL, models={"boom": "boom"})
    r = work.cli("run", digits_recipe(work, "boom"), "model.fail_at=30", "model.interrupt=true", "-q")
    assert r.exit_code == 130
    assert work.runs("plugtest")[0].info.status == "KILLED"


def test_tracking_uri_option_and_env_win(work, tmp_path) -> None:
    other = f"sqlite:///{tmp_path / 'other.db'}"
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=1", "-q", "--tracking-uri", other)
    assert r.exit_code == 0, r.output
    from mlflow.tracking import MlflowClient

    exp = MlflowClient(other).get_experiment_by_name("digits_mlp")
    assert exp is not None and MlflowClient(other).search_runs([exp.experiment_id])
    assert not work.runs("digits_mlp")


def test_console_script_and_module_entry(work) -> None:
    """The installed `mpsrun` and `python -m mpsrun` both run; help works."""
    script = Path(sys.executable).parent / "mpsrun"
    r = run_subprocess(str(script), "--help", cwd=work.path)
    assert r.exit_code == 0 and "run" in r.stdout and "validate" in r.stdout
    r = run_subprocess(sys.executable, "-m", "mpsrun", "run", str(RECIPES / "digits_mlp.yaml"), "epochs=1", "-q", cwd=work.path)
    assert r.exit_code == 0, r.output
    assert work.runs("digits_mlp")[0].info.status == "FINISHED"


@pytest.mark.parametrize("sub", ["run", "validate", "plugins", "ui", "doctor"])
def test_every_command_has_help(work, sub) -> None:
    r = work.cli(sub, "--help")
    assert r.exit_code == 0 and "Usage" in r.stdout
