"""Worker 0's head start (sweep/head.py): its data, and a fused CUDA group's first compiles, built on a thread while
the command opens the study and the parent run.

The CPU tests run the real CLI in-process on digits; the CUDA test (the GPU gate) rehearses a bf16 CNN group.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import Workdir
from tests.test_sweep import children, recipe

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the rehearsal checks CUDA kernels")


def test_worker_0_takes_the_data_the_head_start_built(work: Workdir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dataset is built once, on the head start's thread, and every trial (a fused group here) trains on it."""
    from mpsrun.train import runner

    built: list[str] = []
    real = runner.build_data

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "build_data", counted)
    monkeypatch.setenv("MPSRUN_SWEEP_TRACE", "1")
    path = recipe(work, "head.yaml", "sw_head", "optimizer.lr: {low: 0.01, high: 0.2}", trials=3)
    r = work.cli("sweep", str(path), "-q")
    assert r.exit_code == 0, r.output
    assert built == ["mpsrun-head-start"], built
    assert "sweep-trace-rehearsal" in r.output and "skipped (a cpu group)" in r.output  # the kernels' rehearsal is CUDA's
    _, kids = children(work, "sw_head")
    assert sorted(k.data.tags["mpsrun.sweep.state"] for k in kids) == ["COMPLETE"] * 3


def test_data_built_for_another_placement_is_not_taken(tmp_path: Path) -> None:
    from mpsrun.plugins import resolve
    from mpsrun.sweep import head

    path = tmp_path / "r.yaml"
    path.write_text(_DIGITS)
    resolved = resolve(path)
    head.start(resolved, 1, 2, lambda: {"tracking.log_model": False})
    assert head.take({"tracking.log_model": True}) is None  # the worker builds its own
    assert head.take({"tracking.log_model": False}) is None  # taken once: the head start is over
    head.start(resolved, 1, 2, lambda: {"tracking.log_model": False})
    cache = head.take({"tracking.log_model": False})
    assert cache is not None and cache.splits is not None


def test_a_dataset_that_fails_in_the_head_start_is_said_by_the_worker(work: Workdir) -> None:
    """The head start swallows the failure; the worker's own build meets it and the sweep ends as bad input (exit 2)."""
    path = work.write("bad.yaml", _DIGITS.replace("  name: digits\n", f"  name: fashion_mnist\n  root: {work.path / 'nothing'}\n  download: false\n"))
    r = work.cli("sweep", str(path), "-q")
    assert r.exit_code == 2, r.output
    assert "FashionMNIST" in r.output or "fashion" in r.output.lower(), r.output


@pytest.mark.parametrize("mark", ["what=training_imported", "what=study_opened"])
def test_sigterm_during_the_head_start_ends_the_sweep_cleanly(work: Workdir, monkeypatch: pytest.MonkeyPatch, mark: str) -> None:
    """SIGTERM the moment the head start's thread has imported PyTorch (it builds the data next, while the command still
    opens the study or the parent run), or the moment the study is open (the parent run is being created: a signal
    there once left it RUNNING with no owner): exit 143, no process left behind, no parent run left RUNNING."""
    import os
    import signal

    from tests.test_sweep import _mpsrun, _processes_naming

    monkeypatch.setenv("MPSRUN_SWEEP_TRACE", "1")
    path = recipe(work, "term.yaml", "sw_head_term", "optimizer.lr: {low: 0.01, high: 0.2}", trials=3)
    p = _mpsrun(work.path, "sweep", str(path), "-q")
    seen = []
    assert p.stdout is not None
    for line in p.stdout:
        seen.append(line)
        if mark in line:
            os.kill(p.pid, signal.SIGTERM)
            break
    out = "".join(seen) + p.communicate(timeout=120)[0]
    assert mark in out, out
    assert p.returncode == 143, out
    deadline = time.monotonic() + 30
    while _processes_naming(str(path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_naming(str(path)) == []
    assert not [r for r in work.runs("sw_head_term") if r.info.status == "RUNNING"]


_DIGITS = """\
device: cpu
epochs: 1
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
  experiment: sw_head_bad
sweep:
  metric: val_loss
  trials: 2
  params:
    optimizer.lr: {low: 0.01, high: 0.2}
"""


@CUDA
@pytest.mark.parametrize("own_seeds", [False, True])
def test_a_rehearsal_checks_the_first_group_s_kernels_and_gives_its_memory_back(tmp_path: Path, own_seeds: bool,
                                                                                  capfd: pytest.CaptureFixture[str],
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 CNN group of 3 stand-ins (own seeds: each its own batches, the grouped first layer): its checks ran on
    threads, nothing failed, and a second rehearsal leaves no more CUDA tensors alive than the first (the group is dropped;
    reserved memory is no measure here: each rehearsal's side stream gets its own cuBLAS workspace, 64 MB on the H200)."""
    from mpsrun.plugins import resolve
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep import head, worker
    from mpsrun.sweep.trial import DataCache
    from tests.test_fused_graphs import CNN_BASE

    monkeypatch.setenv("MPSRUN_SWEEP_TRACE", "1")
    params = "    optimizer.lr: {low: 0.01, high: 0.2}\n" + ("    seed: {low: 0, high: 100}\n" if own_seeds else "")
    path = tmp_path / "cnn.yaml"
    path.write_text(CNN_BASE.format(device="cuda", optimizer="sgd") + "precision: bf16\nsweep:\n  metric: val_loss\n  trials: 3\n  params:\n" + params)
    resolved = resolve(path)
    where = worker.placement(resolved, 0, 1)
    cache = DataCache()
    cache.get(trial_recipe(resolved, where))
    said = head.rehearse(resolved, where, cache, 3, 1)
    assert said == "members=3", said
    first = _cuda_tensors()  # what stays is the process's (kernels' constants), never the group's
    assert head.rehearse(resolved, where, cache, 3, 1) == "members=3"
    assert _cuda_tensors() == first
    err = capfd.readouterr().err
    assert "sweep-trace-checks threads=" in err and "sweep-trace-check conv" in err, err[-2000:]


def _cuda_tensors() -> int:
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda)
