#!/usr/bin/env bash
# Issue 14: data-parallel scaling on an NVIDIA machine with 2 GPUs, in ONE device command
# (at most 600 s with the machine's ~60 s of set-up). ResNet18 from the zoo recipe
# (recipes/vision_zoo_bench.yaml: MNIST-format data resized to 224x224 on the device, RGB,
# Adam), bf16 + channels_last, trained by `mpsrun run` on 1 GPU and by `mpsrun run --nproc 2`
# on 2 GPUs (DDP over NCCL) at the same batch PER GPU, so the global batch doubles (weak
# scaling, as the reference DDP script in shared/GPU.md). One run each, 3 epochs of 27,000
# images (30,000 less the 10% hold-out): images/s is the run's steady_train_samples_per_s (median of epochs 2..3, the whole
# job), read back from MLflow. Both use CUDA graphs (the default; under NCCL each rank
# captures its step with one in-graph all-reduce, train/ranks/graph_sync.py); a third run,
# MPSRUN_DDP_BUCKET_MB=0, is the same with one all-reduce after backward (no overlap; THIRD=ddp:
# MPSRUN_DDP_GRAPHS=0, DDP's eager buckets as before issue 27); GRAPHS=1 adds the 1-GPU eager
# row. Then the trajectory: the fashion MLP, 1 GPU against 2 at one global batch (TRAJ=0 skips).
# Batch 256 per GPU first (where the reference scales 1.94x),
# then 64 (launch-bound: 1.2-1.6x there) while the time budget lasts.
# Targets (issue 27): 2 GPUs >= 1.95x one GPU at 256 per GPU, >= 1.8x at 64. Prints the table, writes $OUT/ddp.md and $OUT/ddp.log.
#
#   source benchmarks/gpu_setup.sh && OUT=$OUT bash benchmarks/ddp_gpu.sh      # on the 2-GPU machine
#   QUICK=1 DEVICE=cpu OUT=/tmp/ddp bash benchmarks/ddp_gpu.sh                  # the same logic, tiny, on a CPU (gloo)
#
# Knobs: BATCHES ("256 64"), EPOCHS (3), N_TRAIN (30000), SUBSET (training images, default all: N_TRAIN less the
# 10% hold-out; 26624 = 52 x 512 leaves no short last batch at 256 per GPU on 1 GPU or 2), GRAPHS (0), BUDGET (seconds this
# script may take, default 480: a run that would start too late to finish is skipped, said
# in the table), RUN_TIMEOUT (150 s per run), BUCKET_SWEEP ("8 4 2": the 2-GPU run again with buckets
# of that many MiB, MPSRUN_DDP_BUCKET_MB; default 25 as DDP), PAIR (1: two 1-GPU runs at once, one per GPU, after
# the 2-GPU run: a GPU's speed beside another busy one, no collective), THIRD (flat | ddp | none), ENV_SWEEP
# ("NCCL_MAX_NCHANNELS=4 NCCL_PROTO=Simple": the 2-GPU run again with each variable set, one row each), PROFILE (E: every
# run's epoch E trained under torch.profiler, its kernel table in $OUT/profile-RUN-rankR.txt; use EPOCHS=E+2 or more,
# as that epoch's time is not a measurement and the steady figure is the median of epochs 2..N), ROUNDS (N: the 1-GPU
# and 2-GPU runs N times, alternated; the table reports their medians and a note each round).
set -u
START=$SECONDS
export THIRD=${THIRD:-flat} BUCKET_SWEEP=${BUCKET_SWEEP:-} ENV_SWEEP=${ENV_SWEEP:-}
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

COMMON=(device=$DEVICE model.arch=resnet18 dataset.root="$DATA" dataset.subset=${SUBSET:-$N_TRAIN} dataset.val_subset=$VAL
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
  MPSRUN_PROFILE_EPOCH=${PROFILE:-} MPSRUN_PROFILE_OUT="$OUT/profile-$name-rank{rank}.txt" \
    timeout -s INT -k 20 "$limit" python3 -m mpsrun run "$RECIPE" "${COMMON[@]}" tracking.run_name="$name" -q "$@" >> "$LOG" 2>&1
  echo "-- $name: exit $?, $((SECONDS - t0)) s wall (limit ${limit}s)" | tee -a "$LOG"
}
for B in $BATCHES; do
  one "1gpu-b$B" batch_size="$B"                                  # the default: CUDA graphs
  one "2gpu-b$B" batch_size=$((2 * B)) --nproc 2                  # graphs on every rank (graph_sync)
  for r in $(seq 2 "${ROUNDS:-1}"); do  # more alternated rounds of the pair: the table then reports medians
    one "1gpu-b$B-r$r" batch_size="$B"
    one "2gpu-b$B-r$r" batch_size=$((2 * B)) --nproc 2
  done
  if [ "${PAIR:-0}" = 1 ]; then  # two independent 1-GPU runs at once, one per GPU: what the host costs a GPU, without any collective
    CUDA_VISIBLE_DEVICES=0 one "pair0-b$B" batch_size="$B" &
    CUDA_VISIBLE_DEVICES=1 one "pair1-b$B" batch_size="$B" &
    wait
  fi
  for mb in ${BUCKET_SWEEP:-}; do  # the same 2-GPU run with other bucket sizes (MiB), one row each below the table
    MPSRUN_DDP_BUCKET_MB=$mb one "2gpu-bk$mb-b$B" batch_size=$((2 * B)) --nproc 2
  done
  i=0
  for assign in ${ENV_SWEEP:-}; do  # the same 2-GPU run with one variable set (NCCL_MAX_NCHANNELS=4 ...), one row each
    i=$((i + 1)); var=${assign%%=*}; was=${!var-__unset__}
    export "$assign"
    one "2gpu-env$i-b$B" batch_size=$((2 * B)) --nproc 2
    if [ "$was" = __unset__ ]; then unset "$var"; else export "$var=$was"; fi
  done
  if [ "${THIRD:-flat}" = none ]; then :
  elif [ "${THIRD:-flat}" = ddp ]; then
    MPSRUN_DDP_GRAPHS=0 one "2gpu-ddp-b$B" batch_size=$((2 * B)) --nproc 2   # DDP's eager buckets (before issue 27)
  else
    MPSRUN_DDP_BUCKET_MB=0 one "2gpu-ddp-b$B" batch_size=$((2 * B)) --nproc 2   # graphs, one all-reduce after backward (no overlap)
  fi
  [ "$GRAPHS" = 1 ] && one "1gpu-eager-b$B" batch_size="$B" graphs=false
done
# The trajectory: the fashion MLP (fp32), one GPU against two at the same GLOBAL batch, val_loss per epoch.
if [ "${TRAJ:-1}" = 1 ] && [ "$QUICK" != 1 ]; then
  python3 -m mpsrun.testing.idx "$WORK/fdata" --name FashionMNIST --n-train 12000 --n-test 2000 > /dev/null
  TCOMMON=(device=$DEVICE dataset.root="$WORK/fdata" epochs=3 batch_size=128 tracking.experiment=ddp_trajectory
           tracking.log_model=false tracking.system_metrics=false checkpoint.every=0 -q)
  for n in 1 2; do
    extra=(); [ $n = 2 ] && extra=(--nproc 2)
    timeout -s INT -k 20 150 python3 -m mpsrun run "$REPO/recipes/fashion_mlp_mps.yaml" "${TCOMMON[@]}" tracking.run_name="traj-$n" "${extra[@]}" >> "$LOG" 2>&1
    echo "-- traj-$n: exit $?" | tee -a "$LOG"
  done
fi

python3 - "$OUT/ddp.md" "$BATCHES" "${SKIPPED[*]:-}" "$GRAPHS" <<'PY' 2>&1 | tee -a "$LOG"
import os, statistics, sys
from pathlib import Path
from mlflow.tracking import MlflowClient
from mpsrun.track.records.names import from_mlflow  # system/<name> read as before
c = MlflowClient(f"sqlite:///{Path.cwd() / 'mlruns' / 'mlflow.db'}")
exp = c.get_experiment_by_name("ddp_scaling")
runs = {r.info.run_name: r for r in c.search_runs([exp.experiment_id])} if exp else {}
skipped = set(sys.argv[3].split())
graphs = sys.argv[4] == "1"
def ips(name):
    r = runs.get(name)
    if r is None or r.info.status != "FINISHED":
        return None, ("skipped" if name in skipped else (r.info.status if r else "missing"))
    return from_mlflow(r.data.metrics).get("steady_train_samples_per_s"), r
f = lambda v, why="n/a": f"{v:,.0f}" if v else why
third = "DDP eager" if os.environ.get("THIRD") == "ddp" else "graphs, one all-reduce after backward"
lines = [f"| batch per GPU | 1 GPU, CUDA graphs (img/s) | 2 GPUs, graphs + bucketed in-graph all-reduce (img/s) | scaling | target | 2 GPUs, {third} (img/s) | its scaling |",
         "| --- | --- | --- | --- | --- | --- | --- |"]
notes = []
targets = {"64": 1.8, "256": 1.95}
rounds = int(os.environ.get("ROUNDS", "1") or 1)
def median_of(stem):
    """The run `stem` and its rounds (stem-r2, ...): the median img/s, and the first run (for its tags and status)."""
    got = [ips(stem)] + [ips(f"{stem}-r{r}") for r in range(2, rounds + 1)]
    vals = sorted(v for v, _ in got if v)
    return (statistics.median(vals) if vals else None), got[0][1], [v for v, _ in got]
for b in sys.argv[2].split():
    (one, w1, ones), (two, w2, twos), (ddp, wd) = median_of(f"1gpu-b{b}"), median_of(f"2gpu-b{b}"), ips(f"2gpu-ddp-b{b}")
    if rounds > 1:
        notes.append(f"batch {b} per GPU, {rounds} alternated rounds (medians in the table): 1 GPU " + ", ".join(f(v) for v in ones)
                     + "; 2 GPUs " + ", ".join(f(v) for v in twos) + "; per round "
                     + ", ".join(f"{t / o:.3f}x" if t and o else "n/a" for o, t in zip(ones, twos)))
    s = two / one if two and one else None
    sd = ddp / one if ddp and one else None
    t = targets.get(b, 1.8)
    verdict = (f"met (>= {t}x)" if s >= t else f"below {t}x") if s else "n/a"
    why = lambda w: w if isinstance(w, str) else "n/a"
    lines.append(f"| {b} | {f(one, why(w1))} | {f(two, why(w2))} | {f'{s:.3f}x' if s else 'n/a'} | {verdict} | {f(ddp, why(wd))} | {f'{sd:.3f}x' if sd else 'n/a'} |")
    for name, r in ((f"2gpu-b{b}", w2), (f"2gpu-ddp-b{b}", wd)):
        if hasattr(r, "data"):
            tg = r.data.tags
            notes.append(f"{name}: world_size={tg.get('distributed.world_size')} backend={tg.get('distributed.backend')} graphs={r.data.params.get('resolved.graphs')}")
            notes += [f"  {k}: {tg[k][:160]}" for k in sorted(tg) if k.startswith("mpsrun.note") and "graphs" in tg[k]]
    for i, assign in enumerate(os.environ.get("ENV_SWEEP", "").split(), 1):
        v, w = ips(f"2gpu-env{i}-b{b}")
        notes.append(f"batch {b} per GPU, {assign}: 2 GPUs {f(v, why(w))} img/s" + (f", scaling {v / one:.3f}x" if v and one else ""))
    if os.environ.get("PAIR") == "1":
        pv = [ips(f"pair{g}-b{b}") for g in (0, 1)]
        notes.append(f"batch {b}: two 1-GPU runs at once (one per GPU, no collective): " + ", ".join(f(v, why(w)) for v, w in pv) + " img/s"
                     + "".join(f"; {v / one:.3f}x of the 1-GPU run alone" for v, _ in pv[:1] if v and one)
                     + (f"; 2 GPUs against their sum: {two / (pv[0][0] + pv[1][0]):.3f}" if two and pv[0][0] and pv[1][0] else ""))
    for mb in os.environ.get("BUCKET_SWEEP", "").split():
        v, w = ips(f"2gpu-bk{mb}-b{b}")
        notes.append(f"batch {b} per GPU, buckets of {mb} MiB: 2 GPUs {f(v, why(w))} img/s" + (f", scaling {v / one:.3f}x" if v and one else ""))
te = c.get_experiment_by_name("ddp_trajectory")
if te:
    tr = {r.info.run_name: r for r in c.search_runs([te.experiment_id])}
    if "traj-1" in tr and "traj-2" in tr:
        h = [[m.value for m in sorted(c.get_metric_history(tr[n].info.run_id, "val_loss"), key=lambda m: m.step)] for n in ("traj-1", "traj-2")]
        rel = max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(*h)), default=float("nan"))
        notes.append(f"trajectory (fashion MLP fp32, global batch 128, 3 epochs): 1 GPU val_loss {['%.6f' % v for v in h[0]]}, "
                     f"2 GPUs {['%.6f' % v for v in h[1]]}; max relative difference {rel:.2e} (target <= 1e-4); "
                     f"2-GPU graphs={tr['traj-2'].data.params.get('resolved.graphs')}, fused layers 1 GPU={tr['traj-1'].data.params.get('resolved.fused_linear')} "
                     f"2 GPUs={tr['traj-2'].data.params.get('resolved.fused_linear')}")
quick = os.environ.get("QUICK") == "1"
what = "QUICK smoke run (32x32, fp32, tiny): checks the script, not a benchmark" if quick else "resnet18, 224x224, bf16 + channels_last, Adam"
table = "\n".join(lines) + (f"\n\n{what}; device {os.environ.get('DEVICE', 'cuda')}; images/s = steady_train_samples_per_s "
                            f"(median of epochs 2..N, whole job), {'one run each' if rounds == 1 else f'the 1- and 2-GPU columns the median of {rounds} alternated runs'}.\n\n" + "\n".join(notes) + "\n")
Path(sys.argv[1]).write_text(table)
print(table)
PY
echo "total $((SECONDS - START)) s" | tee -a "$LOG"
