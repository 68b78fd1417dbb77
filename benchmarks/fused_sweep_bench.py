"""Fused sweeps (sweep.fuse) against what they replace, side by side in one run, with the real commands.

cpu  (the 2-core target): a 16-trial digits sweep (lr, weight decay, momentum; 3 epochs) fused, and with
     `fuse: off`, against ONE `mpsrun run` of the recipe. Target: fused at most 1.5x the run's wall time.
cpu --controls: the same sweep with what a real sweep has (accumulate 2, label smoothing 0.1, a warm-up epoch then a
     cosine schedule stepped every optimizer step, clipping at 1.0): fused, `fuse: off`, the sweep without them, and
     what a user writes instead (`user_sweep` below, run as its
     own process: `python benchmarks/fused_sweep_bench.py user-sweep ...`: Optuna's 16 trials each a plain PyTorch
     loop, MLflow nested runs), alternated, medians.
cuda (the H100 target):
  (a) 64 trials of the fashion recipe (recipes/fashion_mlp_mps.yaml's model, device cuda, 5 epochs; lr,
      weight decay, seed), fused, against one `mpsrun run` of one trial. Target: at most 3x.
  (b) a small CNN on 32x32 images (the `synthetic` dataset, 3x32x32), 16 trials: fused against `fuse: off`
      with one worker, trials per second. Target: at least 4x.
  (c) the curve: trial-epochs per second for fused groups of 1, 4, 16, 64, 256 fashion members, in process
      (sweep/fused's engine alone, no MLflow), and a torch.profiler table of the largest group's epoch.
Every sweep's trials are checked: a FAILED trial makes the row NOT A TIMING. FashionMNIST is written
with mpsrun.testing.idx (no download). `--tiny` runs every part small (CPU-checkable).

    python benchmarks/fused_sweep_bench.py --device cpu
    python benchmarks/fused_sweep_bench.py --device cpu --controls
    python benchmarks/fused_sweep_bench.py --device cuda --out $OUT
    python benchmarks/fused_sweep_bench.py --device cpu --tiny --gpu-parts   # the cuda parts, tiny, on the CPU
"""

from __future__ import annotations

import time

STARTED_AT = time.perf_counter()  # the user's own sweep is timed from its process's first line (imports count)

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_bench import PHASES, STARTED, TRACES, breakdown, failed_trials, folder, machine, timed  # noqa: E402

DIGITS = """\
device: cpu
epochs: 3
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
  momentum: 0.9
tracking:
  experiment: fused_bench
sweep:
  metric: val_loss
  trials: {trials}
  sampler: tpe
  fuse: {fuse}
  params:
    optimizer.lr: {{low: 1.0e-3, high: 0.5, log: true}}
    optimizer.weight_decay: {{low: 1.0e-6, high: 1.0e-2, log: true}}
    optimizer.momentum: {{low: 0.0, high: 0.95}}
"""

FASHION = """\
device: {device}
epochs: {epochs}
batch_size: 64
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
  lr: 0.01
tracking:
  experiment: fused_bench_fashion
sweep:
  metric: val_loss
  trials: {trials}
  sampler: random
  fuse: {fuse}
  params:
    optimizer.lr: {{low: 1.0e-3, high: 0.1, log: true}}
    optimizer.weight_decay: {{low: 1.0e-6, high: 1.0e-3, log: true}}
    seed: {{low: 0, high: 1000}}
"""

CNN = """\
device: {device}
epochs: {epochs}
batch_size: 128
seed: 0
precision: {precision}
dataset:
  name: synthetic
  shape: [3, 32, 32]
  train_size: {train}
  val_size: {val}
model:
  name: cnn
  channels: [32, 64]
  hidden: 128
  dropout: 0.0
optimizer:
  name: sgd
  lr: 0.01
  momentum: 0.9
tracking:
  experiment: fused_bench_cnn
sweep:
  metric: val_loss
  trials: {trials}
  sampler: random
  fuse: {fuse}
  params:
    optimizer.lr: {{low: 1.0e-3, high: 0.1, log: true}}
    optimizer.momentum: {{low: 0.0, high: 0.95}}
"""


def _since(line: str, t0: float | None) -> str:
    """`t+S ` for a trace line with a wall clock (`at=`): seconds since the command started, a timeline of its start."""
    at = [f for f in line.split() if f.startswith("at=")]
    return f"t+{float(at[0][3:]) - t0:.2f} " if at and t0 is not None else ""


def checked(d: Path) -> str:
    bad = failed_trials(d)
    return f" {bad}" if bad else ""


def cpu(base: Path, trials: int, repeats: int) -> list[tuple[str, float, str]]:
    d, on = folder(base, "digits", DIGITS.format(trials=trials, fuse="auto"))
    off = d / "off.yaml"
    off.write_text(DIGITS.format(trials=trials, fuse="off"))
    timed(["run", str(on), "-q"], d)  # warm-up: the store, the page cache
    ones, fused, unfused = [], [], []
    loads = [os.getloadavg()[0]]  # a shared 2-core machine: the load beside each figure
    for i in range(repeats):
        ones.append(timed(["run", str(on), "-q"], d))
        fused.append(timed(["sweep", str(on), "--study", f"on{i}", "-q"], d))
        unfused.append(timed(["sweep", str(off), "--study", f"off{i}", "-q"], d))
        loads.append(os.getloadavg()[0])
    one, f, u = statistics.median(ones), statistics.median(fused), statistics.median(unfused)
    pairs = ", ".join(f"{a / b:.2f}x" for a, b in zip(fused, ones))
    load = f"load average (1 min) {min(loads):.2f}-{max(loads):.2f}"
    return [(f"one `mpsrun run` (3 epochs), median of {repeats}; {load}", one, "1.00x"),
            (f"`mpsrun sweep`, {trials} trials, fused (auto), median of {repeats}", f, f"{f / one:.2f}x (target <= 1.5x; pairs {pairs}){checked(d)}"),
            (f"`mpsrun sweep`, {trials} trials, fuse: off, median of {repeats}", u, f"{u / one:.2f}x")]


CONTROLS = """\
accumulate: 2
loss: {{name: cross_entropy, label_smoothing: 0.1}}
scheduler:
  name: CosineAnnealingLR
  T_max: {t_max}
  interval: step
  warmup_epochs: 1
grad_clip:
  max_norm: 1.0
"""


def controls(base: Path, trials: int, repeats: int) -> list[tuple[str, float, str]]:
    """The digits sweep with accumulate 2, label smoothing, a per-step warm-up + cosine schedule and clipping (the
    issue's): fused, fuse: off, the same sweep without them (fused), and the user's own Optuna + PyTorch + MLflow loop
    (`user_sweep`, the same controls), alternated; medians."""
    epochs = 3
    steps = -(-(-(-1437 // 32)) // 2)  # digits' training split at batch 32, two micro-batches a step: optimizer steps an epoch
    extra = CONTROLS.format(t_max=steps * (epochs - 1))
    d, on = folder(base, "controls", DIGITS.format(trials=trials, fuse="auto") + extra)
    off, plain = d / "off.yaml", d / "plain.yaml"
    off.write_text(DIGITS.format(trials=trials, fuse="off") + extra)
    plain.write_text(DIGITS.format(trials=trials, fuse="auto"))
    user = [sys.executable, str(Path(__file__).resolve()), "user-sweep", "--trials", str(trials), "--epochs", str(epochs), "--controls"]
    timed(["run", str(on), "-q"], d)  # warm-up: the store, the page cache
    fused, unfused, plains, users = [], [], [], []
    loads = [os.getloadavg()[0]]
    for i in range(repeats):
        store = d / f"user{i}"
        store.mkdir()
        t0 = time.perf_counter()
        p = subprocess.run([*user, "--store", str(store)], cwd=d, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"user-sweep exited {p.returncode}:\n{p.stderr[-3000:]}")
        users.append(time.perf_counter() - t0)
        fused.append(timed(["sweep", str(on), "--study", f"on{i}", "-q"], d))
        plains.append(timed(["sweep", str(plain), "--study", f"plain{i}", "-q"], d))
        unfused.append(timed(["sweep", str(off), "--study", f"off{i}", "-q"], d))
        loads.append(os.getloadavg()[0])
    f, u, w, pl = statistics.median(fused), statistics.median(unfused), statistics.median(users), statistics.median(plains)
    notes = _notes(d)
    load = f"load average (1 min) {min(loads):.2f}-{max(loads):.2f}"
    pairs = ", ".join(f"{a / b:.2f}x" for a, b in zip(fused, users))
    return [(f"controls: the user's own loop (user-sweep: Optuna, {trials} plain PyTorch trials, MLflow nested runs), median of {repeats}; {load}", w, "1.00x"),
            (f"controls: `mpsrun sweep`, {trials} trials, fused (auto), median of {repeats}{notes}", f,
             f"{f / w:.2f}x (target <= 0.7x; pairs {pairs}); {f / pl:.2f}x the sweep without the controls (target <= 1.2x){checked(d)}"),
            (f"controls: `mpsrun sweep`, {trials} trials, fuse: off, median of {repeats}", u, f"{u / w:.2f}x"),
            (f"the same sweep without the controls, fused, median of {repeats}", pl, f"{pl / w:.2f}x")]


def _notes(d: Path) -> str:
    """What the last fused sweep's parent says of its fusion: a trial that ran unfused makes the row say so."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{d / 'mlruns' / 'mlflow.db'}")
    notes = [r.data.tags.get("mpsrun.notes", "") for e in c.search_experiments() for r in c.search_runs([e.experiment_id])
             if r.data.tags.get("mpsrun.sweep") == "parent"]
    return " (SOME TRIALS RAN UNFUSED)" if any("ran unfused" in n for n in notes) else ""


def gpu(base: Path, device: str, tiny: bool, cnn_epochs: int = 5, cnn_train: int = 50000,
        parts: tuple[str, ...] = ("fashion", "cnn"), precision: str = "auto") -> list[tuple[str, float, str]]:
    rows: list[tuple[str, float, str]] = []
    if "fashion" in parts:
        rows += _fashion(base, device, tiny)
    if "cnn" in parts:
        rows += _cnn(base, device, tiny, cnn_epochs, cnn_train, precision)
    return rows


def _fashion(base: Path, device: str, tiny: bool) -> list[tuple[str, float, str]]:
    from mpsrun.testing.idx import write_idx_dataset

    data = base / "data"
    n_train, n_test = (2000, 500) if tiny else (60000, 10000)
    write_idx_dataset(data, "FashionMNIST", n_train=n_train, n_test=n_test, seed=0)
    trials, epochs = (4, 1) if tiny else (64, 5)
    rows: list[tuple[str, float, str]] = []
    d, on = folder(base, "fashion", FASHION.format(device=device, epochs=epochs, root=data, trials=trials, fuse="auto"))
    timed(["run", str(on), "-q"], d)  # warm-up: the store, CUDA's first context, the page cache
    one = timed(["run", str(on), "-q"], d)
    sweep = timed(["sweep", str(on), "-q"], d, "fashion fused")
    rows += [(f"fashion: one `mpsrun run` ({epochs} epochs)", one, "1.00x"),
             (f"fashion: `mpsrun sweep`, {trials} trials, fused", sweep, f"{sweep / one:.2f}x (target <= 3x){checked(d)}")]
    _say(rows[-2:])
    return rows


def _cnn(base: Path, device: str, tiny: bool, cnn_epochs: int, cnn_train: int, precision: str = "auto") -> list[tuple[str, float, str]]:
    rows: list[tuple[str, float, str]] = []
    ct, cepochs, train, val = (4, 1, 512, 128) if tiny else (16, cnn_epochs, cnn_train, cnn_train // 5)
    d2, con = folder(base, "cnn", CNN.format(device=device, epochs=cepochs, train=train, val=val, trials=ct, fuse="auto", precision=precision))
    coff = d2 / "off.yaml"
    coff.write_text(CNN.format(device=device, epochs=cepochs, train=train, val=val, trials=ct, fuse="off", precision=precision))
    timed(["run", str(con), "-q"], d2)
    w_off = timed(["sweep", str(coff), "--study", "off", "-q"], d2, "cnn fuse: off")
    w_on = timed(["sweep", str(con), "--study", "on", "-q"], d2, "cnn fused")
    rows += [(f"cnn 32x32{' bf16' if precision == 'bf16' else ''}: `mpsrun sweep`, {ct} trials, fuse: off, 1 worker ({ct / w_off:.3f} trials/s)", w_off, "1.00x"),
             (f"cnn 32x32{' bf16' if precision == 'bf16' else ''}: `mpsrun sweep`, {ct} trials, fused ({ct / w_on:.3f} trials/s)", w_on,
              f"{w_off / w_on:.2f}x the trials per second (target >= 4x){checked(d2)}")]
    _say(rows[-2:])
    return rows


def _say(rows: list[tuple[str, float, str]]) -> None:
    """Each row as it is measured (a run cut off by a time limit still shows what it measured)."""
    for w, s_, r in rows:
        print(f"| {w} | {s_:.1f} | {r} |", flush=True)


def curve(base: Path, device: str, sizes: list[int], epochs: int, tiny: bool, out: Path | None, model: str = "fashion",
          cnn_train: int = 50000, seeds: int = 4, precision: str = "auto") -> list[str]:
    """Trial-epochs per second of fused groups of each size, the engine alone (no MLflow, no Optuna), as a sweep
    trains them (graphed on CUDA); for the largest group, one eager epoch profiled: the kernels' own times."""
    import torch

    from mpsrun.plugins import resolve
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused import engine, graphed, members
    from mpsrun.sweep.fused.work import torch_threads

    data = base / "data"
    d = base / f"curve-{model}"
    d.mkdir(exist_ok=True)
    path = d / "f.yaml"
    if model == "cnn":
        train = 512 if tiny else cnn_train
        path.write_text(CNN.format(device=device, epochs=epochs, train=train, val=train // 5, trials=1, fuse="auto", precision=precision))
    else:
        path.write_text(FASHION.format(device=device, epochs=epochs, root=data, trials=1, fuse="auto"))
    resolved = resolve(path)
    place = {"tracking.log_model": False, "tracking.figures": False, "tracking.system_metrics": False, "checkpoint.every": 0}
    lines = [f"| {model} members | epochs | seconds (after a warm-up epoch) | trial-epochs/s | vs 1 member | step |",
             "| ---: | ---: | ---: | ---: | ---: | --- |"]
    first = None
    cache: dict = {}

    class T:
        def __init__(self, n: int) -> None:
            self.number = n

    solo = _solo(trial_recipe(resolved, {"optimizer.lr": 0.001, **place}), epochs + 1)
    lines.append(f"| solo (`mpsrun run`'s engine, its own options) | {epochs} | {solo:.2f} | {epochs / solo:.2f} | - | {_options(resolved)} |")
    print(lines[-1], flush=True)
    for m in sizes:
        values = [{"optimizer.lr": 0.001 + 0.0001 * i, "seed": i % seeds} for i in range(m)]  # seeds: data streams
        mems = [members.Member(T(i), v, trial_recipe(resolved, {**v, **place}), {}) for i, v in enumerate(values)]
        try:
            b = members.build(mems, cache)
        except Exception as e:  # noqa: BLE001 - out of memory at this size: the row says so
            lines.append(f"| {m} | - | {type(e).__name__}: {str(e)[:120]} | - | - | - |")
            continue
        threads = torch_threads(b.device)
        said: list[str] = []
        g, note = graphed.group_for(b, said.append)
        b.epochs = 1
        g.run(lambda mem, e, metrics: None)  # warm-up epoch (graphs captured)
        b.epochs = epochs
        if b.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.run(lambda mem, e, metrics: None)
        if b.device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        rate = m * epochs / secs
        first = first or rate
        how = "graphs" if getattr(g, "graphs", None) and not getattr(g, "eager", None) else "eager" + (f" ({'; '.join(said)})" if said else "")
        lines.append(f"| {m} | {epochs} | {secs:.2f} | {rate:.2f} | {rate / first:.1f}x | {how} |")
        print(lines[-1], flush=True)
        if m == max(sizes) and out is not None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.device.type == "cuda" else [])
            b.epochs = 1
            eager = engine.Group(b)
            with profile(activities=acts, record_shapes=True) as prof:
                eager.run(lambda mem, e, metrics: None)
            key = "cuda_time_total" if b.device.type == "cuda" else "cpu_time_total"
            name = f"profile_{model}_{m}_members_eager_epoch.txt"
            table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=90)
            if b.device.type == "cuda":  # the kernels themselves, by their own time
                table += "\n\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
                table += "\n\n" + prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=30,
                                                                                    max_name_column_width=60, max_shapes_column_width=120)
            (out / name).write_text(table)
            lines.append(f"|  | one eager epoch of the {m}-member group profiled (kernel times): {out / name} | | | | |")
        if threads:
            torch.set_num_threads(threads)
        del g, b, mems
        if device == "cuda":
            torch.cuda.empty_cache()
    return lines


def _solo(r: object, epochs: int) -> float:
    """Seconds of a solo run's epochs after its first (capture, warm-up), as `mpsrun run` trains it."""
    from mpsrun.train import runner
    from mpsrun.train.loop.engine import Listener, train

    s = runner.prepare(r)  # type: ignore[arg-type]
    res = train(s.model, s.optimizer, s.plan, s.choice.device, epochs, s.options, Listener(), objective=s.objective)
    return sum(e.epoch_time_s for e in res.epochs[1:])


def _options(resolved: object) -> str:
    from mpsrun.train import runner

    s = runner.prepare(resolved)  # type: ignore[arg-type]
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in s.options.as_params().items() if v not in ("false", "fp32"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--trials", type=int, default=16, help="cpu: trials of the digits sweep")
    ap.add_argument("--repeats", type=int, default=3, help="cpu: interleaved (run, fused sweep, unfused sweep) triples; medians")
    ap.add_argument("--controls", action="store_true", help="cpu: the sweep with a schedule and clipping, against the user's own loop")
    ap.add_argument("--tiny", action="store_true", help="every part small: checks the script (the GPU parts too, with --gpu-parts) on a CPU")
    ap.add_argument("--gpu-parts", action="store_true", help="with --device cpu: run the cuda parts (a, b, c) on the CPU")
    ap.add_argument("--sizes", default="1,4,16,64,256", help="the curve's group sizes (empty: no fashion curve)")
    ap.add_argument("--curve-epochs", type=int, default=3, help="timed epochs per size of the curve (after a warm-up epoch)")
    ap.add_argument("--cnn-epochs", type=int, default=5, help="cuda (b): epochs of each CNN trial")
    ap.add_argument("--cnn-train", type=int, default=50000, help="cuda (b): training images of the CNN's synthetic data")
    ap.add_argument("--cnn-sizes", default="", help="cuda: also the curve of fused CNN groups of these sizes (e.g. 1,4,16,64)")
    ap.add_argument("--parts", default="fashion,cnn", help="cuda: which sweeps run (fashion (a), cnn (b))")
    ap.add_argument("--cnn-precision", default="auto", choices=("auto", "bf16"), help="the CNN recipe's precision (sweeps and curve)")
    ap.add_argument("--curve-seeds", type=int, default=4, help="the curve's members' distinct seeds (1: one batch shared by all)")
    ap.add_argument("--no-sweeps", action="store_true", help="cuda: the curves only (not the sweeps (a) and (b))")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for the profile tables and this output (default $OUT)")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fused-bench-") as tmp:
        base = Path(tmp)
        rows: list[tuple[str, float, str]] = []
        lines: list[str] = []
        if a.device == "cpu" and not a.gpu_parts:
            rows = (controls if a.controls else cpu)(base, 4 if a.tiny else a.trials, 1 if a.tiny else a.repeats)
        else:
            sizes = [int(s) for s in a.sizes.split(",") if s] if not a.tiny else [1, 4]
            if not a.no_sweeps:
                rows = gpu(base, a.device, a.tiny, a.cnn_epochs, a.cnn_train, tuple(a.parts.split(",")), a.cnn_precision)
            if sizes and not (base / "data").exists():
                from mpsrun.testing.idx import write_idx_dataset

                write_idx_dataset(base / "data", "FashionMNIST", n_train=2000 if a.tiny else 60000, n_test=500 if a.tiny else 10000, seed=0)
            lines = curve(base, a.device, sizes, 1 if a.tiny else a.curve_epochs, a.tiny, out, seeds=a.curve_seeds) if sizes else []
            if a.cnn_sizes:
                cnn_sizes = [1, 4] if a.tiny else [int(x) for x in a.cnn_sizes.split(",")]
                lines += [""] + curve(base, a.device, cnn_sizes, 1 if a.tiny else a.curve_epochs, a.tiny, out, "cnn", a.cnn_train, a.curve_seeds, a.cnn_precision)
    text = [f"\nmachine: {machine(a.device)}", f"command: python benchmarks/fused_sweep_bench.py {' '.join(sys.argv[1:] if argv is None else argv)}", "",
            "| what | wall (s) | vs baseline |", "| --- | ---: | ---: |"]
    text += [f"| {w} | {s:.1f} | {r} |" for w, s, r in rows]
    if TRACES:  # where each sweep's time went (MPSRUN_SWEEP_TRACE): the fused group's phases are one line for all members
        text += ["", "| sweep (mean seconds per trial; a fused group's line is the whole group's) | " + " | ".join(PHASES) + " |",
                 "| --- |" + " ---: |" * len(PHASES)]
        for label, out_text in TRACES.items():
            text += breakdown(label, out_text)
            t0 = STARTED.get(label, (None, None))[0]
            text += [f"    {_since(ln, t0)}{ln}" for ln in out_text.splitlines() if ln.startswith(
                ("sweep-trace-group", "sweep-trace-total", "sweep-trace-capture", "sweep-trace-check", "sweep-trace-mark", "sweep-trace-rehearsal"))]
    if lines:
        text += ["", "Fused groups of fashion members, the engine alone (trial-epochs per second):", ""] + lines
    print("\n".join(text))
    if out is not None:
        (out / "fused_sweep_bench.md").write_text("\n".join(text) + "\n")
    return 0


def user_sweep(argv: list[str]) -> int:
    """What a user writes instead of `mpsrun sweep` (the `controls` rows' baseline): one process, Optuna asking the
    trials, each a plain PyTorch loop (the DIGITS recipe's MLP and search; with `--controls` a warm-up epoch then a
    cosine schedule stepped every optimizer step, and clip_grad_norm_ at 1.0), each a nested MLflow run of one parent.
    Written as a careful user would: data as tensors once, no DataLoader, one `.item()`-like read per epoch."""
    ap = argparse.ArgumentParser(prog="fused_sweep_bench.py user-sweep")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--controls", action="store_true", help="a warm-up + cosine schedule per step and grad clipping")
    ap.add_argument("--store", required=True, help="a folder for the MLflow SQLite store")
    a = ap.parse_args(argv)

    import mlflow
    import optuna
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(1)  # as mpsrun's fused CPU group runs (two threads wait on each other at this size)
    x, y = load_digits(return_X_y=True)
    xtr, xva, ytr, yva = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    xtr, xva = torch.tensor(xtr / 16.0, dtype=torch.float32), torch.tensor(xva / 16.0, dtype=torch.float32)
    ytr, yva = torch.tensor(ytr), torch.tensor(yva)
    accumulate = 2 if a.controls else 1
    steps = -(-(-(-len(xtr) // 32)) // accumulate)  # optimizer steps an epoch
    mlflow.set_tracking_uri(f"sqlite:///{a.store}/mlflow.db")
    mlflow.set_experiment("user_sweep")

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 1e-3, 0.5, log=True)
        wd = trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True)
        mom = trial.suggest_float("momentum", 0.0, 0.95)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mom, weight_decay=wd)
        sched = None
        if a.controls:
            warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=steps)
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps * max(1, a.epochs - 1))
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[steps])
        loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1 if a.controls else 0.0)
        with mlflow.start_run(run_name=f"trial {trial.number}", nested=True):
            mlflow.log_params({"lr": lr, "weight_decay": wd, "momentum": mom})
            val = float("nan")
            for epoch in range(a.epochs):
                model.train()
                order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
                total = torch.zeros(())
                starts = list(range(0, len(xtr), 32))
                for k, i in enumerate(starts):
                    idx = order[i : i + 32]
                    group = starts[k - k % accumulate : k - k % accumulate + accumulate]  # this step's micro-batches
                    size = sum(min(32, len(xtr) - g) for g in group)
                    loss = loss_fn(model(xtr[idx]), ytr[idx])
                    if k % accumulate == 0:
                        opt.zero_grad()
                    (loss * (len(idx) / size)).backward()
                    total += loss.detach() * len(idx)
                    if i != group[-1]:
                        continue
                    if a.controls:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    if sched is not None:
                        sched.step()
                model.eval()
                with torch.no_grad():
                    out = model(xva)
                    val = float(loss_fn(out, yva))
                    acc = float((out.argmax(1) == yva).float().mean())
                mlflow.log_metrics({"train_loss": float(total) / len(xtr), "val_loss": val, "val_accuracy": acc}, step=epoch)
        return val

    with mlflow.start_run(run_name="sweep"):
        study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
        study.optimize(objective, n_trials=a.trials)
        mlflow.log_metric("best_val_loss", study.best_value)
    print(f"user sweep: {a.trials} trials, best val_loss {study.best_value:.4f}, {time.perf_counter() - STARTED_AT:.1f} s after imports began")
    return 0


if __name__ == "__main__":
    sys.exit(user_sweep(sys.argv[2:]) if sys.argv[1:2] == ["user-sweep"] else main())
