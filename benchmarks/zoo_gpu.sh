#!/usr/bin/env bash
# Issue 4 on an NVIDIA machine: the model-zoo benchmark (cpu vs cuda) and the ResNet18
# bf16 + channels_last throughput check, with `mpsrun bench`. Installs nothing: run it
# once mpsrun is installed. Writes logs, results.csv/.md/.png and the MLflow store's
# tables under $OUT. About 5 minutes on an H100 host with 16 CPU cores.
#
#   bash benchmarks/zoo_gpu.sh                     # OUT defaults to ./zoo-out
#   QUICK=1 DEVICE=cpu bash benchmarks/zoo_gpu.sh  # a one-minute smoke run without a GPU
#
# The CPU cells train on a 128-image subset (validation 32) instead of 1,000/200: VGG16 at
# 224x224 takes minutes per epoch on a CPU. Speed-ups stay comparable because mpsrun
# measures them on training samples/s, not on epoch time; the table's "also set" and
# "train n" columns show the smaller CPU subset. VGG16 runs last, so a time-out loses it
# alone; whatever finished is still tabled by `mpsrun compare`.
set -u
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-zoo-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
REPO=$(pwd); RECIPE=$REPO/recipes/vision_zoo_bench.yaml
WORK=$(mktemp -d); cd "$WORK" || exit 1    # the MLflow store goes to $WORK/mlruns
export PYTHONUNBUFFERED=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
mpsrun() { python3 -m mpsrun "$@"; }   # the installed package, whether or not its script is on PATH
DATA=$WORK/data
if [ "${QUICK:-0}" = 1 ]; then
  N_TRAIN=512; SMALL=(dataset.resize=32 dataset.subset=64 dataset.val_subset=16 'matrix.batch_size=[16]')
  ARCHS='[resnet18,mobilenet_v2]'; CPU_SUBSET=32; R18=(dataset.resize=32 dataset.subset=64 dataset.val_subset=16 epochs=2)
else
  N_TRAIN=10000; SMALL=(); ARCHS='[alexnet,resnet18,mobilenet_v2,efficientnet_b0,vgg16]'; CPU_SUBSET=128
  R18=(dataset.subset=10000 dataset.val_subset=1000 epochs=5)
fi
DEVICES="[cpu,$DEVICE]"; [ "$DEVICE" = cpu ] && DEVICES="[cpu]"

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; nproc; python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__)'; } | tee "$OUT/machine.txt"
mpsrun doctor > "$OUT/doctor.txt" 2>&1; mpsrun doctor --device "$DEVICE" > /dev/null 2>&1
echo "doctor --device $DEVICE exit code: $?" | tee -a "$OUT/doctor.txt"
python3 -m mpsrun.testing.idx "$DATA" --name MNIST --n-train $N_TRAIN --n-test 1000 > /dev/null || exit 1

echo "== 1. ResNet18, batch 64, channels_last, fp32 vs bf16 on $DEVICE (target: bf16 >= 7,500 images/s)" | tee "$OUT/resnet18.log"
timeout -s INT 110 python3 -m mpsrun bench "$RECIPE" 'matrix={precision: [fp32, bf16]}' device=$DEVICE batch_size=64 \
  model.arch=resnet18 channels_last=true tracking.experiment=resnet18_throughput dataset.root="$DATA" "${R18[@]}" --out "$OUT/resnet18" 2>&1 | tee -a "$OUT/resnet18.log"
python3 - "$OUT/resnet18/results.csv" <<'EOF' 2>&1 | tee -a "$OUT/resnet18.log"
import csv, sys
try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except OSError as e:
    sys.exit(f"ACCEPTANCE resnet18 bf16+channels_last batch 64: FAIL (no results: {e})")
for r in rows:
    print(f"resnet18 batch 64 channels_last {r['precision']}: {float(r['train_samples_per_s_median'] or 0):,.0f} images/s ({r['status']})")
v = float(next(r for r in rows if r["precision"] == "bf16")["train_samples_per_s_median"] or 0)
print(f"ACCEPTANCE resnet18 bf16+channels_last batch 64: {v:,.0f} images/s, target >= 7,500: {'PASS' if v >= 7500 else 'FAIL'}")
EOF

echo "== 2. Model zoo, devices $DEVICES, batch 4 and 64 (CPU cells: subset $CPU_SUBSET)" | tee "$OUT/zoo.log"
timeout -s INT 320 python3 -m mpsrun bench "$RECIPE" "matrix.device=$DEVICES" "matrix.model.arch=$ARCHS" dataset.root="$DATA" \
  "matrix.include=[{device: cpu, dataset.subset: $CPU_SUBSET, dataset.val_subset: 32}]" ${SMALL[@]+"${SMALL[@]}"} \
  --out "$OUT/zoo" 2>&1 | tee -a "$OUT/zoo.log"
echo "== 3. The same table rebuilt from MLflow alone (mpsrun compare)" | tee "$OUT/compare.log"
mpsrun compare vision_zoo_bench --out "$OUT/zoo" 2>&1 | tee -a "$OUT/compare.log"
ls -l "$OUT" "$OUT/zoo" "$OUT/resnet18"
