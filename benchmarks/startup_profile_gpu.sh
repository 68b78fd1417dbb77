#!/usr/bin/env bash
# Where `mpsrun run recipes/fashion_mlp_mps.yaml device=cuda epochs=10` spends its start, every process
# sampled by py-spy (issue 27, item 2): a fresh folder and store, the run's own phases (mpsrun_timings.json)
# and the helper's trace beside the profile. py-spy travels as a wheel: `pip download py-spy --no-deps -d .whl`
# here, then on the GPU machine `source benchmarks/gpu_setup.sh` installs it with the rest (/tmp/site/bin).
#   OUT=/tmp/prof bash benchmarks/startup_profile_gpu.sh
#   python benchmarks/spy_summary.py $OUT/spy.txt.gz --process '""' --anchor "run (mpsrun/cli/run.py" --depth 2
set -u
OUT=${OUT:-profile-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PATH=/tmp/site/bin:$PATH
repo=$(pwd); work=$(mktemp -d)
python3 -m mpsrun.testing.idx "$work/data" >/dev/null
cd "$work" || exit 1
MPSRUN_HELPER_TRACE=$OUT/helper_trace.txt py-spy record --subprocesses --idle --nonblocking --rate 250 --format raw -o "$work/spy.txt" -- \
  python3 -m mpsrun run "$repo/recipes/fashion_mlp_mps.yaml" device=cuda epochs=10 dataset.root=data dataset.download=false
gzip -c "$work/spy.txt" > "$OUT/spy.txt.gz"
python3 - "$OUT" <<'PY'
import json, sys
import mlflow
mlflow.set_tracking_uri("sqlite:///mlruns/mlflow.db")
(run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
t = json.loads(mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/mpsrun_timings.json"))
t.pop("checkpoint_epochs", None)
t["mpsrun.model_export"] = run.data.tags.get("mpsrun.model_export")
open(f"{sys.argv[1]}/timings.json", "w").write(json.dumps(t, indent=1))
print(json.dumps(t, indent=1))
PY
python3 "$repo/benchmarks/spy_summary.py" "$OUT/spy.txt.gz"
python3 "$repo/benchmarks/spy_summary.py" "$OUT/spy.txt.gz" --process '""' --anchor "run (mpsrun/cli/run.py" --depth 2
