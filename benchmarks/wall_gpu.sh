#!/usr/bin/env bash
# Issue 16 on an NVIDIA machine: whole-process wall time against the floor (import torch +
# one optimizer step), alternating, medians of $REPEATS (default 5): the CUDA floor and
# `mpsrun run recipes/fashion_mlp_mps.yaml device=cuda epochs=10` (FashionMNIST-format IDX
# files written with mpsrun.testing.idx when the real ones are absent; the table says so),
# the CPU floor, the digits recipe for one epoch on the CPU, `mpsrun --help`, and the digits
# run per MPSRUN_MLFLOW_HELPER mode. Writes wall.md (the table), wall.log (every command's
# output) and machine.txt under $OUT.
#
# On the project's GPU machine (no package index; wheels carried in .whl, see
# /work/shared/GPU.md and ../shared/tools/device-wheels.sh), from the project root:
#   bash benchmarks/wall_gpu.sh            # installs the wheels and mpsrun first (SETUP=1)
#   SETUP=0 bash benchmarks/wall_gpu.sh    # where mpsrun is installed already
#   HELPERS= REPEATS=3 bash benchmarks/wall_gpu.sh   # shorter: no per-helper-mode rows, 3 rounds
#   CUDA_ONLY=1 HELPERS= bash benchmarks/wall_gpu.sh  # shortest: the CUDA floor and the fashion run only
#   EXPORT_END=1 ...                       # also the fashion run with MPSRUN_EXPORT_AHEAD=0 (no exporter process)
#   BASELINE_SRC=/tmp/old/src ...          # also the fashion run from another commit's source (git archive COMMIT src)
set -u
OUT=${OUT:-wall-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
if [ "${SETUP:-1}" = 1 ]; then
  # shellcheck disable=SC1091
  source benchmarks/gpu_setup.sh || exit 1
fi
export PYTHONUNBUFFERED=1 MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR=false
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1; nproc; uptime;
  python3 -c 'import torch, mlflow; print("torch", torch.__version__, "mlflow", mlflow.__version__)'; } | tee "$OUT/machine.txt"
python3 benchmarks/wall.py --repeats "${REPEATS:-5}" ${HELPERS---helpers} ${CUDA_ONLY:+--cuda-only} ${EXPORT_END:+--export-end} ${FRESH:+--fresh} ${BASELINE_SRC:+--baseline-src "$BASELINE_SRC"} --out "$OUT/wall.md" --log "$OUT/wall.log" ${FASHION_ROOT:+--fashion-root "$FASHION_ROOT"}
echo "exit code: $?" | tee -a "$OUT/machine.txt"
