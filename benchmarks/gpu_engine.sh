#!/usr/bin/env bash
# Issue 3 on a CUDA machine: engine tests, side-by-side benchmark, direct runs.
#   bash benchmarks/gpu_engine.sh     (logs under $OUT, default ./gpu-out)
set -u
. benchmarks/gpu_setup.sh
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q tests/test_engine.py -k "cuda or sync or transformed" 2>&1 | tail -15 | tee "$OUT/tests.log"
DATA=$(mktemp -d)/fm; python3 -m mpsrun.testing.idx $DATA --name FashionMNIST >/dev/null
python3 benchmarks/fashion_bench.py --device cuda --epochs 10 --root $DATA --out "$OUT/benchmarks.md" 2>&1 | tee "$OUT/bench.log"
cd /tmp && for g in true false; do
  mpsrun run "$OLDPWD"/recipes/fashion_mlp_mps.yaml device=cuda dataset.root=$DATA graphs=$g --quiet 2>&1 | tail -3
done | tee "$OUT/direct.log"
