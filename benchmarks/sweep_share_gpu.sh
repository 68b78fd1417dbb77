#!/usr/bin/env bash
# Sweep workers sharing one GPU (issue 24, item 5): does a second process's training overlap the first's?
#   source benchmarks/gpu_setup.sh && OUT=$OUT bash benchmarks/sweep_share_gpu.sh
# 1. the GPU's busy fraction while one process trains the shipped fashion MLP (nvidia-smi, 100 ms samples);
# 2. the sweep benchmark with trials trained as recipes/fashion_mlp_mps.yaml trains (10 epochs, batch 64),
#    --workers 1 against 4, traced;
# 3. where the machine has NVIDIA's Multi-Process Service (nvidia-cuda-mps-control), the same under it:
#    without it, kernels of different processes never run at once on the GPU (time-slicing).
set -u
OUT=${OUT:-/tmp/sweep_share}
mkdir -p "$OUT"
TRIALS=${TRIALS:-32}
PARTS=${PARTS:-"1 2 3"}            # which of the three parts to run
MPS_WORKERS=${MPS_WORKERS:-1,4}    # part 3's worker counts (the first is its baseline)
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
work=$(mktemp -d)
python3 -c "from mpsrun.testing.idx import write_idx_dataset as w; w('$work/data', 'FashionMNIST', n_train=60000, n_test=10000, seed=0)"
if has 1; then
echo "== 1. one process: GPU busy while the shipped fashion MLP trains ($(nvidia-smi --query-gpu=name --format=csv,noheader))" | tee "$OUT/share.md"
(cd "$work" && mpsrun run "$OLDPWD/recipes/fashion_mlp_mps.yaml" device=cuda epochs=2 dataset.root=data dataset.download=false -q >/dev/null 2>&1)  # warm the store
nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 > "$work/util.txt" &
smi=$!
(cd "$work" && mpsrun run "$OLDPWD/recipes/fashion_mlp_mps.yaml" device=cuda epochs=10 dataset.root=data dataset.download=false 2>&1 | tail -4) | tee -a "$OUT/share.md"
kill $smi 2>/dev/null
python3 - "$work/util.txt" <<'EOF' | tee -a "$OUT/share.md"
import sys
v = [int(x) for x in open(sys.argv[1]).read().split() if x.strip().isdigit()]
busy = [x for x in v if x > 0]
print(f"utilization.gpu samples: {len(v)}; while busy (>0): median {sorted(busy)[len(busy)//2] if busy else 0}%, max {max(v) if v else 0}%")
EOF
fi
if has 2; then
echo "== 2. sweep, trials as the shipped recipe (10 epochs, batch 64), time-slicing" | tee -a "$OUT/share.md"
python3 benchmarks/sweep_bench.py --device cuda --epochs 10 --batch 64 --trials "$TRIALS" --trace 2>&1 | tee -a "$OUT/share.md"
fi
if ! has 3; then :
elif command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=$work/mps CUDA_MPS_LOG_DIRECTORY=$work/mpslog
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    echo "== 3. the same under NVIDIA MPS" | tee -a "$OUT/share.md"
    python3 benchmarks/sweep_bench.py --device cuda --epochs 10 --batch 64 --trials "$TRIALS" --workers "$MPS_WORKERS" --trace 2>&1 | tee -a "$OUT/share.md"
    echo quit | nvidia-cuda-mps-control
  else
    echo "== 3. nvidia-cuda-mps-control -d failed: $(cat "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null | tail -3)" | tee -a "$OUT/share.md"
  fi
else
  echo "== 3. no nvidia-cuda-mps-control on this machine" | tee -a "$OUT/share.md"
fi
rm -rf "$work"
