"""The exporter process (track/helper/exporter.py): a model exported before training, the trained
weights swapped in at the end, a model changed beyond its weights exported again, and a dead
exporter said as such. One real exporter process serves the first two (it takes model after
model); a second is killed. The whole-run path (the CLI, the helper, the logged model) is
`test_startup.py::test_background_tracker_keeps_every_record[auto]`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mpsrun.track.helper import exporter
from mpsrun.track.records.served import ServedModel


def _served(slope: float, seed: int) -> ServedModel:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.LeakyReLU(slope), nn.Linear(8, 3))
    return ServedModel(net, None).eval()


def _pt2_answers(path: str, x: torch.Tensor) -> torch.Tensor:
    return torch.export.load(path).module()(x)


def test_weights_are_swapped_in_and_a_changed_model_is_exported_again(tmp_path: Path) -> None:
    example = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    x = torch.randn(7, 3, 4)  # another batch size: the batch dimension stays dynamic
    ex = exporter.Exporter()
    try:
        # 1. training changed only the weights: the program exported ahead serves, with the trained weights
        ex.begin(_served(0.01, seed=0), example)
        trained = _served(0.01, seed=1)
        (tmp_path / "a").mkdir()
        pt2, info = ex.finish(trained, str(tmp_path / "a"))
        assert info["how"] == "ahead" and info["began_s"] > 0, info
        with torch.no_grad():
            assert torch.equal(_pt2_answers(pt2, x), trained(x))
            assert not torch.equal(_pt2_answers(pt2, x), _served(0.01, seed=0)(x))  # not the untrained weights

        # 2. the same exporter, the next model: a plain attribute the forward reads changed (the slope)
        ex.begin(_served(0.01, seed=0), example)
        changed = _served(0.3, seed=2)
        (tmp_path / "b").mkdir()
        pt2, info = ex.finish(changed, str(tmp_path / "b"))
        assert info["how"] == "again" and "changed beyond its weights" in info["why"], info
        with torch.no_grad():
            assert torch.equal(_pt2_answers(pt2, x), changed(x))
        # 3. the training process gone without closing it (as after a SIGKILL): the exporter ends, its files removed
        assert Path(ex.dir, "begin.pt").exists()
        ex.proc.stdin.close()  # type: ignore[union-attr]
        assert ex.proc.wait(timeout=60) == 0
        assert not Path(ex.dir).exists()
    finally:
        ex.close()


def test_the_drawer_draws_the_end_figures_without_torch(tmp_path: Path) -> None:
    """The drawer (`exporter --draw`): the end-of-run figures as PNG files and the per-class table, in a
    process that never loads torch (it starts beside the run's own import of torch) and exports nothing."""
    dr = exporter.Exporter(draw_only=True)
    try:
        history = [{"train_loss": 1.0 / (i + 1), "val_loss": 1.2 / (i + 1), "val_accuracy": 0.1 * i} for i in range(4)]
        predictions = (np.array([0, 1, 2, 1]), np.eye(3, dtype=np.float32)[[0, 2, 2, 1]])
        dr.draw((history, "a title", predictions, ["a", "b", "c"], True))
        drawn = dr.figures_result()
        assert drawn["notes"] == [] and sorted(folder + "/" + Path(f).name for f, folder in drawn["files"]) == [
            "figures/confusion_matrix.png", "figures/learning_curves.png", "figures/per_class_accuracy.png"]
        assert all(Path(f).read_bytes()[:4] == b"\x89PNG" for f, _ in drawn["files"])
        assert drawn["tables"][0][1] == "tables/per_class_accuracy.json" and drawn["tables"][0][0]["correct"] == [1, 1, 1]
        dr.draw((history, "a title", "ValueError: no predictions", None, False))  # the curves drawn by the helper
        drawn = dr.figures_result()
        assert drawn["files"] == [] and drawn["notes"] == ["figures: not logged (RuntimeError: ValueError: no predictions)"], drawn
        maps = Path(f"/proc/{dr.proc.pid}/maps").read_text()
        assert "matplotlib" in maps and "libtorch" not in maps
        dr.begin(_served(0.01, seed=0), np.zeros((2, 3, 4), np.float32))
        assert dr._receive() == (False, "a drawer does not begin")
    finally:
        dr.close()
    assert dr.proc.poll() is not None and not Path(dr.dir).exists()


def test_an_exporter_that_died_is_said_and_the_run_can_export_itself(tmp_path: Path) -> None:
    ex = exporter.Exporter()
    try:
        ex.begin(_served(0.01, seed=0), np.zeros((2, 3, 4), np.float32))
        ex.proc.kill()
        ex.proc.wait()
        with pytest.raises(exporter.ExportAheadFailed, match="exporter process ended"):
            ex.finish(_served(0.01, seed=1), str(tmp_path))
        with pytest.raises(exporter.ExportAheadFailed, match="exporter process ended"):  # the figures: drawn by the helper instead
            ex.draw(([], "t", "no predictions", None, True))
    finally:
        ex.close()
    idle = exporter.Exporter.__new__(exporter.Exporter)  # never begun (the model could not be handed over): no process asked
    idle.begun = False
    with pytest.raises(exporter.ExportAheadFailed, match="not handed"):
        idle.finish(_served(0.01, seed=1), str(tmp_path))


@pytest.mark.parametrize(("value", "cores", "gpu", "want"), [("1", 2, False, True), ("0", 64, True, False), ("auto", 2, True, False),
                                                            ("auto", 4, True, True), ("auto", 4, False, False), ("auto", 8, False, True)])
def test_when_an_exporter_starts(monkeypatch: pytest.MonkeyPatch, value: str, cores: int, gpu: bool, want: bool) -> None:
    monkeypatch.setenv(exporter.ENV, value)
    monkeypatch.setattr(exporter, "_cores", lambda: cores)
    started, why = exporter.wanted(accelerator=gpu)
    assert started is want and (value in why or f"{cores} cores" in why), why
    assert ("for a CPU run" in why) == (value == "auto" and not gpu), why


def test_a_misspelt_export_ahead_value_is_taken_as_auto_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(exporter.ENV, "yse")
    monkeypatch.setattr(exporter, "_cores", lambda: 16)
    started, why = exporter.wanted(accelerator=True)
    assert started and "MPSRUN_EXPORT_AHEAD='yse' is not 1, 0 or auto: taken as auto" in why, why


def test_a_run_whose_exporter_dies_logs_its_model_and_figures_and_says_so(work, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The exporter killed (SIGKILL) after the model was handed over: the run exports in its own process,
    the helper draws the figures, nothing is missing, and the run's notes and tag say what happened."""
    from mpsrun.plugins import resolve
    from mpsrun.track.helper import background
    from mpsrun.train import record, runner

    from .conftest import RECIPES

    monkeypatch.setenv(exporter.ENV, "1")
    handed = record.model_ahead

    def then_killed(tracker, setup):  # type: ignore[no-untyped-def]
        handed(tracker, setup)
        tracker._exporter.proc.kill()

    monkeypatch.setattr(record, "model_ahead", then_killed)
    tracker = background.start(work.uri, "dies", mode="inline", export_ahead=True)
    runner.execute(runner.prepare(resolve(RECIPES / "digits_mlp.yaml", ["epochs=2", "device=cpu"])), work.uri, tracker=tracker)
    (run,) = work.runs("dies")
    tags = run.data.tags
    assert run.info.status == "FINISHED"
    assert "model: not exported ahead (the exporter could not serve: the exporter process ended" in tags["mpsrun.notes"], tags["mpsrun.notes"]
    assert tags["mpsrun.model_export"].startswith("at the end of the run (the exporter could not serve"), tags["mpsrun.model_export"]
    c = work.client()
    assert sorted(a.path for a in c.list_artifacts(run.info.run_id, "figures")) == [
        "figures/confusion_matrix.png", "figures/learning_curves.png", "figures/per_class_accuracy.png"]
    assert tags["mpsrun.model_uri"].endswith("/model") and "pickle" not in tags["mpsrun.notes"]  # exported (pt2) by the run itself


@pytest.mark.parametrize("when", ["before", "while drawing"])
def test_a_run_whose_drawer_dies_logs_every_figure(work, monkeypatch: pytest.MonkeyPatch, when: str) -> None:  # type: ignore[no-untyped-def]
    """The drawer killed (SIGKILL) before the end asks for the figures, or once it has been asked: the
    helper draws them all, the model is still exported ahead, and the run finishes with every figure."""
    from mpsrun.plugins import resolve
    from mpsrun.track.helper import background
    from mpsrun.train import record, runner

    from .conftest import RECIPES

    monkeypatch.setenv(exporter.ENV, "1")
    tracker = background.start(work.uri, "drawer dies", mode="inline", export_ahead=True, draw_ahead=True)
    drawer = tracker._drawer
    assert drawer is not None and tracker._exporter is not None
    if when == "before":
        drawer.proc.kill()
        drawer.proc.wait()
    else:
        asked = exporter.Exporter.draw

        def then_killed(self, figures):  # type: ignore[no-untyped-def]
            asked(self, figures)
            self.proc.kill()

        monkeypatch.setattr(exporter.Exporter, "draw", then_killed)
    runner.execute(runner.prepare(resolve(RECIPES / "digits_mlp.yaml", ["epochs=2", "device=cpu"])), work.uri, tracker=tracker)
    assert drawer.proc.poll() is not None and not Path(drawer.dir).exists()
    (run,) = work.runs("drawer dies")
    assert run.info.status == "FINISHED"
    assert run.data.tags["mpsrun.model_export"].startswith("ahead: exported while training"), run.data.tags["mpsrun.model_export"]
    c = work.client()
    assert sorted(a.path for a in c.list_artifacts(run.info.run_id, "figures")) == [
        "figures/confusion_matrix.png", "figures/learning_curves.png", "figures/per_class_accuracy.png"]
    assert [a.path for a in c.list_artifacts(run.info.run_id, "tables")] == ["tables/per_class_accuracy.json"]
    said = {"before": "could not be asked: the drawer process ended", "while drawing": "could not serve: the drawer process ended"}[when]
    assert f"figures: the drawer process {said}" in run.data.tags["mpsrun.notes"], run.data.tags["mpsrun.notes"]  # said, and so on screen
    assert run.data.tags["mpsrun.figures"].startswith(f"drawn by the MLflow helper (the drawer process {said}"), run.data.tags["mpsrun.figures"]


def test_a_model_above_the_limit_is_not_handed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mpsrun.track.helper import background

    monkeypatch.setenv(exporter.ENV, "1")
    monkeypatch.setenv(exporter.MAX_ENV, "2")
    tracker = background.start(f"sqlite:///{tmp_path}/mlflow.db", "big", mode="inline", export_ahead=True)
    started = tracker._exporter
    assert started is not None

    def never() -> tuple:
        raise AssertionError("a model above the limit is not copied")

    tracker.model_ahead(never, nbytes=3 * 2**20)
    assert tracker._exporter is None and started.proc.poll() is not None
    assert tracker.export_why == "the model's 3 MiB is above 2 MiB (MPSRUN_EXPORT_AHEAD_MAX_MB)"
    tracker.close()
