#!/usr/bin/env bash
# Issue 5 on a CUDA machine: does the GPU compute what the CPU computes?
#   bash benchmarks/parity_gpu.sh        (logs under $OUT, default ./gpu-out; a few minutes)
#   DEV=cpu bash benchmarks/parity_gpu.sh  rehearses it without a GPU (cpu against cpu)
# 1. `mpsrun parity` cpu vs cuda for both shipped recipes, fp32, bf16 and fp16 (expect exit 0, "verdict:
#    agree"), plus a cuda-vs-cuda self-check;
#    (the calibration behind the noise caps, benchmarks/parity_calibrate.py, was retired on 2026-11-28:
#    its figures are in docs/benchmarks.md, the script in git history);
# 2. short `mpsrun run`s on cuda: the start-up canary must pass in under a second (tags canary.*);
# 3. summary.txt: verdict, first divergence, largest differences and canary tags per run; the parity
#    plots (loss per device, difference/tolerance per step) are copied to $OUT/*.png.
# Needs no network: FashionMNIST is generated in torchvision's format.
set -u
REPO=$(pwd)
DEV=${DEV:-cuda}
[ -d .whl ] && [ "$DEV" = cuda ] && . benchmarks/gpu_setup.sh   # the GPU machine: carried wheels, no index
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
WORK=$(mktemp -d); cd "$WORK"            # the default MLflow store goes to $WORK/mlruns
DATA=$WORK/data; python3 -m mpsrun.testing.idx "$DATA" --name FashionMNIST >/dev/null
FASHION="dataset.root=$DATA dataset.download=false"

status=0; : > "$OUT/exits.txt"
parity() {  # name, recipe, extra args...
  local name=$1; shift
  echo "=== parity $name: mpsrun parity $*" | tee -a "$OUT/parity.log"
  mpsrun parity "$@" --experiment parity_gpu --quiet 2>&1 | tee -a "$OUT/parity.log"
  local rc=${PIPESTATUS[0]}
  echo "exit $rc" | tee -a "$OUT/parity.log"; echo "$name exit $rc" >> "$OUT/exits.txt"
  [ "$rc" -eq 0 ] || status=1
}
for p in fp32 bf16 fp16; do
  parity "digits_$p" "$REPO/recipes/digits_mlp.yaml" precision=$p --devices cpu,$DEV --steps 50
  parity "fashion_$p" "$REPO/recipes/fashion_mlp_mps.yaml" $FASHION precision=$p --devices cpu,$DEV --steps 50
done
parity "digits_fp32_200" "$REPO/recipes/digits_mlp.yaml" --devices cpu,$DEV --steps 200
parity "fashion_self" "$REPO/recipes/fashion_mlp_mps.yaml" $FASHION --devices $DEV,$DEV --steps 50

echo "=== canary: short runs on $DEV" | tee "$OUT/run.log"
mpsrun run "$REPO/recipes/digits_mlp.yaml" device=$DEV epochs=2 --quiet 2>&1 | tee -a "$OUT/run.log"
mpsrun run "$REPO/recipes/fashion_mlp_mps.yaml" $FASHION device=$DEV epochs=1 --quiet 2>&1 | tee -a "$OUT/run.log"
mpsrun run "$REPO/recipes/fashion_mlp_mps.yaml" $FASHION device=$DEV epochs=1 precision=bf16 graphs=false --quiet 2>&1 | tee -a "$OUT/run.log"

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import os, shutil, sys
from mlflow.tracking import MlflowClient
from mpsrun.track.records.names import from_mlflow  # system/<name> and val_* read as before
out = sys.argv[1]
c = MlflowClient(tracking_uri=f"sqlite:///{os.getcwd()}/mlruns/mlflow.db")
for exp in c.search_experiments():
    for r in c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"]):
        t, m = r.data.tags, from_mlflow(r.data.metrics)
        if t.get("mpsrun.kind") == "parity":
            recipe = os.path.basename(t["mpsrun.recipe"]).removesuffix(".yaml")
            name = f"{recipe}_{t['parity.precision']}_{t['parity.device_a']}_vs_{t['parity.device_b']}_{t['parity.steps']}".replace(":", "")
            print(f"{name:<42} verdict={t['parity.verdict']:<8} first={t['parity.first_divergence']:<20} "
                  f"yardstick={t['parity.yardstick']:<8} max rel diff "
                  + " ".join(f"{q}={m.get(f'max_{q}_rel_diff', float('nan')):.1e}" for q in ("loss", "grad_norm", "logits", "params"))
                  + "  worst/tol " + " ".join(f"{m.get(f'max_{q}_tol_ratio', float('nan')):.2g}" for q in ("loss", "grad_norm", "logits", "params")))
            dst = c.download_artifacts(r.info.run_id, "parity_loss.png", out)
            shutil.move(dst, os.path.join(out, f"{name}.png"))
        else:
            canary = {k: v for k, v in sorted(t.items()) if k.startswith("canary.")}
            print(f"run {exp.name:<16} device={t.get('device.actual')} status={r.info.status} "
                  f"precision={r.data.params.get('precision')} val_acc={m.get('final_val_accuracy', float('nan')):.4f} {canary}")
EOF
cat "$OUT/exits.txt"
echo "parity_gpu: $([ $status -eq 0 ] && echo all parity checks agree || echo SOME PARITY CHECK FAILED)" | tee -a "$OUT/summary.txt"
exit $status
