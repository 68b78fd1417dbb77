#!/usr/bin/env bash
# Issue 14: data-parallel scaling on an NVIDIA machine with 2 GPUs. ResNet18 from the zoo
# recipe (recipes/vision_zoo_bench.yaml: MNIST resized to 224x224 on the device, RGB, Adam),
# bf16 + channels_last, trained by `mpsrun run` on 1 GPU and by `mpsrun run --nproc 2` on 2
# GPUs (DDP over NCCL) at the same batch PER GPU, so the global batch doubles (weak scaling,
# as the reference DDP script in shared/GPU.md). Images/s is the run's
# steady_train_samples_per_s (median of the epochs after the first, whole job), read back
# from MLflow. The 1-GPU run is given both ways: eager (what each DDP rank runs: CUDA graphs
# are not captured under DDP, see `mpsrun.note.*`) and with its default CUDA graphs.
# Target: 2 GPUs >= 1.8x one GPU. Writes $OUT/ddp_table.md and the logs.
#
#   source benchmarks/gpu_setup.sh && OUT=/tmp/ddp bash benchmarks/ddp_gpu.sh
#   QUICK=1 DEVICE=cpu bash benchmarks/ddp_gpu.sh       # smoke test without GPUs (gloo, tiny)
set -u
DEVICE=${DEVICE:-cuda}; export DEVICE QUICK=${QUICK:-0}
OUT=${OUT:-ddp-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(pwd); RECIPE=$REPO/recipes/vision_zoo_bench.yaml
WORK=$(mktemp -d); cd "$WORK" || exit 1          # the MLflow store goes to $WORK/mlruns
export PYTHONUNBUFFERED=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
DATA=$WORK/data
if [ "${QUICK:-0}" = 1 ]; then
  N_TRAIN=256; BATCHES="8"; EPOCHS=2; EXTRA=(dataset.resize=32 precision=fp32 channels_last=false)
else
  N_TRAIN=40000; BATCHES="64 256"; EPOCHS=4; EXTRA=(precision=bf16 channels_last=true)
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; nproc
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-", "gpus", torch.cuda.device_count())'; } | tee "$OUT/machine.txt"
python3 -m mpsrun.testing.idx "$DATA" --name MNIST --n-train $N_TRAIN --n-test 1000 > /dev/null || exit 1

COMMON=(device=$DEVICE model.arch=resnet18 dataset.root="$DATA" dataset.subset=$N_TRAIN dataset.val_subset=1000
        epochs=$EPOCHS tracking.experiment=ddp_scaling tracking.log_model=false "${EXTRA[@]}")
for B in $BATCHES; do
  echo "== batch $B per GPU" | tee -a "$OUT/ddp.log"
  timeout -s INT 300 python3 -m mpsrun run "$RECIPE" "${COMMON[@]}" batch_size=$B graphs=false tracking.run_name="1gpu-eager-b$B" -q 2>&1 | tee -a "$OUT/ddp.log"
  timeout -s INT 300 python3 -m mpsrun run "$RECIPE" "${COMMON[@]}" batch_size=$B tracking.run_name="1gpu-default-b$B" -q 2>&1 | tee -a "$OUT/ddp.log"
  timeout -s INT 300 python3 -m mpsrun run "$RECIPE" "${COMMON[@]}" batch_size=$((2 * B)) tracking.run_name="2gpu-b$B" --nproc 2 -q 2>&1 | tee -a "$OUT/ddp.log"
  echo "exit code of the 2-rank job: ${PIPESTATUS[0]}" | tee -a "$OUT/ddp.log"
done

python3 - "$OUT/ddp_table.md" "$BATCHES" <<'PY' 2>&1 | tee -a "$OUT/ddp.log"
import sys
from pathlib import Path
from mlflow.tracking import MlflowClient
c = MlflowClient(f"sqlite:///{Path.cwd() / 'mlruns' / 'mlflow.db'}")
exp = c.get_experiment_by_name("ddp_scaling")
runs = {r.info.run_name: r for r in c.search_runs([exp.experiment_id])} if exp else {}
def ips(name):
    r = runs.get(name)
    if r is None or r.info.status != "FINISHED":
        return None, (r.info.status if r else "missing")
    return r.data.metrics.get("steady_train_samples_per_s"), r
lines = ["| batch per GPU | 1 GPU eager (img/s) | 1 GPU default, CUDA graphs (img/s) | 2 GPUs DDP (img/s) | scaling vs eager | scaling vs default | target >= 1.8x |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
for b in sys.argv[2].split():
    e, _ = ips(f"1gpu-eager-b{b}"); d, _ = ips(f"1gpu-default-b{b}"); two, r2 = ips(f"2gpu-b{b}")
    f = lambda v: f"{v:,.0f}" if v else "n/a"
    se = two / e if two and e else None; sd = two / d if two and d else None
    ok = "PASS" if se and se >= 1.8 else "FAIL"
    lines.append(f"| {b} | {f(e)} | {f(d)} | {f(two)} | {se or 0:.2f}x | {sd or 0:.2f}x | {ok} |")
    if hasattr(r2, "data"):
        t = r2.data.tags
        print(f"2-GPU run b{b}: world_size={t.get('distributed.world_size')} backend={t.get('distributed.backend')} "
              f"graphs={t.get('resolved.graphs')} notes={t.get('mpsrun.notes')}")
        for k in sorted(k for k in t if k.startswith("distributed.rank.")):
            print(f"  {k}: {t[k]}")
import os
what = "QUICK smoke run (32x32, fp32): not a benchmark" if os.environ.get("QUICK") == "1" else "resnet18, 224x224, bf16 + channels_last, Adam"
table = "\n".join(lines) + f"\n\n{what}; device {os.environ.get('DEVICE', 'cuda')}; images/s = steady_train_samples_per_s (median of epochs 2..N), whole job.\n"
Path(sys.argv[1]).write_text(table)
print(table)
PY
ls -l "$OUT"
