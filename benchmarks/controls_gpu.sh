#!/usr/bin/env bash
# Issue 13, item 10: does a cosine schedule + gradient clipping keep the fashion recipe's
# steady epoch time within 10%? Side by side in one run, interleaved (A B A B ...), on CUDA.
#   bash benchmarks/controls_gpu.sh          (markdown table: $OUT/controls.md, default ./gpu-out)
# Env: PARTS=1 (also each control alone), REPEATS (default 3), EPOCHS (default 6), DATA (a folder holding FashionMNIST/raw;
# default: a synthetic 60,000/10,000 set in torchvision's format, same shapes and sizes).
set -u
[ -d .whl ] && . benchmarks/gpu_setup.sh
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
REPEATS=${REPEATS:-3}; EPOCHS=${EPOCHS:-6}; DEVICE=${DEVICE:-cuda}   # DEVICE=cpu: a dry run of the script
WORK=$(mktemp -d)
if [ -z "${DATA:-}" ]; then DATA=$WORK/fm; python3 -m mpsrun.testing.idx "$DATA" --name FashionMNIST >/dev/null; fi
export MLFLOW_TRACKING_URI=sqlite:///$WORK/mlflow.db
RECIPE=$PWD/recipes/fashion_mlp_mps.yaml
COMMON=("device=$DEVICE" "dataset.root=$DATA" dataset.download=false "epochs=$EPOCHS" tracking.experiment=controls_bench tracking.log_model=false --quiet)
CONTROLS=("scheduler={name: CosineAnnealingLR, T_max: $EPOCHS}" "grad_clip={max_norm: 1.0}")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/controls_gpu.txt"
for i in $(seq 1 "$REPEATS"); do
  (cd "$WORK" && mpsrun run "$RECIPE" "${COMMON[@]}" tracking.run_name=baseline) 2>&1 | tail -2
  (cd "$WORK" && mpsrun run "$RECIPE" "${COMMON[@]}" "${CONTROLS[@]}" tracking.run_name=cosine+clip) 2>&1 | tail -2
  if [ -n "${PARTS:-}" ]; then  # PARTS=1: each control alone too, to say which one costs
    (cd "$WORK" && mpsrun run "$RECIPE" "${COMMON[@]}" "${CONTROLS[0]}" tracking.run_name=cosine) 2>&1 | tail -2
    (cd "$WORK" && mpsrun run "$RECIPE" "${COMMON[@]}" "${CONTROLS[1]}" tracking.run_name=clip) 2>&1 | tail -2
  fi
done | tee "$OUT/controls_runs.log"
EPOCHS=$EPOCHS python3 - "$OUT/controls.md" <<'EOF'
import os, statistics, sys
import torch
from mlflow.tracking import MlflowClient

from mpsrun.track.records.names import from_mlflow  # system/<name> and val_* read as before
c = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
runs = c.search_runs([c.get_experiment_by_name("controls_bench").experiment_id])
rows = {}
for r in runs:
    if r.info.status == "FINISHED":
        rows.setdefault(r.info.run_name, []).append(r)
def med(name, key):
    return statistics.median(from_mlflow(r.data.metrics)[key] for r in rows[name])
base = med("baseline", "steady_epoch_time_s")
lines = [
    f"FashionMNIST MLP (recipes/fashion_mlp_mps.yaml), {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU (dry run)'}, torch {torch.__version__}, "
    f"{len(rows.get('baseline', []))} interleaved repeats of {os.environ.get('EPOCHS', '6')} epochs; steady = median of epochs after the first",
    "",
    "| run | steady epoch (s), median | vs baseline | first epoch (s) | graphs | val_accuracy | test_accuracy | notes |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
]
for name in ("baseline", "cosine", "clip", "cosine+clip"):
    if name in ("cosine", "clip") and name not in rows:
        continue
    if name not in rows:
        lines.append(f"| {name} | failed | | | | | | |")
        continue
    r0 = rows[name][0]
    s = med(name, "steady_epoch_time_s")
    lines.append(
        f"| {name} | {s:.4f} | {s / base:.3f}x | {med(name, 'first_epoch_time_s'):.3f} | {r0.data.params.get('resolved.graphs')} | "
        f"{med(name, 'final_val_accuracy'):.4f} | {med(name, 'test_accuracy'):.4f} | {r0.data.tags.get('mpsrun.notes', '').replace('|', ';')} |"
    )
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
