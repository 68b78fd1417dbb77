"""The CUDA side of code that other tests reach only on the CPU: eval, pyfunc, resume, a sweep and `mpsrun ui` on a GPU.

Runs on a CUDA machine (the GPU gate, `bash .ci/gpu`); skipped elsewhere. A model trained
on the GPU is evaluated there (by default) and on the CPU (`--device cpu`), and answers
through pyfunc in a fresh process on either device with the same scores: a program exported
on the CPU has its devices baked in, and `mpsrun eval` once failed on every CUDA machine
("Tensor device mismatch! Expected: cpu, Got: cuda:0").
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import RECIPES, Workdir
from tests.test_checkpoint import cli_proc, start, wait_for_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in the GPU gate, bash .ci/gpu)")


@pytest.fixture(scope="module")
def trained_on_gpu(tmp_path_factory: pytest.TempPathFactory, template_db: Path) -> tuple[Workdir, Any]:
    path = tmp_path_factory.mktemp("gpu")
    (path / "mlruns").mkdir()
    shutil.copy(template_db, path / "mlruns" / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        work = Workdir(path)
        r = work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=2", "device=cuda", "-q", helper=None)
        assert r.exit_code == 0, r.output
        (run,) = work.runs("digits_mlp")
        assert run.data.tags["device.actual"].startswith("cuda")
        yield work, run


def _eval(work: Workdir, run: Any, *args: str) -> Any:
    r = work.cli("eval", run.info.run_id, *args, helper=None)
    assert r.exit_code == 0, r.output
    return [x for x in work.runs("digits_mlp") if x.data.tags.get("mpsrun.eval.source_run") == run.info.run_id][-1]


def test_a_gpu_trained_model_evaluates_on_the_gpu_by_default_and_on_the_cpu_alike(trained_on_gpu) -> None:
    work, run = trained_on_gpu
    on_gpu = _eval(work, run)
    assert on_gpu.data.tags["device.actual"].startswith("cuda") and on_gpu.data.tags["device.fallback"] == "false"
    on_cpu = _eval(work, run, "--device", "cpu")
    assert on_cpu.data.tags["device.actual"] == "cpu"
    one_sample = 1.0 / on_gpu.data.metrics["eval_samples"]
    assert on_gpu.data.metrics["eval_accuracy"] == pytest.approx(run.data.metrics["val_accuracy"], abs=one_sample + 1e-9)
    assert on_cpu.data.metrics["eval_accuracy"] == pytest.approx(on_gpu.data.metrics["eval_accuracy"], abs=one_sample + 1e-9)
    assert on_cpu.data.metrics["eval_loss"] == pytest.approx(on_gpu.data.metrics["eval_loss"], rel=1e-3)


PYFUNC = textwrap.dedent(
    """
    import json, sys
    import mlflow, numpy as np
    from mlflow.models import Model
    mlflow.set_tracking_uri(sys.argv[1])
    uri = f"runs:/{sys.argv[2]}/model"
    local = mlflow.artifacts.download_artifacts(uri)
    example = Model.load(local).load_input_example(local)
    served = mlflow.pyfunc.load_model(uri)
    answer = served.predict(example)
    raw = served.get_raw_model()
    device = str(next(iter(raw.parameters())).device) if hasattr(raw, "parameters") else "?"
    scores = answer[[c for c in answer.columns if c.startswith("score_")]].to_numpy()
    print(json.dumps({"device": device, "scores": scores.tolist(), "classes": answer["class_index"].tolist()}))
    """
)


def _pyfunc(work: Workdir, run: Any, **env: str) -> dict[str, Any]:
    import os

    e = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    e.update(env)
    p = subprocess.run([sys.executable, "-c", PYFUNC, work.uri, run.info.run_id], cwd=work.path, env=e,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_pyfunc_serves_on_the_gpu_where_there_is_one_and_on_the_cpu_when_told(trained_on_gpu) -> None:
    work, run = trained_on_gpu
    gpu = _pyfunc(work, run)
    cpu = _pyfunc(work, run, MLFLOW_DEFAULT_PREDICTION_DEVICE="cpu")
    assert gpu["device"].startswith("cuda") and cpu["device"] == "cpu"
    assert gpu["classes"] == cpu["classes"]
    assert torch.allclose(torch.tensor(gpu["scores"]), torch.tensor(cpu["scores"]), atol=1e-3, rtol=1e-3)


SLOW_GPU = """\
device: cuda
epochs: 8
batch_size: 8
seed: 3
dataset: {name: synthetic, shape: [64], dtype: float32, train_size: 48000, val_size: 400, num_classes: 4}
model: {name: mlp, hidden: [256, 256], dropout: 0.2}
optimizer: {name: adam, lr: 0.001}
tracking: {experiment: slow, log_model: false}
"""


def test_a_cuda_run_stopped_by_sigterm_resumes_on_the_gpu_each_epoch_once(work: Any) -> None:
    work.write("slow.yaml", SLOW_GPU)
    proc = start(work, "run", "slow.yaml", "-q")
    run_id = wait_for_checkpoint(work, "slow", 0, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out
    run = work.client().get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["device.actual"].startswith("cuda")
    r = cli_proc(work, "resume", run_id, "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    assert work.client().get_run(run_id).info.status == "FINISHED"
    assert [s for s, _ in work.history(run_id, "val_loss")] == list(range(8))


def test_a_sweep_trains_its_trials_on_the_gpu(work: Any) -> None:
    recipe = work.write("sw.yaml", """\
        device: cuda
        epochs: 2
        batch_size: 64
        seed: 0
        dataset: {name: digits}
        model: {name: mlp, hidden: [32]}
        optimizer: {name: sgd, lr: 0.05}
        tracking: {experiment: gpusweep, log_model: false}
        sweep:
          trials: 2
          metric: val_loss
          params:
            optimizer.lr: {low: 0.01, high: 0.1, log: true}
        """)
    r = work.cli("sweep", recipe, "-q", helper=None)
    assert r.exit_code == 0, r.output
    children = [x for x in work.runs("gpusweep") if "mlflow.parentRunId" in x.data.tags]
    assert len(children) == 2
    assert all(c.info.status == "FINISHED" and c.data.tags["device.actual"].startswith("cuda") for c in children)


def test_mpsrun_ui_serves_a_cuda_runs_gpu_system_metrics(trained_on_gpu) -> None:
    """The GPU's own curves (NVML, through nvidia-ml-py) are recorded for a CUDA run and answered by `mpsrun ui`'s server."""
    import os
    import signal as sig
    import urllib.parse
    import urllib.request

    from tests.proc_helpers import free_port
    from tests.test_ui_start import Ui

    work, run = trained_on_gpu
    assert "GPU utilisation not recorded" not in run.data.tags.get("mpsrun.notes", ""), run.data.tags.get("mpsrun.notes")
    gpu_keys = sorted(k for k in run.data.metrics if k.startswith("system/gpu_0_"))
    assert "system/gpu_0_memory_usage_megabytes" in gpu_keys, sorted(run.data.metrics)
    ui = Ui(work.path, free_port())
    try:
        ui.wait_link()
        q = urllib.parse.urlencode({"run_id": run.info.run_id, "metric_key": "system/gpu_0_memory_usage_megabytes"})
        with urllib.request.urlopen(f"{ui.url}/ajax-api/2.0/mlflow/metrics/get-history?{q}", timeout=30) as r:
            history = json.loads(r.read())["metrics"]
        assert history and all(m["value"] > 0 for m in history), history
    finally:
        if ui.proc.poll() is None:
            os.killpg(ui.proc.pid, sig.SIGTERM)
        ui.finish()
