#!/usr/bin/env bash
# Issue 14: data-parallel scaling on an NVIDIA machine with 2 GPUs, in ONE device command
# (at most 600 s with the machine's ~60 s of set-up). ResNet18 from the zoo recipe
# (recipes/vision_zoo_bench.yaml: MNIST-format data resized to 224x224 on the device, RGB,
# Adam), bf16 + channels_last, trained by `mpsrun run` on 1 GPU and by `mpsrun run --nproc 2`
# on 2 GPUs (DDP over NCCL) at the same batch PER GPU, so the global batch doubles (weak
# scaling, as the reference DDP script in shared/GPU.md). One run each, 3 epochs of 27,000
# images (30,000 less the 10% hold-out): images/s is the run's steady_train_samples_per_s (median of epochs 2..3, the whole
# job), read back from MLflow. The 1-GPU run is eager (graphs=false), which is what each DDP
# rank runs (CUDA graphs are not captured under DDP, see `mpsrun.note.*`); GRAPHS=1 adds the
# 1-GPU default with CUDA graphs. Batch 256 per GPU first (where the reference scales 1.94x),
# then 64 (launch-bound: 1.2-1.6x there) while the time budget lasts.
# Target: 2 GPUs >= 1.8x one GPU. Prints the table, writes $OUT/ddp.md and $OUT/ddp.log.
#
#   source benchmarks/gpu_setup.sh && OUT=$OUT bash benchmarks/ddp_gpu.sh      # on the 2-GPU machine
#   QUICK=1 DEVICE=cpu OUT=/tmp/ddp bash benchmarks/ddp_gpu.sh                  # the same logic, tiny, on a CPU (gloo)
#
# Knobs: BATCHES ("256 64"), EPOCHS (3), N_TRAIN (30000), GRAPHS (0), BUDGET (seconds this
# script may take, default 480: a run that would start too late to finish is skipped, said
# in the table), RUN_TIMEOUT (150 s per run).
set -u
START=$SECONDS
DEVICE=${DEVICE:-cuda}; QUICK=${QUICK:-0}; GRAPHS=${GRAPHS:-0}; export DEVICE QUICK
BUDGET=${BUDGET:-480}; RUN_TIMEOUT=${RUN_TIMEOUT:-150}
OUT=${OUT:-ddp-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(pwd); RECIPE=$REPO/recipes/vision_zoo_bench.yaml
WORK=$(mktemp -d); cd "$WORK" || exit 1          # the MLflow store goes to $WORK/mlruns
export PYTHONUNBUFFERED=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
DATA=$WORK/data
if [ "$QUICK" = 1 ]; then
  N_TRAIN=${N_TRAIN:-160}; VAL=${VAL:-64}; BATCHES=${BATCHES:-"8"}; EPOCHS=${EPOCHS:-3}; EXTRA=(dataset.resize=32 precision=fp32 channels_last=false)
else
  N_TRAIN=${N_TRAIN:-30000}; VAL=${VAL:-1000}; BATCHES=${BATCHES:-"256 64"}; EPOCHS=${EPOCHS:-3}; EXTRA=(precision=bf16 channels_last=true)
fi
# CPU ranks share the cores: one thread each (OpenMP spinning on an oversubscribed CPU is 10x slower)
[ "$DEVICE" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
LOG=$OUT/ddp.log; : > "$LOG"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | head -4; echo "cpus $(nproc)"
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-", "gpus", torch.cuda.device_count())'; } | tee "$OUT/machine.txt" >> "$LOG"
python3 -m mpsrun.testing.idx "$DATA" --name MNIST --n-train "$N_TRAIN" --n-test 1000 > /dev/null || { echo "data generation failed" | tee -a "$LOG"; exit 1; }

COMMON=(device=$DEVICE model.arch=resnet18 dataset.root="$DATA" dataset.subset=$N_TRAIN dataset.val_subset=$VAL
        dataset.test_subset=200 epochs=$EPOCHS tracking.experiment=ddp_scaling tracking.log_model=false
        tracking.system_metrics=false checkpoint.every=0 "${EXTRA[@]}")
SKIPPED=()
one() {  # one() NAME [args...]: a run if the budget allows it, its wall time in the log
  local name=$1; shift
  local left=$((BUDGET - (SECONDS - START)))
  local limit=$(( left < RUN_TIMEOUT ? left : RUN_TIMEOUT ))
  limit=$((limit - 20))  # SIGINT at the limit, SIGKILL 20 s later: the run never outlasts the budget
  if [ "$limit" -lt 30 ]; then
    echo "-- $name: skipped, ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"; SKIPPED+=("$name"); return
  fi
  local t0=$SECONDS
  timeout -s INT -k 20 "$limit" python3 -m mpsrun run "$RECIPE" "${COMMON[@]}" tracking.run_name="$name" -q "$@" >> "$LOG" 2>&1
  echo "-- $name: exit $?, $((SECONDS - t0)) s wall (limit ${limit}s)" | tee -a "$LOG"
}
for B in $BATCHES; do
  one "1gpu-eager-b$B" batch_size="$B" graphs=false
  one "2gpu-b$B" batch_size=$((2 * B)) --nproc 2
  [ "$GRAPHS" = 1 ] && one "1gpu-default-b$B" batch_size="$B"
done

python3 - "$OUT/ddp.md" "$BATCHES" "${SKIPPED[*]:-}" "$GRAPHS" <<'PY' 2>&1 | tee -a "$LOG"
import os, sys
from pathlib import Path
from mlflow.tracking import MlflowClient
c = MlflowClient(f"sqlite:///{Path.cwd() / 'mlruns' / 'mlflow.db'}")
exp = c.get_experiment_by_name("ddp_scaling")
runs = {r.info.run_name: r for r in c.search_runs([exp.experiment_id])} if exp else {}
skipped = set(sys.argv[3].split())
graphs = sys.argv[4] == "1"
def ips(name):
    r = runs.get(name)
    if r is None or r.info.status != "FINISHED":
        return None, ("skipped" if name in skipped else (r.info.status if r else "missing"))
    return r.data.metrics.get("steady_train_samples_per_s"), r
f = lambda v, why="n/a": f"{v:,.0f}" if v else why
lines = ["| batch per GPU | 1 GPU eager (img/s) | 2 GPUs DDP (img/s) | scaling | target >= 1.8x | 1 GPU CUDA graphs (img/s) |",
         "| --- | --- | --- | --- | --- | --- |"]
notes = []
for b in sys.argv[2].split():
    (e, ew), (two, r2), (d, dw) = ips(f"1gpu-eager-b{b}"), ips(f"2gpu-b{b}"), ips(f"1gpu-default-b{b}") if graphs else (None, "not run (GRAPHS=1)")
    s = two / e if two and e else None
    verdict = ("PASS" if s >= 1.8 else "below") if s else "n/a"
    lines.append(f"| {b} | {f(e, ew)} | {f(two, r2 if isinstance(r2, str) else 'n/a')} | {f'{s:.2f}x' if s else 'n/a'} | {verdict} | {f(d, dw if isinstance(dw, str) else 'n/a')} |")
    if hasattr(r2, "data"):
        t = r2.data.tags
        notes.append(f"2-GPU b{b}: world_size={t.get('distributed.world_size')} backend={t.get('distributed.backend')} graphs={t.get('resolved.graphs')}")
        notes += [f"  {k}: {t[k]}" for k in sorted(t) if k.startswith("distributed.rank.")]
quick = os.environ.get("QUICK") == "1"
what = "QUICK smoke run (32x32, fp32, tiny): checks the script, not a benchmark" if quick else "resnet18, 224x224, bf16 + channels_last, Adam"
table = "\n".join(lines) + (f"\n\n{what}; device {os.environ.get('DEVICE', 'cuda')}; images/s = steady_train_samples_per_s "
                            "(median of epochs 2..N, whole job), one run each.\n\n" + "\n".join(notes) + "\n")
Path(sys.argv[1]).write_text(table)
print(table)
PY
echo "total $((SECONDS - START)) s" | tee -a "$LOG"
