"""The `sweep:` section: every bad case exits 2 naming its line before anything trains; `run` ignores it.

In-process CLI (the real Typer app), a real store in a temp folder; nothing here trains
except the one `mpsrun run` that shows the section is ignored.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

BASE = """\
device: cpu
epochs: 1
batch_size: 32
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
  experiment: sweepbad
sweep:
  metric: {metric}
  trials: 2
  sampler: {sampler}
  params:
    {param}
"""

CASES = [
    # (param line, metric, sampler, expected message, expected line)
    ("optimizer.lrr: {low: 0.01, high: 0.1}", "val_loss", "tpe", r"unknown argument \(did you mean 'lr'\?\)", 20),
    ("batchsize: [16, 32]", "val_loss", "tpe", r"unknown recipe path \(did you mean 'batch_size'\?\)", 20),
    ("optimizer.lr: {low: 0.5, high: 0.1}", "val_loss", "tpe", r"low 0\.5 is above high 0\.1", 20),
    ("optimizer.lr: {low: 0.0, high: 0.1, log: true}", "val_loss", "tpe", r"a log range must start above 0", 20),
    ("model.hidden: []", "val_loss", "tpe", r"an empty choice list", 20),
    ("model.activation: [relu, swish]", "val_loss", "tpe", r"value .swish.", 20),
    ("optimizer.name: [sgd, adamm]", "val_loss", "tpe", r"unknown optimizer 'adamm' \(did you mean 'adam'", 20),
    ("batch_size: {low: 0.5, high: 64}", "val_loss", "tpe", r"value 0\.5: Input should be a valid integer", 20),
    ("optimizer.lr: {low: 0.01, high: 0.1}", "val_los", "tpe", r"no run logs 'val_los' \(did you mean 'val_loss'", 16),
    ("optimizer.lr: {low: 0.01, high: 0.1}", "val_loss", "grid", r"sampler grid needs a finite grid", 20),
    ("model.hidden: [[16], [32]]", "val_loss", "cmaes", r"sampler cmaes searches numeric ranges only", 20),
    ("optimizer.lr: {low: 0.01, high: 0.1, lg: true}", "val_loss", "tpe", r"unknown key \(did you mean 'log'\?\)", 20),
]


@pytest.mark.parametrize("param,metric,sampler,message,line", CASES, ids=[c[0].split(":")[0] + "-" + c[3][:24] for c in CASES])
def test_bad_sweep_section_exits_2_naming_the_line(work, param, metric, sampler, message, line) -> None:
    path = work.write("bad.yaml", BASE.format(param=param, metric=metric, sampler=sampler))
    r = work.cli("sweep", str(path))
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert re.search(message, r.output), r.output
    assert re.search(rf"bad\.yaml:{line}:\d+", r.output), r.output
    assert not (work.path / "mlruns" / "optuna.journal").exists()  # nothing started, not even the study


def test_a_bad_gpu_sharing_value_exits_2_before_anything_starts(work) -> None:
    path = work.write("gs.yaml", BASE.format(param="optimizer.lr: {low: 0.01, high: 0.1}", metric="val_loss", sampler="tpe"))
    r = work.cli("sweep", str(path), "--workers", "2", "--gpu-sharing", "mps")
    assert r.exit_code == 2, r.output
    assert "--gpu-sharing 'mps': choose one of auto, nvidia-mps, time-slicing" in r.output and "Traceback" not in r.output
    assert work.runs("sweepbad") == []  # no parent run, no trial


def test_metric_the_task_never_logs_exits_2_before_training(work) -> None:
    """val_r2 is a metric some runs log (regression), not this classification one: found once the data is known."""
    path = work.write("r2.yaml", BASE.format(param="optimizer.lr: {low: 0.01, high: 0.1}", metric="val_r2", sampler="tpe"))
    r = work.cli("sweep", str(path))
    assert r.exit_code == 2, r.output
    assert "never logs 'val_r2'" in r.output and "Traceback" not in r.output
    trials = [x for x in work.runs("sweepbad") if x.data.tags.get("mpsrun.sweep") == "trial"]
    assert trials == []  # no trial trained


def test_run_trains_the_recipes_own_values_and_says_the_section_is_ignored(work) -> None:
    path = work.write("ok.yaml", BASE.format(param="optimizer.lr: {low: 0.001, high: 0.1, log: true}", metric="val_loss", sampler="tpe"))
    r = work.cli("run", str(path), "-q")
    assert r.exit_code == 0, r.output
    assert "`sweep:` section is ignored by `mpsrun run`" in r.output
    (run,) = work.runs("sweepbad")
    assert run.data.params["optimizer.lr"] == "0.05"
    assert not any(k.startswith("sweep") for k in run.data.params)


def test_epoch_metric_list_matches_the_engine() -> None:
    """drive.EPOCH_METRICS (kept torch-free for the exit-2 path) names what every epoch logs."""
    from mpsrun.sweep.drive import EPOCH_METRICS
    from mpsrun.train.assemble import ALWAYS

    assert set(ALWAYS) <= set(EPOCH_METRICS)


def test_validate_checks_the_sweep_values_too(work) -> None:
    path = work.write("v.yaml", BASE.format(param="optimizer.name: [sgd, adamm]", metric="val_loss", sampler="tpe"))
    r = work.cli("validate", str(path))
    assert r.exit_code == 2 and re.search(r"v\.yaml:20:\d+: .*unknown optimizer 'adamm'", r.output), r.output


def test_each_worker_takes_its_own_gpu_cuda_mock(work, monkeypatch) -> None:
    """Several GPUs: worker i trains on cuda:i (torch.cuda mocked: this machine has none)."""
    import torch

    from mpsrun.plugins import resolve
    from mpsrun.sweep.worker import device_for

    path = work.write("g.yaml", BASE.format(param="optimizer.lr: [0.1]", metric="val_loss", sampler="tpe").replace("device: cpu", "device: cuda"))
    resolved = resolve(path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [device_for(resolved, i, 4) for i in range(4)] == [{"device": f"cuda:{i}"} for i in range(4)]
    assert device_for(resolved, 0, 1) == {}  # one worker: the recipe's device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_for(resolved, 3, 4) == {}  # one GPU: shared


def test_workers_divide_the_cores_between_them() -> None:
    import os
    import subprocess
    import sys

    code = "import torch; from mpsrun.sweep.worker import share_cores; share_cores(2); print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert int(out) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_workers_sharing_one_gpu_are_told_whether_they_take_turns_simulated_driver(work, tmp_path, monkeypatch) -> None:
    """The note on screen before the workers start (the driver's /proc folder simulated: this machine has no NVIDIA GPU)."""
    from mpsrun.plugins import resolve
    from mpsrun.sweep import drive, gpu_share

    proc = tmp_path / "gpus"
    (proc / "0000:19:00.0").mkdir(parents=True)
    pipe = tmp_path / "mps"
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "take turns" in gpu_share.note(4, "cuda", str(proc))
    assert gpu_share.note(1, "cuda", str(proc)) is None  # one worker
    assert gpu_share.note(4, "cpu", str(proc)) is None  # no GPU in the recipe
    assert gpu_share.note(4, "auto", str(tmp_path / "absent")) is None  # no NVIDIA driver (a Mac)
    pipe.mkdir()
    (pipe / "control").touch()
    assert "through NVIDIA MPS" in gpu_share.note(2, "auto", str(proc))
    (proc / "0000:2a:00.0").mkdir()
    assert gpu_share.note(2, "cuda", str(proc)) is None  # a GPU each (cuda:i)
    assert "4 workers on 2 GPUs: up to 2 share each through NVIDIA MPS" in gpu_share.note(4, "cuda", str(proc))
    assert "share one GPU" in gpu_share.note(4, "cuda:1", str(proc))  # the recipe pins one of them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_share.visible_gpus(str(proc)) == 1 and "share one GPU" in gpu_share.note(4, "cuda", str(proc))
    # the sweep's plan carries it (the launching command prints plan notes and tags the parent with them)
    monkeypatch.setattr(gpu_share, "PROC", str(proc))
    monkeypatch.setattr(gpu_share.note, "__defaults__", (str(proc),))
    path = work.write("s.yaml", BASE.format(param="optimizer.lr: [0.1]", metric="val_loss", sampler="tpe").replace("device: cpu", "device: cuda"))
    p = drive.plan(resolve(path), None, 3, None, None, None)
    assert any("3 workers share one GPU through NVIDIA MPS" in n for n in p.notes), p.notes


FAKE_CONTROL = """#!/bin/sh
# nvidia-cuda-mps-control, simulated: -d makes the control pipe in $CUDA_MPS_PIPE_DIRECTORY; a command on stdin is logged.
if [ "$1" = "-d" ]; then
  echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read cmd; echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""


def _fake_control(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-cuda-mps-control"
    exe.write_text(FAKE_CONTROL)
    exe.chmod(0o755)
    log = tmp_path / "mps.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-system-daemon"))
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    proc = tmp_path / "gpus"
    (proc / "0000:19:00.0").mkdir(parents=True)
    return log, str(proc)


def test_a_private_nvidia_mps_daemon_for_workers_sharing_a_gpu_simulated_driver(tmp_path, monkeypatch) -> None:
    """auto: a daemon of the sweep's own (its pipe folder in this process's environment, for the workers), said, and
    stopped at the end with the environment given back; none for one worker, a CPU recipe, or time-slicing."""
    from mpsrun.sweep import gpu_share

    log, proc = _fake_control(tmp_path, monkeypatch)
    monkeypatch.setattr(gpu_share, "PROBE", "pass")  # the CUDA context the real probe makes: no GPU here
    for args in (("auto", 1, "cuda"), ("auto", 4, "cpu"), ("time-slicing", 4, "cuda")):
        daemon, said = gpu_share.arrange(*args, proc=proc)
        assert daemon is None
    assert "take turns" in said and log.read_text() == ""
    daemon, said = gpu_share.arrange("auto", 4, "cuda", proc=proc)
    assert daemon is not None, said
    assert "4 workers share one GPU through NVIDIA MPS (a daemon this sweep started" in said
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    assert pipe.startswith(daemon.folder) and os.path.exists(os.path.join(pipe, "control"))
    assert gpu_share.note(4, "cuda", proc).endswith("their kernels run at once")  # what a worker started now would see
    daemon.stop()  # quits it without waiting (a detached shell)
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "no-system-daemon") and "CUDA_MPS_LOG_DIRECTORY" not in os.environ
    _quit_logged(log)
    assert log.read_text().splitlines() == [f"start {pipe}", f"quit {pipe}"]
    deadline = time.monotonic() + 10
    while os.path.exists(daemon.folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(daemon.folder)


def _quit_logged(log) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while len(log.read_text().splitlines()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_daemon_whose_cuda_context_fails_is_stopped_and_the_workers_take_turns_simulated_driver(tmp_path, monkeypatch) -> None:
    """The probe's CUDA context fails, as under a daemon whose server cannot start (simulated, so that a GPU machine,
    where the real probe succeeds, sees it too): auto says why and falls back to time-slicing; nvidia-mps is an error
    (exit 2 at the command)."""
    from mpsrun.sweep import gpu_share

    log, proc = _fake_control(tmp_path, monkeypatch)
    monkeypatch.setattr(gpu_share, "PROBE", "import sys; sys.exit('cuDevicePrimaryCtxRetain returned CUDA error 805')")
    daemon, said = gpu_share.arrange("auto", 2, "cuda", proc=proc)
    assert daemon is None
    assert "take turns on it" in said and "NVIDIA MPS, which lets them run at once, could not start: a CUDA context under it failed" in said
    _quit_logged(log)
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("start ") and lines[1].startswith("quit ")  # started, then quit
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "no-system-daemon")
    log.write_text("")
    with pytest.raises(ValueError, match="nvidia-mps: NVIDIA MPS could not start"):
        gpu_share.arrange("nvidia-mps", 2, "cuda", proc=proc)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "nvidia-cuda-mps-control is not on PATH" in gpu_share.arrange("auto", 2, "cuda", proc=proc)[1]


def test_the_daemon_is_stopped_when_the_sweep_is_killed_simulated_driver(tmp_path, monkeypatch) -> None:
    """kill -9 of the command that started it: its watchdog quits the daemon within about a second."""
    log, proc = _fake_control(tmp_path, monkeypatch)
    code = (f"import os, signal; from mpsrun.sweep import gpu_share; gpu_share.PROBE = 'pass'; "
            f"d, said = gpu_share.arrange('auto', 2, 'cuda', proc={proc!r}); assert d is not None, said; "
            f"os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == -9, p.stderr
    _quit_logged(log)
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[1].startswith("quit "), lines
