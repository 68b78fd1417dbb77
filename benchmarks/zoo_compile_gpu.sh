#!/usr/bin/env bash
# Issue 27, item 3 (the zoo): ResNet18 bf16 + channels_last at batch 256 on one GPU, trained by
# `mpsrun run` on the zoo recipe (MNIST-format data resized to 224x224 on the device, RGB, Adam),
# today's engine (CUDA graphs around the step) against `compile=true` (torch.compile of the model,
# inductor's default mode; the engine then runs the step without its own graphs). One run each,
# alternating ROUNDS times; images/s is the run's steady_train_samples_per_s (median of the
# epochs after the first, where compilation happens), read back from MLflow. Target: 1.3x.
#
#   source benchmarks/gpu_setup.sh && OUT=$OUT bash benchmarks/zoo_compile_gpu.sh
#   QUICK=1 DEVICE=cpu OUT=/tmp/zc bash benchmarks/zoo_compile_gpu.sh      # the logic, tiny, on a CPU
#
# ARCH (default resnet18): another torchvision model of the zoo recipe, e.g. mobilenet_v2, resnet50.
# VARIANTS (default "graphs compile"): also `torchpool`, today's engine with torch's max-pool kernels
# (MPSRUN_FUSED_POOL=0) instead of fused_pool's, `nonorm`, the engine with torch's batch-norm, ReLU and add
# kernels (MPSRUN_FUSED_NORM=0) instead of fused_norm's, and `profiled`, the engine with its last epoch under
# torch.profiler (its kernel table in $OUT/profile-zoo.txt; that run's figure is not a measurement).
set -u
DEVICE=${DEVICE:-cuda}; QUICK=${QUICK:-0}; ROUNDS=${ROUNDS:-1}; VARIANTS=${VARIANTS:-"graphs compile"}
OUT=${OUT:-zoo-compile-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(pwd); RECIPE=$REPO/recipes/vision_zoo_bench.yaml
WORK=$(mktemp -d); cd "$WORK" || exit 1
export PYTHONUNBUFFERED=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
if [ "$QUICK" = 1 ]; then
  N_TRAIN=${N_TRAIN:-96}; BATCH=${BATCH:-16}; EPOCHS=${EPOCHS:-3}; EXTRA=(dataset.resize=32 precision=fp32 channels_last=false)
else
  N_TRAIN=${N_TRAIN:-30000}; BATCH=${BATCH:-256}; EPOCHS=${EPOCHS:-4}; EXTRA=(precision=bf16 channels_last=true)
fi
LOG=$OUT/zoo_compile.log; : > "$LOG"
python3 -m mpsrun.testing.idx "$WORK/data" --name MNIST --n-train "$N_TRAIN" --n-test 200 > /dev/null || { echo "data generation failed"; exit 1; }
COMMON=(device=$DEVICE model.arch=${ARCH:-resnet18} dataset.root="$WORK/data" dataset.subset=$N_TRAIN dataset.val_subset=64
        dataset.test_subset=64 epochs=$EPOCHS batch_size=$BATCH tracking.experiment=zoo_compile tracking.log_model=false
        tracking.system_metrics=false checkpoint.every=0 "${EXTRA[@]}")
for r in $(seq "$ROUNDS"); do
  for v in $VARIANTS; do
    args=(); env=()
    case $v in
      compile) args=(compile=true) ;;
      torchpool) env=(MPSRUN_FUSED_POOL=0) ;;
      nonorm) env=(MPSRUN_FUSED_NORM=0) ;;
      profiled) env=(MPSRUN_PROFILE_EPOCH="$EPOCHS" MPSRUN_PROFILE_OUT="$OUT/profile-zoo.txt") ;;
    esac
    t0=$SECONDS
    env "${env[@]}" timeout -s INT -k 20 400 python3 -m mpsrun run "$RECIPE" "${COMMON[@]}" "${args[@]}" tracking.run_name="$v" -q >> "$LOG" 2>&1
    echo "-- $v round $r: exit $?, $((SECONDS - t0)) s wall" | tee -a "$LOG"
  done
done
VARIANTS="$VARIANTS" python3 - "$OUT" <<'PY' | tee "$OUT/zoo_compile.md"
import os, statistics, sys
from pathlib import Path
from mlflow.tracking import MlflowClient
from mpsrun.track.records.names import from_mlflow
c = MlflowClient(f"sqlite:///{Path.cwd() / 'mlruns' / 'mlflow.db'}")
exp = c.get_experiment_by_name("zoo_compile")
rows = {}
for r in c.search_runs([exp.experiment_id]) if exp else []:
    if r.info.status == "FINISHED":
        m = from_mlflow(r.data.metrics)
        rows.setdefault(r.info.run_name, []).append((m.get("steady_train_samples_per_s"), m.get("first_epoch_time_s"), r.data.tags.get("mpsrun.notes", ""),
                                                     m.get("val_loss"), r.data.params.get("resolved.fused_pool") + "/" + str(r.data.params.get("resolved.fused_norm"))))
print("| variant | steady img/s (median) | first epoch s | vs graphs | runs: img/s, last val_loss, fused_pool/fused_norm | notes |\n| --- | ---: | ---: | ---: | --- | --- |")
base = statistics.median(x[0] for x in rows["graphs"]) if rows.get("graphs") else None
for v in os.environ["VARIANTS"].split():
    if v not in rows:
        print(f"| {v} | failed | | | |"); continue
    ips = statistics.median(x[0] for x in rows[v])
    each = "; ".join(f"{x[0]:,.0f}, {x[3]:.4f}, {x[4]}" for x in rows[v])
    print(f"| {v} | {ips:,.0f} | {statistics.median(x[1] for x in rows[v]):.1f} | {ips / base if base else float('nan'):.3f}x | {each} | {rows[v][0][2][:200].replace('|', ';')} |")
PY
