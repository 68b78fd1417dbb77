#!/usr/bin/env bash
# Where a first-time user's `mpsrun run recipes/fashion_mlp_mps.yaml device=cuda epochs=10` spends
# its wall time (issue 27, item 2): one run in a new folder with a new store, every output line
# time-stamped from the process start, the MLflow helper's trace (MPSRUN_HELPER_TRACE), the run's
# bookkeeping (mpsrun_timings.json, the model_export tag: run.json) and
# python's import times (-X importtime) written to $OUT. Needs mpsrun installed (gpu_setup.sh).
#   OUT=/tmp/trace bash benchmarks/startup_trace_gpu.sh
set -u
OUT=${OUT:-trace-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
repo=$(pwd)
work=$(mktemp -d)
python3 -m mpsrun.testing.idx "$work/data" >/dev/null
cd "$work" || exit 1
python3 - "$repo" "$OUT" <<'PY'
import os, subprocess, sys, time
repo, out = sys.argv[1], sys.argv[2]
env = {**os.environ, "MPSRUN_HELPER_TRACE": f"{out}/helper_trace.txt", "PYTHONUNBUFFERED": "1"}
t0 = time.perf_counter()
p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "mpsrun", "run", f"{repo}/recipes/fashion_mlp_mps.yaml",
                      "device=cuda", "epochs=10", "dataset.root=data", "dataset.download=false"],
                     stdout=subprocess.PIPE, stderr=open(f"{out}/importtime.txt", "w"), text=True, env=env)
with open(f"{out}/trace.txt", "w") as f:
    for line in p.stdout:
        f.write(f"{time.perf_counter() - t0:7.3f} {line}")
    p.wait()
    f.write(f"{time.perf_counter() - t0:7.3f} exit {p.returncode}\n")
print(open(f"{out}/trace.txt").read())
PY
# the run's own bookkeeping: what the end of the run spent where, and how the model was exported
python3 - "$OUT" <<'PY'
import json, sys
import mlflow
mlflow.set_tracking_uri("sqlite:///mlruns/mlflow.db")
(run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
timings = json.loads(mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/mpsrun_timings.json"))
out = {"tags": {k: v for k, v in run.data.tags.items() if k in ("mpsrun.model_export", "mpsrun.notes", "mpsrun.mlflow_helper")},
       "timings": timings}
open(f"{sys.argv[1]}/run.json", "w").write(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
PY
tail -25 "$OUT/helper_trace.txt"
