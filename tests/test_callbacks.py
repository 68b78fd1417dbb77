"""The callback interface through a real run: hooks in order, logging to the run, stopping early."""

from __future__ import annotations

from mpsrun.plugins import resolve
from mpsrun.train import runner
from mpsrun.train.controls.callbacks import Callback, RunState
from tests.conftest import RECIPES


class _Recorder(Callback):
    def __init__(self, stop_after: int) -> None:
        self.calls: list[str] = []
        self.stop_after = stop_after

    def on_fit_start(self, run: RunState) -> None:
        self.calls.append("fit_start")

    def on_epoch_start(self, run: RunState, epoch: int) -> None:
        self.calls.append(f"start{epoch}")

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        self.calls.append(f"end{epoch}")
        run.log.log_metrics({"seen_val_loss": metrics["val_loss"]}, step=epoch)
        if epoch + 1 >= self.stop_after:
            run.request_stop(f"asked after epoch {epoch}")

    def on_fit_end(self, run: RunState) -> None:
        self.calls.append("fit_end")


def test_callback_sees_epochs_logs_and_stops_the_run(work, monkeypatch) -> None:
    monkeypatch.chdir(work.path)
    setup = runner.prepare(resolve(RECIPES / "digits_mlp.yaml", ["device=cpu", "epochs=5", "tracking.log_model=false"]))
    rec = _Recorder(stop_after=2)
    setup.callbacks.append(rec)
    summary = runner.execute(setup, None)
    assert rec.calls == ["fit_start", "start0", "end0", "start1", "end1", "fit_end"]
    assert len(summary.result.epochs) == 2 and summary.result.stop_reason == "asked after epoch 1"
    run_id = summary.run.run_id
    assert [s for s, _ in work.history(run_id, "seen_val_loss")] == [0, 1]
    assert [v for _, v in work.history(run_id, "seen_val_loss")] == [v for _, v in work.history(run_id, "val_loss")]
