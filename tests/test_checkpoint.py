"""Checkpoints, `mpsrun resume` and `mpsrun runs`: real training, a real SQLite store, real processes.

The SIGKILL test is the issue's acceptance check: a run killed in the middle of an
epoch is shown as interrupted, resumes in the same MLflow run and ends with the
per-epoch val_loss of a run that was never interrupted.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

MPSRUN = str(Path(sys.executable).parent / "mpsrun")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ENV.pop("MLFLOW_TRACKING_URI", None)

# About 1.5-5 s per epoch on one core: long enough to kill mid-epoch, short overall. (At 3,000
# samples an epoch took 0.44 s once start-up got faster, and a whole run could end between
# two polls of wait_for_checkpoint on a busy machine; at 8,000, 0.55 s on a quiet 2-core machine, and a CI run
# ended before its first checkpoint was seen.)
# Dropout on, so the resumed run also needs the restored random generator.
SLOW = """\
device: cpu
epochs: 3
batch_size: 8
seed: 3
dataset: {name: synthetic, shape: [64], dtype: float32, train_size: 24000, val_size: 400, num_classes: 4}
model: {name: mlp, hidden: [256, 256], dropout: 0.2}
optimizer: {name: adam, lr: 0.001}
tracking: {experiment: slow, log_model: false, figures: false}  # what these tests check is the epochs and checkpoints: 2.4 s less a run
"""

DIGITS = """\
device: cpu
epochs: 3
batch_size: 64
seed: 0
dataset: {name: digits}
model: {name: mlp, hidden: [32]}
optimizer: {name: sgd, lr: 0.05}
tracking: {experiment: quick}
"""


def _env(work: Any) -> dict[str, str]:
    return {**ENV, "TMPDIR": str(work.path)}  # a SIGKILLed run's local checkpoint copies stay in the test's folder


def cli_proc(work: Any, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MPSRUN, *args], cwd=work.path, env=_env(work), capture_output=True, text=True, timeout=300)


def start(work: Any, *args: str) -> subprocess.Popen:
    return subprocess.Popen([MPSRUN, *args], cwd=work.path, env=_env(work), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_checkpoint(work: Any, experiment: str, epoch: int, proc: subprocess.Popen, timeout: float = 120) -> str:
    """The run id, once the checkpoint of `epoch` (0-based) or a later one, but not the last, is durable in the store.

    A later one counts: the store is polled, and on a busy machine a poll can miss an
    epoch's tag; any checkpoint but the last still leaves an epoch to stop in the middle of.
    """
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the run ended early: {proc.stdout.read() if proc.stdout else ''}"
        for r in work.runs(experiment):
            done = r.data.tags.get("mpsrun.checkpoint.epoch")
            if r.info.status == "RUNNING" and done is not None and epoch <= int(done) < int(r.data.tags.get("mpsrun.epochs_planned", "3")) - 1:
                return r.info.run_id
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of epoch {epoch} within {timeout} s")


def val_losses(work: Any, run_id: str) -> list[tuple[int, float]]:
    return sorted(work.history(run_id, "val_loss"))


def test_sigkill_mid_epoch_shows_interrupted_and_resumes_exactly(work: Any) -> None:
    work.write("slow.yaml", SLOW)
    ref = cli_proc(work, "run", "slow.yaml", "-q")
    assert ref.returncode == 0, ref.stdout + ref.stderr
    (ref_run,) = work.runs("slow")
    expected = val_losses(work, ref_run.info.run_id)
    assert [s for s, _ in expected] == [0, 1, 2]

    proc = start(work, "run", "slow.yaml", "-q")
    run_id = wait_for_checkpoint(work, "slow", 0, proc)
    time.sleep(0.05)  # into epoch 2 (index 1): mid-epoch
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert work.client().get_run(run_id).info.status == "RUNNING"  # what MLflow alone would show forever

    listed = work.cli("runs", "--json")
    assert listed.exit_code == 0, listed.stderr
    row = next(r for r in json.loads(listed.stdout) if r["run_id"] == run_id)
    assert row["shown"] == "INTERRUPTED" and row["status"] == "RUNNING"
    assert "has exited" in row["why"]
    assert row["resume"] == f"mpsrun resume {run_id}"
    assert row["epochs_planned"] == 3 and row["epochs_done"] in (1, 2)
    table = work.cli("runs", "--experiment", "slow")
    assert "INTERRUPTED" in table.stdout and f"mpsrun resume {run_id}" in table.stdout

    resumed = cli_proc(work, "resume", run_id, "-q")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    run = work.client().get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mpsrun.resumed"] == "1"
    assert "took over run" in " ".join(resumed.stdout.split())  # the killed owner never let go: taken over, said and tagged
    assert f"pid {proc.pid} on host" in run.data.tags["mpsrun.owner.takeover.1"] and "has exited" in run.data.tags["mpsrun.owner.takeover.1"]
    got = val_losses(work, run_id)
    assert [s for s, _ in got] == [0, 1, 2], "each epoch logged exactly once: no duplicated or missing steps"
    for (_, a), (_, b) in zip(got, expected):
        assert abs(a - b) <= 1e-6, (got, expected)
    assert len(work.runs("slow")) == 2  # the same MLflow run went on; no new one


def test_checkpoint_contents_best_apart_from_last_and_model_from_best(work: Any) -> None:
    # mode max on val_loss: the "best" epoch is the worst one, so best.pt != last.pt for sure.
    work.write("q.yaml", DIGITS)
    r = work.cli("run", "q.yaml", "checkpoint.mode=max", "-q", helper=None)  # the logged model through the default helper process
    assert r.exit_code == 0, r.output
    (run,) = work.runs("quick")
    art = Path(run.info.artifact_uri.removeprefix("file://")) / "checkpoints"
    assert sorted(p.name for p in art.iterdir()) == ["best.pt", "last.pt", "prev.pt"]  # no temporary files left behind
    last = torch.load(art / "last.pt", weights_only=False)
    best = torch.load(art / "best.pt", weights_only=False)
    assert last["epoch"] == 2 and len(last["history"]) == 3
    assert set(last["rng"]) >= {"python", "numpy", "torch"}
    assert last["data_order"] == {"kind": "epoch_seed", "seed": 0}
    losses = [h["val_loss"] for h in last["history"]]
    assert best["epoch"] == losses.index(max(losses)) != 2
    assert "optimizer" in last and "callbacks" in last
    import mlflow

    mlflow.set_tracking_uri(work.uri)
    logged = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model").net.state_dict()
    for k, v in best["model"].items():
        assert torch.equal(logged[k], v), "model_from: best logs the best epoch's weights"
    assert run.data.tags["mpsrun.model_from"].startswith(f"best: epoch {best['epoch']}")
    timings = json.loads(Path(work.client().download_artifacts(run.info.run_id, "mpsrun_timings.json", str(work.path))).read_text())
    assert timings["checkpoint_total_time_s"] > 0
    assert [e["epoch"] for e in timings["checkpoint_epochs"]] == [0, 1, 2]
    assert timings["best"] == {"monitor": "val_loss", "value": pytest.approx(max(losses)), "epoch": best["epoch"]}
    assert not [k for k in run.data.metrics if k.startswith("mpsrun/")], "bookkeeping is no metric (the UI's first charts are the user's)"

    r = work.cli("run", "q.yaml", "model_from=last", "checkpoint.keep=2", "-q")
    assert r.exit_code == 0, r.output
    run2 = work.runs("quick")[-1]
    assert run2.data.tags["mpsrun.model_from"] == "last: epoch 2"
    art2 = Path(run2.info.artifact_uri.removeprefix("file://")) / "checkpoints"
    assert sorted(p.name for p in art2.iterdir()) == ["best.pt", "epoch-0001.pt", "epoch-0002.pt", "last.pt", "prev.pt"]


def test_checkpoint_every_zero_is_off_and_resume_refuses(work: Any) -> None:
    work.write("q.yaml", DIGITS)
    r = work.cli("run", "q.yaml", "checkpoint.every=0", "-q")
    assert r.exit_code == 0, r.output
    (run,) = work.runs("quick")
    assert run.data.tags["mpsrun.checkpoint"].startswith("off")
    assert "mpsrun.model_from" in run.data.tags and "checkpoints off" in run.data.tags["mpsrun.model_from"]
    r = work.cli("resume", run.info.run_id)
    assert r.exit_code == 2
    assert "no checkpoint" in r.stderr


def test_resume_refusals(work: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    work.write("q.yaml", DIGITS)
    r = work.cli("resume", "0123456789abcdef")
    assert r.exit_code == 2 and "no run '0123456789abcdef'" in r.stderr and work.uri in r.stderr.replace("\n", "")

    assert work.cli("run", "q.yaml", "-q").exit_code == 0
    (run,) = work.runs("quick")
    r = work.cli("resume", run.info.run_id)
    assert r.exit_code == 2 and "FINISHED" in r.stderr and "epochs=N" in r.stderr
    r = work.cli("resume", run.info.run_id, "epochs=2")
    assert r.exit_code == 2

    # A RUNNING run whose process is alive (this very test process) is not resumed.
    from mpsrun.track.store import liveness

    c = work.client()
    alive = c.create_run(run.info.experiment_id, tags=liveness.identity())
    r = work.cli("resume", alive.info.run_id)
    assert r.exit_code == 2 and "still running" in r.stderr

    # extending a finished run: epochs=N continues the same run at the next step, from any folder
    elsewhere = work.path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = work.cli("resume", run.info.run_id, "epochs=4", "-q", "--tracking-uri", work.uri)
    assert r.exit_code == 0, r.output
    assert not (elsewhere / "mlruns").exists()
    assert [s for s, _ in work.history(run.info.run_id, "val_loss")] == [0, 1, 2, 3]
    assert work.client().get_run(run.info.run_id).data.tags["mpsrun.epochs_planned"] == "4"


def test_liveness_across_hosts() -> None:
    from mpsrun.track.store import liveness

    me = liveness.identity()
    now = float(me[liveness.HEARTBEAT])
    assert liveness.check(me, now=now).state == "alive"
    recycled = {**me, liveness.PID_START: str(float(me[liveness.PID_START]) - 1000)}
    assert liveness.check(recycled, now=now).gone  # same pid, another process
    other = {**me, liveness.HOST: "elsewhere"}
    assert liveness.check(other, now=now + 10).state == "alive"  # fresh heartbeat from another host
    v = liveness.check(other, now=now + liveness.STALE_S + 1)
    assert v.gone and "elsewhere" in v.reason
    assert liveness.check({}, now=now).state == "unknown"


def test_data_order_is_a_pure_function_of_seed_and_epoch() -> None:
    from mpsrun.train.loop.data import ResidentBatches

    x, y = torch.arange(50).float().unsqueeze(1), torch.arange(50)
    a = ResidentBatches(x, y, 8, torch.device("cpu"), True, seed=5)
    b = ResidentBatches(x, y, 8, torch.device("cpu"), True, seed=5)
    for e in range(3):  # a ran epochs 0..2 first; b jumps straight to epoch 3
        a.set_epoch(e)
        a.epoch_tensors()
    a.set_epoch(3)
    b.set_epoch(3)
    assert torch.equal(a.epoch_tensors()[1], b.epoch_tensors()[1])
    b.set_epoch(4)
    assert not torch.equal(a.epoch_tensors()[1], b.epoch_tensors()[1])


@pytest.mark.parametrize("mode", ["stop", "warn"])
def test_non_finite_loss(work: Any, mode: str) -> None:
    work.write("q.yaml", DIGITS)
    r = work.cli("run", "q.yaml", "optimizer.lr=1e9", f"on_nonfinite={mode}", "-q")
    (run,) = work.runs("quick")
    tag = run.data.tags["mpsrun.nonfinite"]
    assert "non-finite loss" in tag and "epoch 1" in tag
    if mode == "stop":
        assert r.exit_code == 1, r.output
        assert run.info.status == "FAILED"
        assert "non-finite loss" in run.data.tags["mpsrun.error"]
        assert "non-finite loss at epoch 1" in r.stderr.replace("\n", " ")
        assert "mpsrun.checkpoint.epoch" not in run.data.tags  # the poisoned epoch was never saved
        assert work.cli("resume", run.info.run_id).exit_code == 2  # ... so nothing to resume from
    else:
        assert r.exit_code == 0, r.output
        assert run.info.status == "FINISHED"
        assert "warned" in tag


def test_resume_a_diverged_run_with_another_learning_rate(work: Any) -> None:
    """The last good checkpoint stays; `resume ID optimizer.lr=...` continues from it with the new rate."""
    work.write("q.yaml", DIGITS)
    # one sane epoch, then extended with a rate that diverges at once
    assert work.cli("run", "q.yaml", "epochs=1", "-q").exit_code == 0
    (run,) = work.runs("quick")
    rid = run.info.run_id
    r = work.cli("resume", rid, "epochs=3", "optimizer.lr=1e9", "-q")
    assert r.exit_code == 1, r.output
    failed = work.client().get_run(rid)
    assert failed.info.status == "FAILED" and "epoch 2" in failed.data.tags["mpsrun.nonfinite"]
    assert failed.data.tags["mpsrun.checkpoint.epoch"] == "0"  # the last good one
    r = work.cli("resume", rid, "epochs=3", "optimizer.lr=0.05", "-q")
    assert r.exit_code == 0, r.output
    assert work.client().get_run(rid).info.status == "FINISHED"
    hist = work.history(rid, "val_loss")
    # step 1 holds the diverged attempt (nan, kept as evidence) and the retry; the retry is finite
    assert sorted(s for s, _ in hist) == [0, 1, 1, 2]
    assert sum(1 for s, v in hist if s == 1 and math.isfinite(v)) == 1
    assert all(math.isfinite(v) for s, v in hist if s == 2)


def test_an_epoch_whose_metrics_landed_without_its_checkpoint_is_not_logged_twice(work: Any) -> None:
    """The stop that falls between an epoch's metrics (durable first) and its checkpoint.

    Made exact here: a 2-epoch run, marked KILLED, gets a third epoch's metrics logged by
    hand, as a run killed after writing them but before its checkpoint would leave it.
    Resuming to 3 epochs trains that epoch again from checkpoint 2 and must not log it a
    second time. (A FAILED run's diverged epoch is logged again: see the test below.)
    """
    work.write("q.yaml", DIGITS)
    r = work.cli("run", "q.yaml", "epochs=2", "-q")
    assert r.exit_code == 0, r.output
    (run,) = work.runs("quick")
    rid = run.info.run_id
    work.client().update_run(rid, status="KILLED")  # as a stopped run is left
    work.client().log_batch(rid, metrics=[
        __import__("mlflow").entities.Metric(k, v, 0, 2) for k, v in (("val_loss", 0.123), ("train_loss", 0.456))
    ])
    r = work.cli("resume", rid, "epochs=3")
    assert r.exit_code == 0, r.output
    assert "epoch 3's metrics reached the run before the stop" in r.output
    got = sorted(work.history(rid, "val_loss"))
    assert [s for s, _ in got] == [0, 1, 2] and got[2][1] == 0.123  # once, as it landed
    assert sorted(s for s, _ in work.history(rid, "train_loss")) == [0, 1, 2]
    assert work.client().get_run(rid).data.tags["mpsrun.epochs_done"] == "3"
    assert work.client().get_run(rid).info.status == "FINISHED"


def test_runs_and_fused_sweeps_leave_no_checkpoint_folders_behind(work: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local copies' folder is made with the first checkpoint and removed at the end: a run without checkpoints and a
    fused sweep's members (each builds a checkpointer, none writes) once left an empty mpsrun-ckpt-* folder each.

    In-process (the checkpointer's folder is made and removed by the run, not at the process's exit): three processes'
    start-up saved. The temporary folder is the test's, for this process and any it starts."""
    import tempfile

    monkeypatch.setenv("TMPDIR", str(work.path))
    monkeypatch.setattr(tempfile, "tempdir", str(work.path))
    work.write("q.yaml", DIGITS + "sweep:\n  metric: val_loss\n  trials: 3\n  params:\n    optimizer.lr: {low: 0.01, high: 0.1}\n")
    for args in (("run", "q.yaml", "epochs=1", "checkpoint.every=0", "-q"), ("run", "q.yaml", "epochs=2", "-q"),
                 ("sweep", "q.yaml", "epochs=1", "-q")):
        r = work.cli(*args)
        assert r.exit_code == 0, r.output
    kids = [x for x in work.runs("quick") if "mlflow.parentRunId" in x.data.tags]
    assert len(kids) == 3 and {k.data.tags.get("mpsrun.sweep.group_size") for k in kids} == {"3"}  # trained fused
    assert sorted(p.name for p in work.path.glob("mpsrun-ckpt-*")) == []
