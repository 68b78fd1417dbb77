"""`mpsrun sweep` against what it replaces, measured side by side with the real commands.

(a) ``--device cpu`` (the 2-core target): a 16-trial sweep of the digits MLP, 1 epoch a
    trial, one worker, against ONE ``mpsrun run`` of the same recipe. Target: the sweep's
    wall time at most 4x the single run's (a process per trial would be ~16x).
(b) ``--device cuda`` (the H100 target): a 32-trial sweep of the FashionMNIST MLP (2 epochs a trial, or
    ``--epochs 10 --batch 64`` as recipes/fashion_mlp_mps.yaml trains) (written
    here with mpsrun.testing.idx, 60000 + 10000 images) with ``--workers 4`` against
    ``--workers 1``. Target: at most 0.5x the wall time.

Every figure is the wall time of a real command (``sys.executable -m mpsrun ...``) in a
working folder of its own; each folder's MLflow store is created first by an untimed
warm-up run, so no timed command pays the store's creation. Prints a markdown table.

    python benchmarks/sweep_bench.py --device cpu
    python benchmarks/sweep_bench.py --device cuda
    python benchmarks/sweep_bench.py --device cuda --trace   # and where each trial's time goes, phase by phase
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIGITS = """\
device: cpu
epochs: 1
batch_size: 32
seed: 0
dataset:
  name: digits
model:
  name: mlp
  hidden: [64]
optimizer:
  name: sgd
  lr: 0.05
tracking:
  experiment: sweep_bench
sweep:
  metric: val_loss
  trials: {trials}
  sampler: tpe
  params:
    optimizer.lr: {{low: 1.0e-3, high: 0.5, log: true}}
    model.hidden: [[32], [64], [128, 64]]
"""

FASHION = """\
device: cuda
epochs: {epochs}
batch_size: {batch}
seed: 0
dataset:
  name: fashion_mnist
  root: {root}
  download: false
model:
  name: mlp
  hidden: [512, 512]
optimizer:
  name: sgd
  lr: 0.05
tracking:
  experiment: sweep_bench_fashion
sweep:
  metric: val_loss
  trials: {trials}
  sampler: tpe
  params:
    optimizer.lr: {{low: 1.0e-3, high: 0.5, log: true}}
    optimizer.momentum: {{low: 0.0, high: 0.95}}
{batch_param}"""


TRACES: dict[str, str] = {}  # label -> the sweep's output, when --trace is given
EPOCHS: dict[str, str] = {}  # label -> the trials' own epoch times, read from the store after the sweep
STARTED: dict[str, tuple[float, float]] = {}  # label -> the command's (start, end) on the wall clock


def timed(args: list[str], cwd: Path, trace: str | None = None, extra_env: dict[str, str] | None = None) -> float:
    """Wall time of one real command; `trace`: a label, the command run with MPSRUN_SWEEP_TRACE=1 and its output kept."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(extra_env or {})
    if trace is not None:
        env["MPSRUN_SWEEP_TRACE"] = "1"
    t0, w0 = time.perf_counter(), time.time()
    p = subprocess.run([sys.executable, "-m", "mpsrun", *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"`mpsrun {' '.join(args)}` exited {p.returncode}:\n{p.stdout[-4000:]}")
    if trace is not None:
        TRACES[trace] = p.stdout
        STARTED[trace] = (w0, time.time())
    return wall


PHASES = ("ask", "data", "prepare", "open", "train", "close", "tell", "release", "report", "wait", "canary", "total")


def breakdown(label: str, text: str) -> list[str]:
    """Markdown rows from a traced sweep's `sweep-trace` lines: mean seconds per trial and phase, and each worker's start."""
    per: list[dict[str, float]] = []
    later: list[dict[str, float]] = []  # each worker's first trial left out (torch._dynamo's import, the helper's start)
    starts: list[str] = []
    seen: set[str] = set()
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
        if line.startswith("sweep-trace "):
            per.append({k: float(v) for k, v in fields.items() if k in PHASES})
            if fields.get("worker") in seen:
                later.append(per[-1])
            seen.add(fields.get("worker", ""))
        elif line.startswith("sweep-trace-total "):
            starts.append(f"w{fields.get('worker')}: {fields.get('trials')} trials, ready after {float(fields.get('ready', 0)):.1f} s")
    if not per:
        return [f"| {label} | no trace lines (MPSRUN_SWEEP_TRACE) |" + " |" * len(PHASES)]
    rows = []
    for what, group in ((f"{label} ({len(per)} trials; {'; '.join(starts)})", per), (f"{label}, each worker's first trial left out", later)):
        if group:
            mean = {k: sum(d.get(k, 0.0) for d in group) / len(group) for k in PHASES}
            rows.append(f"| {what} | " + " | ".join(f"{mean[k]:.3f}" for k in PHASES) + " |")
    return rows


def timeline(label: str, text: str) -> list[str]:
    """Each worker on the command's clock: when it was ready, its first trial's end, its last trial's end.

    Why: the mean phases say what a trial costs, not where the sweep's wall time went (a late worker,
    a slow first trial, the end after the last trial); the trace lines' `at` stamps say that.
    """
    t0, t1 = STARTED.get(label, (0.0, 0.0))
    ends: dict[str, list[float]] = {}
    ready: dict[str, float] = {}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split()[1:] if "=" in f)
        if "at" not in fields:
            continue
        w = fields.get("worker", "?")
        if line.startswith("sweep-trace "):
            ends.setdefault(w, []).append(float(fields["at"]) - t0)
        elif line.startswith("sweep-trace-total "):
            ready[w] = float(fields["at"]) - t0 - float(fields.get("loop", 0))
    rows = []
    share = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("sweep-trace-share ")]
    if share:  # the private NVIDIA MPS daemon's start (or the attempt), before the extra workers were launched
        label = f"{label} ({share[0]})"
    for w in sorted(ends):
        e = sorted(ends[w])
        rows.append(f"| {label} | w{w} | {ready.get(w, float('nan')):.1f} | {e[0]:.1f} | {len(e)} | {e[-1]:.1f} | {t1 - t0:.1f} |")
    marks = [dict(f.split("=", 1) for f in line.split()[1:] if "=" in f) for line in text.splitlines() if line.startswith("sweep-trace-mark ")]
    if marks:  # the command's end, step by step
        rows.append(f"| {label} | the end | " + ", ".join(f"{m['what']} {float(m['at']) - t0:.1f}" for m in marks) + " | | | | |")
    return rows


def folder(base: Path, name: str, text: str) -> tuple[Path, Path]:
    d = base / name
    d.mkdir()
    recipe = d / "recipe.yaml"
    recipe.write_text(text)
    return d, recipe


def cpu(base: Path, trials: int, repeats: int, trace: bool = False) -> list[tuple[str, float, str]]:
    """Interleaved (run, sweep) pairs, each sweep a new study (--study), medians reported: a shared machine's load drifts."""
    import statistics

    d, recipe = folder(base, "digits", DIGITS.format(trials=trials))
    timed(["run", str(recipe), "-q"], d)  # warm-up: creates the store, fills the page cache
    ones, sweeps = [], []
    for i in range(repeats):
        ones.append(timed(["run", str(recipe), "-q"], d))
        sweeps.append(timed(["sweep", str(recipe), "--study", f"bench{i}", "-q"], d, f"cpu, 1 worker, pair {i + 1}" if trace else None))
    bad = failed_trials(d)
    if bad:
        sys.exit(f"the digits sweeps are no timing: {bad}")
    one, sweep = statistics.median(ones), statistics.median(sweeps)
    ratios = sorted(s / o for s, o in zip(sweeps, ones))
    return [
        (f"one `mpsrun run` (1 epoch), median of {repeats}", one, "1.00x"),
        (f"`mpsrun sweep`, {trials} trials, 1 worker, median of {repeats}", sweep,
         f"{sweep / one:.2f}x (target <= 4x; pairs {', '.join(f'{r:.2f}x' for r in ratios)})"),
        (f"a process per trial ({trials} x one run, computed)", trials * one, f"{trials:.2f}x"),
    ]


def fashion(root: Path, trials: int, epochs: int, batch: int | None) -> str:
    """The sweep recipe: `batch` None searches [128, 256, 512] (the default, short trials); a number fixes it
    (`--epochs 10 --batch 64` trains each trial as recipes/fashion_mlp_mps.yaml does)."""
    return FASHION.format(root=root, trials=trials, epochs=epochs, batch=batch or 256,
                          batch_param="" if batch else "    batch_size: [128, 256, 512]\n")


def cuda(base: Path, trials: int, workers: list[str], trace: bool = False, epochs: int = 2, batch: int | None = None) -> list[tuple[str, float, str]]:
    from mpsrun.testing.idx import write_idx_dataset

    data = base / "data"
    write_idx_dataset(data, "FashionMNIST", n_train=60000, n_test=10000, seed=0)
    rows: list[tuple[str, float, str]] = []
    first = None
    for i, spec in enumerate(workers):
        spec, _, assign = spec.partition("~")  # "4~VAR=VALUE": with that variable set
        n, _, sharing = spec.partition(":")  # "4:time-slicing": --workers 4 --gpu-sharing time-slicing
        extra = ["--gpu-sharing", sharing] if sharing else []
        env = dict([assign.split("=", 1)]) if assign else None
        label = f"--workers {n}" + (f" --gpu-sharing {sharing}" if sharing else "") + (f" ({assign})" if assign else "")
        if any(label == other.split(", run ")[0] for other in TRACES) or label in [r[0].split(", ", 1)[-1] for r in rows]:
            label += f", run {i + 1}"  # the same command again (alternated with others against drift)
        d, recipe = folder(base, f"fashion_{i}_w{n}", fashion(data, trials, epochs, batch))
        timed(["run", str(recipe), "-q"], d)  # warm-up: the store, CUDA's first context, the page cache
        wall = timed(["sweep", str(recipe), "--workers", n, *extra, "-q"], d, label if trace else None, env)
        if trace:
            EPOCHS[label] = epoch_times(d)
        bad = failed_trials(d)
        first = first or wall
        rows.append((f"`mpsrun sweep`, {trials} trials, {label}", wall, bad or f"{wall / first:.2f}x" + (" (target <= 0.5x)" if i else "")))
    return rows


def failed_trials(d: Path) -> str:
    """'' when no trial of the folder's sweeps FAILED; else how many and the first error (the row is then no timing).

    Why: a trial that fails in its first step is fast, and a sweep of them looks fast (on a 2-GPU host the second
    worker's trials failed in 0.2 s each, and this script printed 0.40x until it read the states).
    """
    import sqlite3

    db = d / "mlruns" / "mlflow.db"
    if not db.exists():
        return ""
    with sqlite3.connect(db) as con:
        failed = con.execute("SELECT run_uuid FROM tags WHERE key = 'mpsrun.sweep.state' AND value = 'FAILED'").fetchall()
        total = con.execute("SELECT COUNT(*) FROM tags WHERE key = 'mpsrun.sweep.state'").fetchone()[0]
        error = con.execute("SELECT value FROM tags WHERE key = 'mpsrun.error' LIMIT 1").fetchone()
    if not failed:
        return ""
    return f"NOT A TIMING: {len(failed)} of {total} trials FAILED ({(error[0] if error else '?')[:200]})"


def epoch_times(d: Path) -> str:
    """The trials' first and later epochs' training seconds (medians over trials), read from the folder's store.

    Why: a trial's `train` phase is capture plus steady epochs; beside other workers the two grow for
    different reasons (the CPU and the driver for capture, the GPU's sharing for the epochs).
    Read with sqlite3 so the bench does not import mlflow.
    """
    import sqlite3
    import statistics

    db = d / "mlruns" / "mlflow.db"
    if not db.exists():
        return "no store"
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT run_uuid, step, value FROM metrics WHERE key IN ('system/train_time_s', 'train_time_s')").fetchall()
        devices = con.execute("SELECT value, COUNT(*) FROM params WHERE key = 'device' GROUP BY value").fetchall()
    per: dict[str, dict[int, float]] = {}
    for run, step, value in rows:
        per.setdefault(run, {})[int(step)] = float(value)
    firsts = [e[min(e)] for e in per.values() if e]
    later = [v for e in per.values() for s, v in e.items() if s != min(e)]
    if not firsts:
        return "no epochs logged"
    return (f"{len(firsts)} runs ({', '.join(f'{n} on {d}' for d, n in sorted(devices))}): first epoch (capture) median {statistics.median(firsts):.3f} s, "
            f"later epochs median {statistics.median(later) if later else float('nan'):.4f} s "
            f"(min {min(later) if later else float('nan'):.4f}, max {max(later) if later else float('nan'):.4f})")


def machine(device: str) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{platform.processor() or platform.machine()}, {cores} cores, Python {platform.python_version()}"
    if device == "cuda":
        import torch

        text += f", {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--trials", type=int, default=None, help="default: 16 on cpu, 32 on cuda")
    ap.add_argument("--workers", default="1,4", help="cuda: worker counts to compare (the first is the baseline); N:SHARING adds --gpu-sharing SHARING, N~VAR=VALUE sets VAR")
    ap.add_argument("--repeats", type=int, default=3, help="cpu: interleaved (run, sweep) pairs; medians reported")
    ap.add_argument("--trace", action="store_true", help="run the sweeps with MPSRUN_SWEEP_TRACE=1 and print each one's mean seconds per trial and phase")
    ap.add_argument("--epochs", type=int, default=2, help="cuda: epochs a trial (recipes/fashion_mlp_mps.yaml trains 10)")
    ap.add_argument("--batch", type=int, default=None, help="cuda: a fixed batch size (the shipped recipe's is 64); default: searched over 128, 256, 512")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        base = Path(tmp)
        if a.device == "cpu":
            rows = cpu(base, a.trials or 16, a.repeats, a.trace)
        else:
            rows = cuda(base, a.trials or 32, a.workers.split(","), a.trace, a.epochs, a.batch)
    print(f"\nmachine: {machine(a.device)}\ncommand: python benchmarks/sweep_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}\n")
    print("| what | wall (s) | vs baseline |")
    print("| --- | ---: | ---: |")
    for what, wall, ratio in rows:
        print(f"| {what} | {wall:.1f} | {ratio} |")
    if TRACES:
        print("\nPer trial, mean seconds per phase (MPSRUN_SWEEP_TRACE; `wait`: the part spent waiting for the MLflow helper, `canary`: the part of `open` the device canary took; "
              "with several workers a phase includes time sliced away to the others):\n")
        print("| sweep | " + " | ".join(PHASES) + " |")
        print("| --- | " + " | ".join("---:" for _ in PHASES) + " |")
        for label, text in TRACES.items():
            for row in breakdown(label, text):
                print(row)
        print("\nTimeline, seconds from the command's start: each worker's first ask, its first trial's end, its trials, its last trial's end, the command's end:\n")
        print("| sweep | worker | first ask | first trial ends | trials | last trial ends | command ends |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for label, text in TRACES.items():
            for row in timeline(label, text):
                print(row)
    if EPOCHS:
        print("\nThe trials' training epochs (from each folder's store; the warm-up run included):\n")
        for label, text in EPOCHS.items():
            print(f"- {label}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
