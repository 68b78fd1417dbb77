"""`mpsrun sweep` for real: Optuna studies in real storages, trials as real MLflow child runs, real signals.

Digits and a tiny MLP, one epoch where a test allows it; the in-process CLI where no
signal is involved, the console script as a subprocess where one is.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Workdir

RECIPE = """\
device: cpu
epochs: {epochs}
batch_size: 64
seed: 0
dataset:
  name: digits
model:
  name: mlp
  hidden: [16]
optimizer:
  name: sgd
  lr: 0.05
tracking:
  experiment: {experiment}
sweep:
  metric: val_loss
  trials: {trials}
  sampler: {sampler}
  pruner: {pruner}
  params:
{params}
"""


def recipe(work: Workdir, name: str, experiment: str, params: str, trials: int = 3, epochs: int = 1, sampler: str = "random", pruner: str = "none") -> Path:
    params = "\n".join("    " + line for line in params.strip().splitlines())
    return work.write(name, RECIPE.format(epochs=epochs, experiment=experiment, trials=trials, sampler=sampler, pruner=pruner, params=params))


def children(work: Workdir, experiment: str) -> tuple[list, list]:
    runs = work.runs(experiment)
    return [r for r in runs if r.data.tags.get("mpsrun.sweep") == "parent"], [r for r in runs if r.data.tags.get("mpsrun.sweep") == "trial"]


def study(path: Path, name: str):  # type: ignore[no-untyped-def]
    import optuna

    from mpsrun.sweep import storage

    return optuna.load_study(study_name=name, storage=storage.open_storage(f"journal:{path / 'mlruns' / 'optuna.journal'}"))


def test_trials_are_child_runs_the_parent_holds_the_best_and_best_recipe_reproduces_it(work: Workdir) -> None:
    path = recipe(work, "s.yaml", "sw1", "optimizer.lr: {low: 0.01, high: 0.5, log: true}\nmodel.hidden: [[16], [32]]", trials=3)
    r = work.cli("sweep", str(path))
    assert r.exit_code == 0, r.output
    assert "done 3/3" in r.output and "best" in r.output
    (parent,), kids = children(work, "sw1")
    assert len(kids) == 3
    assert {k.data.tags["mlflow.parentRunId"] for k in kids} == {parent.info.run_id}
    assert sorted(int(k.data.tags["mpsrun.sweep.trial"]) for k in kids) == [0, 1, 2]
    assert {k.data.tags["mpsrun.sweep.state"] for k in kids} == {"COMPLETE"}
    assert all(k.info.status == "FINISHED" and "val_loss" in k.data.metrics and "optimizer.lr" in k.data.params for k in kids)
    # every trial has its dataset inputs, the later ones from the data the worker's helper kept (record._splits_key)
    assert all({i.tags[0].value for i in k.inputs.dataset_inputs} == {"training", "validation"} for k in kids), [k.inputs for k in kids]
    best = min(kids, key=lambda k: k.data.metrics["val_loss"])
    assert parent.data.metrics["best_value"] == best.data.metrics["val_loss"]
    assert parent.data.params["best.optimizer.lr"] == best.data.params["optimizer.lr"]
    assert parent.data.tags["mpsrun.sweep.best_run_id"] == best.info.run_id
    c = work.client()
    files = {a.path for a in c.list_artifacts(parent.info.run_id)} | {a.path for a in c.list_artifacts(parent.info.run_id, "figures")}
    assert {"best_recipe.yaml", "trials.csv", "figures/optimization_history.png", "figures/param_optimizer.lr.png"} <= files
    best_yaml = Path(c.download_artifacts(parent.info.run_id, "best_recipe.yaml", str(work.path)))
    assert "sweep:" not in best_yaml.read_text()

    again = work.cli("run", str(best_yaml), "-q")  # the best trial, trained again as a plain run
    assert again.exit_code == 0, again.output
    rerun = [x for x in work.runs("sw1") if "mpsrun.sweep" not in x.data.tags]
    assert len(rerun) == 1
    assert rerun[0].data.metrics["val_loss"] == best.data.metrics["val_loss"]  # exactly: same seed, same data order

    more = work.cli("sweep", str(path), "--trials", "4")  # the same study goes on, under the same parent
    assert more.exit_code == 0, more.output
    assert "continued: 3 of 4" in more.output
    parents, kids = children(work, "sw1")
    assert [p.info.run_id for p in parents] == [parent.info.run_id] and len(kids) == 4


def test_median_pruner_prunes_trials_that_lag(work: Workdir) -> None:
    """A learning rate of 1e-4 barely moves the loss; most choices learn: the median pruner stops the laggards early."""
    path = recipe(work, "p.yaml", "sw2", "optimizer.lr: [0.0001, 0.4, 0.5, 0.6]", trials=8, epochs=3, pruner="median")
    r = work.cli("sweep", str(path))
    assert r.exit_code == 0, r.output
    _, kids = children(work, "sw2")
    assert len(kids) == 8
    pruned = [k for k in kids if k.data.tags["mpsrun.sweep.state"] == "PRUNED"]
    assert pruned, [(k.data.params["optimizer.lr"], k.data.tags["mpsrun.sweep.state"]) for k in kids]
    assert all(k.info.status == "FINISHED" and "median pruner" in k.data.tags["mpsrun.sweep.pruned"] for k in pruned)
    assert all(k.data.params["optimizer.lr"] == "0.0001" for k in pruned)
    assert all(len(work.history(k.info.run_id, "val_loss")) < 3 for k in pruned)  # stopped before the last epoch
    s = study(work.path, "sw2")
    assert sum(1 for t in s.trials if t.state.name == "PRUNED") == len(pruned)


def test_a_diverging_trial_is_failed_and_the_sweep_goes_on(work: Workdir) -> None:
    path = recipe(work, "d.yaml", "sw3", "optimizer.lr: [0.05, 1.0e+12]", trials=3, sampler="grid")
    r = work.cli("sweep", str(path))
    assert r.exit_code == 0, r.output
    said = "sampler grid: 2 points, so 2 trials rather than 3"
    assert said in r.output
    parents, kids = children(work, "sw3")
    assert said in parents[0].data.tags["mpsrun.notes"]  # what the sweep said is kept on its parent run
    by_lr = {k.data.params["optimizer.lr"]: k for k in kids}
    bad = by_lr["1000000000000.0"]
    assert bad.data.tags["mpsrun.sweep.state"] == "FAILED" and bad.info.status == "FAILED"
    assert "non-finite" in bad.data.tags["mpsrun.error"].lower() or "nan" in bad.data.tags["mpsrun.error"].lower()
    assert by_lr["0.05"].data.tags["mpsrun.sweep.state"] == "COMPLETE"


def test_no_trial_completed_exits_1(work: Workdir) -> None:
    path = recipe(work, "f.yaml", "sw4", "optimizer.lr: [1.0e+12]", trials=1, sampler="grid")
    r = work.cli("sweep", str(path))
    assert r.exit_code == 1, r.output
    assert "no trial completed" in r.output


# ----------------------------------------------------------------------------- processes and signals


def _mpsrun(cwd: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.Popen([sys.executable, "-m", "mpsrun", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _mid_trial(path: Path, name: str) -> set[int]:
    """Trials that are RUNNING with their MLflow run started (the attribute is set as training begins)."""
    if not (path / "mlruns" / "optuna.journal").exists():
        return set()
    try:
        return {t.number for t in study(path, name).trials if t.state.name == "RUNNING" and "mpsrun.run_id" in t.user_attrs}
    except Exception:  # noqa: BLE001 - the study is not created yet
        return set()


def _wait_mid_trial(proc: subprocess.Popen, path: Path, name: str, before: set[int] = frozenset(), timeout: float = 120) -> set[int]:  # type: ignore[assignment]
    """Until a trial that was not running before is training; returns the trials mid-way."""
    deadline = time.monotonic() + timeout
    while not (_mid_trial(path, name) - before):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no trial got going"
        time.sleep(0.1)
    return _mid_trial(path, name)


def test_a_lost_trial_s_untagged_run_is_settled_when_the_results_are_published(work: Workdir) -> None:
    """A lost trial whose run kept RUNNING without its tag (a worker stopped before its helper wrote it): the next
    command's publish ends the run KILLED and tags it not counted, so the runs agree with the study."""
    path = recipe(work, "s.yaml", "sw9", "optimizer.lr: {low: 0.01, high: 0.2}", trials=1)
    assert work.cli("sweep", str(path), "-q").exit_code == 0
    (parent_run,), _ = children(work, "sw9")
    s = study(work.path, "sw9")
    from mlflow.tracking import MlflowClient

    from mpsrun.sweep import storage

    c = MlflowClient(work.uri)
    orphan = c.create_run(parent_run.info.experiment_id, tags={"mlflow.parentRunId": parent_run.info.run_id, "mpsrun.sweep": "trial"})
    t = s.ask()
    t.set_user_attr(storage.RUN_ID, orphan.info.run_id)
    storage.mark_lost(s, t, "its worker died (test)")
    assert c.get_run(orphan.info.run_id).info.status == "RUNNING"
    # a run the study never got the id of (its worker killed between creating its fused group's runs and keeping
    # their ids on the trials): found by its trial tag among the parent's children; another trial's RUNNING run is left alone
    u = s.ask()
    untold = c.create_run(parent_run.info.experiment_id, tags={"mlflow.parentRunId": parent_run.info.run_id, "mpsrun.sweep": "trial",
                                                              "mpsrun.sweep.trial": str(u.number)})
    storage.mark_lost(s, u, "its worker died (untold)")
    other = c.create_run(parent_run.info.experiment_id, tags={"mlflow.parentRunId": parent_run.info.run_id, "mpsrun.sweep": "trial",
                                                             "mpsrun.sweep.trial": "0"})  # trial 0 COMPLETE: not lost

    assert work.cli("sweep", str(path), "-q").exit_code == 0  # the study holds its one trial: nothing trains, results published
    run = c.get_run(orphan.info.run_id)
    assert run.info.status == "KILLED" and run.data.tags["mpsrun.sweep.counted"] == "false"
    assert run.data.tags["mpsrun.sweep.why"] == "its worker died (test)"
    run = c.get_run(untold.info.run_id)
    assert run.info.status == "KILLED" and run.data.tags["mpsrun.sweep.counted"] == "false"
    assert run.data.tags["mpsrun.sweep.why"] == "its worker died (untold)"
    assert c.get_run(other.info.run_id).info.status == "RUNNING"
    c.set_terminated(other.info.run_id, "FINISHED")
    _, kids = children(work, "sw9")
    assert len([k for k in kids if k.data.tags.get("mpsrun.sweep.counted") != "false"]) == 2  # trial 0's and the stand-in's


def _wait_epochs(proc: subprocess.Popen, work: Workdir, name: str, before: set[int], timeout: float = 120) -> int:
    """Until a trial not in `before` has finished an epoch (its run's `mpsrun.epochs_done`); returns that run's count."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(work.uri)
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "no epoch finished"
        try:
            trials = [t for t in study(work.path, name).trials if t.state.name == "RUNNING" and t.number not in before]
        except Exception:  # noqa: BLE001 - the journal mid-write
            trials = []
        for t in trials:
            rid = t.user_attrs.get("mpsrun.run_id")
            done = c.get_run(rid).data.tags.get("mpsrun.epochs_done") if rid else None
            if done:
                return int(done)
        time.sleep(0.05)


def test_killed_worker_then_terminated_then_rerun_gives_exactly_trials_finished(work: Workdir) -> None:
    """SIGKILL mid-trial, then SIGTERM mid-trial (exit 143, runs KILLED, every finished epoch's metrics kept), then a
    full run: `trials` counted, nothing RUNNING, each lost trial retried once."""
    path = recipe(work, "k.yaml", "sw5", "optimizer.lr: {low: 0.01, high: 0.2}", trials=3, epochs=200)  # killed long before
    p = _mpsrun(work.path, "sweep", str(path), "-q")
    killed = _wait_mid_trial(p, work.path, "sw5")
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()

    p = _mpsrun(work.path, "sweep", str(path), "-q")
    _wait_mid_trial(p, work.path, "sw5", before=killed)
    seen = _wait_epochs(p, work, "sw5", killed)  # an epoch finished: what it produced must outlive the signal
    os.killpg(p.pid, signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 143, out
    # at once, as the process ends (not settled later by the next command): the group's members KILLED, each keeping
    # every epoch it finished (a fused group trains in lockstep, so all the same count)
    _, kids = children(work, "sw5")
    first = {k.data.tags["mpsrun.sweep.group"] for k in kids if int(k.data.tags["mpsrun.sweep.trial"]) in killed}
    termed = [k for k in kids if k.data.tags["mpsrun.sweep.group"] not in first]
    assert len(termed) == 3 and {k.info.status for k in termed} == {"KILLED"}, [(k.info.status, k.data.tags) for k in termed]
    assert {k.data.tags.get("mpsrun.sweep.why") for k in termed} == {"interrupted (SIGTERM)"}
    assert {k.data.tags.get("mpsrun.sweep.counted") for k in termed} == {"false"}
    from mlflow.tracking import MlflowClient

    c = MlflowClient(work.uri)
    done = {int(k.data.tags["mpsrun.epochs_done"]) for k in termed}
    assert len(done) == 1 and seen <= min(done) < 200, done
    for k in termed:
        for name in ("train_loss", "val_loss", "val_accuracy"):
            assert sorted(m.step for m in c.get_metric_history(k.info.run_id, name)) == list(range(min(done))), (k.info.run_id, name)

    r = work.cli("sweep", str(path), "epochs=2", "-q")  # the rest of the study, quickly (in-process: this is not about signals)
    assert r.exit_code == 0, r.output
    parents, kids = children(work, "sw5")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert not [k for k in work.runs("sw5") if k.info.status == "RUNNING"]
    counted = [k for k in kids if k.data.tags.get("mpsrun.sweep.counted") != "false"]
    assert len(counted) == 3 and all(k.data.tags["mpsrun.sweep.state"] == "COMPLETE" for k in counted)
    # the three trials train as one fused group (sweep.fuse: auto), so each kill loses the whole group: 3 + 3
    lost_runs = [k for k in kids if k.data.tags.get("mpsrun.sweep.counted") == "false"]
    assert len(lost_runs) == 6 and {k.info.status for k in lost_runs} == {"KILLED"}
    assert {k.data.tags.get("mpsrun.sweep.group_size") for k in lost_runs} == {"3"}
    s = study(work.path, "sw5")
    from mpsrun.sweep import storage

    lost = storage.lost_trials(s)
    assert len(lost) == 6
    finished = [t for t in s.trials if storage.counted(t, lost)]
    assert len(finished) == 3 and len({t.number for t in finished}) == 3  # none counted twice
    assert not [t for t in s.trials if t.state.name == "RUNNING"]
    retried = [t for t in s.trials if "mpsrun.retry_of" in t.user_attrs]
    assert len(retried) == 6  # each lost trial queued again with its parameters


def test_two_workers_on_a_new_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No store yet: two workers (this process and one more) create and share it; exactly `trials` trials, one parent;
    every trial's end, whichever worker ran it, shown once on this command's screen."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MPSRUN_SWEEP_TOGETHER", "1")  # both workers in from the first trial (else worker 0 may take them all)
    w = Workdir(tmp_path)
    path = recipe(w, "w.yaml", "sw6", "optimizer.lr: {low: 0.01, high: 0.2}", trials=6, epochs=2)
    r = w.cli("sweep", str(path), "--workers", "2")
    assert r.exit_code == 0, r.output
    shown = [line.split()[1] for line in r.output.splitlines() if line.startswith("trial ") and " COMPLETE " in line]
    assert sorted(shown, key=int) == [str(n) for n in range(6)], r.output
    parents, kids = children(w, "sw6")
    assert len(parents) == 1 and len(kids) == 6
    assert len({k.data.tags["mpsrun.pid"] for k in kids}) == 2  # both workers trained
    s = study(tmp_path, "sw6")
    assert sorted(t.number for t in s.trials if t.state.name == "COMPLETE") == list(range(6))


def test_postgresql_storage_with_two_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import servers

    if servers.pg_bin_dir() is None:
        pytest.skip("PostgreSQL binaries unavailable")
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="mpsrun-sweep-pg-"))  # in /tmp, which `postgres` can traverse (see servers.start_stack)
    os.chmod(base, 0o755)
    (base / "pg").mkdir()
    pg = servers.Postgres(base / "pg").start()
    try:
        w = Workdir(tmp_path / "work")
        (tmp_path / "work").mkdir()
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        monkeypatch.setenv("MPSRUN_SWEEP_TOGETHER", "1")  # both workers in from the first trial
        monkeypatch.chdir(w.path)
        path = recipe(w, "pg.yaml", "sw7", "optimizer.lr: {low: 0.01, high: 0.2}", trials=4)
        r = w.cli("sweep", str(path), "--workers", "2", "--storage", pg.dsn(), "-q")
        assert r.exit_code == 0, r.output
        rows = pg.query("SELECT t.number, t.state FROM trials t JOIN studies s USING (study_id) WHERE s.study_name = 'sw7' ORDER BY t.number")
        assert [s for _, s in rows].count("COMPLETE") == 4
        parents, kids = children(w, "sw7")
        assert len(parents) == 1 and len(kids) == 4
        assert len({k.data.tags["mpsrun.pid"] for k in kids}) == 2
    finally:
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_runs_shows_a_sweep_with_its_progress_and_resume_continues_it(work: Workdir) -> None:
    path = recipe(work, "r.yaml", "sw8", "optimizer.lr: {low: 0.01, high: 0.2}", trials=3)
    r = work.cli("sweep", str(path), "--trials", "1")
    assert r.exit_code == 0, r.output
    (parent,), _ = children(work, "sw8")
    listing = work.cli("runs", "--experiment", "sw8")
    assert "1/1 trials" in listing.output
    more = work.cli("resume", parent.info.run_id, "sweep.trials=2")
    assert more.exit_code == 0, more.output
    assert "continued: 1 of 2" in more.output
    parents, kids = children(work, "sw8")
    assert [p.info.run_id for p in parents] == [parent.info.run_id] and len(kids) == 2
    assert "2/2 trials" in work.cli("runs", "--experiment", "sw8").output


def test_a_trial_whose_heartbeat_stopped_is_failed_queued_again_and_not_counted(tmp_path: Path) -> None:
    """A database storage (SQLite here, as PostgreSQL): a worker on another machine that stopped beating."""
    import optuna

    from mpsrun.sweep import storage

    seen = []
    st = storage.open_storage(f"sqlite:///{tmp_path / 'optuna.db'}", on_failed=lambda s, t: seen.append(t.number), heartbeat_s=1, grace_s=2)
    s = optuna.create_study(study_name="hb", storage=st)
    t = s.ask()
    t.suggest_float("optimizer.lr", 0.01, 0.1)
    for k, v in {"mpsrun.host": "elsewhere", "mpsrun.pid": "1", "mpsrun.pid_start": "0"}.items():
        t.set_user_attr(k, v)  # not this machine: only the heartbeat can tell
    st.record_heartbeat(t._trial_id)
    time.sleep(3.5)
    storage.reap(s, lambda trial, why: None)
    trials = s.get_trials()
    lost = storage.lost_trials(s)
    assert trials[0].state.name == "FAIL" and "heartbeat" in lost[0]
    assert seen == [0]
    assert not storage.counted(trials[0], lost) and storage.budget(s, 1) == (0, 0)
    assert trials[1].state.name == "WAITING" and trials[1].user_attrs["mpsrun.retry_of"] == 0
    assert trials[1].system_attrs["fixed_params"] == {"optimizer.lr": trials[0].params["optimizer.lr"]}


def test_a_trial_that_raises_before_training_is_a_failed_child_run_with_its_error(work: Workdir) -> None:
    """An activation the signature allows but one value makes the model plugin raise: FAILED, error on its run, sweep goes on."""
    path = recipe(work, "x.yaml", "sw9", "model.hidden: [[16], [-3]]", trials=2, sampler="grid")
    r = work.cli("sweep", str(path))
    assert r.exit_code == 0, r.output
    _, kids = children(work, "sw9")
    states = {k.data.params["model.hidden"]: (k.data.tags["mpsrun.sweep.state"], k.info.status) for k in kids}
    assert states == {"[16]": ("COMPLETE", "FINISHED"), "[-3]": ("FAILED", "FAILED")}, states
    bad = next(k for k in kids if k.data.params["model.hidden"] == "[-3]")
    assert "mpsrun.error" in bad.data.tags


def _processes_naming(text: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


def test_extra_workers_start_before_the_study_and_end_when_the_command_fails_to_open_it(work: Workdir) -> None:
    """The extra workers are launched before the study and the parent run exist (they load meanwhile); a storage that
    does not answer is bad input (exit 2), and no worker is left behind, whichever point of its start it had reached."""
    path = recipe(work, "early.yaml", "sw_early", "optimizer.lr: {low: 0.01, high: 0.2}", trials=2)
    r = work.cli("sweep", str(path), "--workers", "3", "--storage", "postgresql://nobody@127.0.0.1:9/none")
    assert r.exit_code == 2, r.output
    assert "cannot open the Optuna storage" in r.output
    deadline = time.monotonic() + 10
    while _processes_naming(str(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(path)) == []
    parents, kids = children(work, "sw_early")
    assert parents == [] and kids == []


def test_sigterm_while_the_workers_still_load_ends_everything_cleanly(work: Workdir) -> None:
    """SIGTERM as soon as the extra worker exists (it loads while the command opens the study and the parent run):
    exit 143 as for `run`, no worker, helper or daemon left behind, and no parent run left RUNNING."""
    path = recipe(work, "t.yaml", "sw_term", "optimizer.lr: {low: 0.01, high: 0.2}", trials=4)
    p = _mpsrun(work.path, "sweep", str(path), "--workers", "2", "-q")
    deadline = time.monotonic() + 60
    while not [pid for pid in _processes_naming(str(path)) if pid != p.pid] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, "the command ended before its extra worker started"
    os.kill(p.pid, signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 143, out
    deadline = time.monotonic() + 30
    while _processes_naming(str(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(path)) == []
    assert not [r for r in work.runs("sw_term") if r.info.status == "RUNNING"]
