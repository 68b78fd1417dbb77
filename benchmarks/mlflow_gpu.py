"""On a CUDA machine: does MLflow get the GPU's system metrics, and what does logging the model cost?

Runs the flagship recipe (`recipes/fashion_mlp_mps.yaml`, falling back from MPS to
CUDA) through the installed CLI, twice in each of two ways, interleaved:
with the model logged and registered (the default) and with `tracking.log_model:
false`. Reads back from the MLflow store: `system/gpu_*` metrics (MLflow's monitor
through pynvml, from nvidia-ml-py), `log_model_time_s` (mpsrun_timings.json), figures and dataset
timings, and each run's wall time. Then loads the registered model in a fresh
Python process and runs `mpsrun eval` on it. Writes `mlflow_gpu.md` (and the raw
JSON) to $OUT; exit 1 when GPU metrics are missing or a step failed.

    OUT=/tmp/out python benchmarks/mlflow_gpu.py            # synthetic FashionMNIST-format data, offline
    OUT=/tmp/out python benchmarks/mlflow_gpu.py --root /data/datasets --epochs 10
    OUT=/tmp/out python benchmarks/mlflow_gpu.py --device cpu --epochs 1 --repeats 1 --n-train 2000   # smoke run, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "fashion_mlp_mps.yaml"
EXPERIMENT = "mlflow_gpu"
REGISTERED = "fashion-mlp-gpu"

FRESH = """
import json, sys, time
t = time.perf_counter()
import mlflow, numpy as np, torch
from mlflow.models import Model
mlflow.set_tracking_uri(sys.argv[1])
local = mlflow.artifacts.download_artifacts(sys.argv[2])
x = Model.load(local).load_input_example(local)
m = mlflow.pytorch.load_model(sys.argv[2])
y = m(torch.from_numpy(x)).detach().numpy()
p = mlflow.pyfunc.load_model(sys.argv[2]).predict(x)
print(json.dumps({"shape": list(y.shape), "pyfunc_shape": list(np.asarray(p).shape), "agree": bool(np.allclose(y, p, atol=1e-4)),
                  "mpsrun_imported": any(k.split('.')[0] == 'mpsrun' for k in sys.modules), "seconds": time.perf_counter() - t}))
"""



def _timings(c, run_id):  # type: ignore[no-untyped-def]
    """mpsrun's bookkeeping from the run's mpsrun_timings.json, under the `mpsrun/` names the metrics had before."""
    import json
    import tempfile
    from pathlib import Path as _P

    try:
        with tempfile.TemporaryDirectory() as d:
            data = json.loads(_P(c.download_artifacts(run_id, "mpsrun_timings.json", d)).read_text())
    except Exception:  # a run from before the file: its metrics carry the names
        return {}
    return {f"mpsrun/{k}": v for k, v in data.items() if isinstance(v, (int, float))}

def sh(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, float, str]:
    t = time.perf_counter()
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    return p.returncode, time.perf_counter() - t, (p.stdout + p.stderr)[-4000:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", help="folder holding FashionMNIST/raw; default: synthetic data in the IDX format")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-train", type=int, default=60000, help="synthetic training images (a quick smoke run: 2000)")
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "mlflow-gpu-out")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mlflow-gpu-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    uri = f"sqlite:///{work / 'mlruns' / 'mlflow.db'}"
    root = a.root
    if root is None:
        root = str(work / "data")
        subprocess.run([sys.executable, "-m", "mpsrun.testing.idx", root, "--name", "FashionMNIST", "--n-train", str(a.n_train)], check=True, capture_output=True)
    base = [sys.executable, "-m", "mpsrun", "run", str(RECIPE), f"device={a.device}", f"epochs={a.epochs}",
            f"dataset.root={root}", f"tracking.experiment={EXPERIMENT}", "-q"]
    rows, failures, logs = [], [], []
    for rep in range(a.repeats):
        for mode, extra in (("model logged + registered", [f"tracking.register={REGISTERED}"]), ("tracking.log_model: false", ["tracking.log_model=false"])):
            rc, wall, text = sh(base + extra + [f"tracking.run_name={mode.split()[0]}-{rep}"], work, env)
            logs.append(f"$ {' '.join(base + extra)}\n{text}")
            if rc != 0:
                failures.append(f"{mode} (repeat {rep}) exited {rc}")
            rows.append({"mode": mode, "repeat": rep, "rc": rc, "wall_s": wall})

    from mlflow.tracking import MlflowClient

    from mpsrun.track.records.names import from_mlflow  # system/steady_epoch_time_s -> steady_epoch_time_s

    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(EXPERIMENT)
    runs = c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]) if exp else []
    for row, run in zip(rows, runs):
        m = {**from_mlflow(run.data.metrics), **_timings(c, run.info.run_id)}
        row.update(
            run_id=run.info.run_id,
            device=run.data.tags.get("device.name", "?"),
            steady_epoch_s=m.get("steady_epoch_time_s"),
            log_model_s=m.get("mpsrun/log_model_time_s"),
            figures_s=m.get("mpsrun/figures_time_s"),
            datasets_s=m.get("mpsrun/datasets_log_time_s"),
            gpu_keys=sorted(k for k in m if k.startswith("system/gpu")),
            gpu_util_max=max((v.value for k in m if k.startswith("system/gpu") and k.endswith("utilization_percentage")
                              for v in c.get_metric_history(run.info.run_id, k)), default=None),
            system_samples=len(c.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")),
        )
    gpu_ok = bool(rows) and all(r.get("gpu_keys") for r in rows)
    if not gpu_ok:
        failures.append("no system/gpu_* metrics on some run (is nvidia-ml-py installed and NVML usable?)")

    rc, wall, text = sh([sys.executable, "-c", FRESH, uri, f"models:/{REGISTERED}/1"], work, env)
    fresh = json.loads(text.strip().splitlines()[-1]) if rc == 0 else {"error": text[-1500:]}
    if rc != 0 or not fresh.get("agree"):
        failures.append("fresh-process load of the registered model failed")
    rc, ewall, etext = sh([sys.executable, "-m", "mpsrun", "eval", f"models:/{REGISTERED}/1", f"dataset.root={root}", "--device", a.device, "--tracking-uri", uri], work, env)
    if rc != 0:
        failures.append(f"mpsrun eval exited {rc}")

    def med(mode: str, key: str) -> float:
        vals = [r[key] for r in rows if r["mode"] == mode and r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    with_model, without = "model logged + registered", "tracking.log_model: false"
    import torch

    lines = [
        f"# MLflow on {a.device}: system metrics and the cost of logging the model",
        "",
        f"- machine: {platform.node()}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'}, "
        f"torch {torch.__version__}, python {platform.python_version()}",
        f"- recipe: `{RECIPE.name}` device={a.device} epochs={a.epochs}, data: {'synthetic IDX' if a.root is None else root}; {a.repeats} repeats, interleaved",
        f"- command: `OUT={out} python benchmarks/mlflow_gpu.py {' '.join(sys.argv[1:])}`",
        "",
        "| mode | repeat | wall s (whole CLI) | steady epoch s | log_model s | figures s | datasets s | system samples | GPU metrics | max GPU util % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        lines.append(f"| {r['mode']} | {r['repeat']} | {fmt(r['wall_s'])} | {fmt(r.get('steady_epoch_s'))} | {fmt(r.get('log_model_s'))} | "
                     f"{fmt(r.get('figures_s'))} | {fmt(r.get('datasets_s'))} | {r.get('system_samples', '-')} | {len(r.get('gpu_keys') or [])} | {fmt(r.get('gpu_util_max'))} |")
    lines += [
        "",
        f"- median wall time: {med(with_model, 'wall_s'):.2f} s with the model logged and registered, "
        f"{med(without, 'wall_s'):.2f} s without: log_model adds {med(with_model, 'wall_s') - med(without, 'wall_s'):.2f} s "
        f"(its own timer: {med(with_model, 'log_model_s'):.2f} s)",
        f"- GPU system metrics: {', '.join((rows[0].get('gpu_keys') or ['none'])) if rows else 'none'}",
        f"- fresh process (no mpsrun import) loading models:/{REGISTERED}/1: {json.dumps(fresh)}",
        f"- `mpsrun eval models:/{REGISTERED}/1 --device {a.device}`: exit {rc}, {ewall:.1f} s",
        "",
        "```",
        etext.strip()[-1500:],
        "```",
        "",
        f"verdict: {'OK' if not failures else 'FAILED: ' + '; '.join(failures)}",
    ]
    (out / "mlflow_gpu.md").write_text("\n".join(lines) + "\n")
    (out / "mlflow_gpu.json").write_text(json.dumps({"rows": rows, "fresh": fresh, "failures": failures}, indent=2, default=str))
    (out / "mlflow_gpu.log").write_text("\n\n".join(logs))
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
