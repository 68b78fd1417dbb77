"""Side-by-side benchmark of the flagship recipe: tutorial loop vs hand-written loop vs mpsrun.

Runs, on this machine, the same data and the same device, one after another:
  (a) the PyTorch quickstart tutorial's loop, as users write it;
  (b) a careful hand-written loop (data resident on the device, no per-step sync);
  (c) `mpsrun run recipes/fashion_mlp_mps.yaml` through the real CLI, read back from MLflow.
Prints steady epoch times (median of epochs after the first), ratios and final
accuracies, and appends the result with machine, device and command to
docs/benchmarks.md. Speed is reported as ratios measured in one run, because
absolute times on shared machines drift.

When the real FashionMNIST files are absent it writes FashionMNIST-format data
(gzip'd IDX, 60,000 + 10,000 images) so it runs offline; the output says so.

    python benchmarks/fashion_bench.py --device cpu
    python benchmarks/fashion_bench.py --device cuda --epochs 10
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from baselines import resident_loop, tutorial_loop  # noqa: E402
from mpsrun.track.records.names import from_mlflow  # system/steady_epoch_time_s -> steady_epoch_time_s; final_val_* from val_*

RECIPE = ROOT / "recipes" / "fashion_mlp_mps.yaml"



def _timings(c, run_id):  # type: ignore[no-untyped-def]
    """mpsrun's bookkeeping from the run's mpsrun_timings.json, under the `mpsrun/` names the metrics had before."""
    import json
    import tempfile
    from pathlib import Path as _P

    try:
        with tempfile.TemporaryDirectory() as d:
            data = json.loads(_P(c.download_artifacts(run_id, "mpsrun_timings.json", d)).read_text())
    except Exception:  # a run from before the file: its metrics carry the names
        return {}
    return {f"mpsrun/{k}": v for k, v in data.items() if isinstance(v, (int, float))}

def ensure_data(root: Path, n_train: int, n_test: int) -> str:
    """Real files if present, else generated ones in the same format; says which."""
    from mpsrun.plugins.builtin.datasets import _has_files
    from mpsrun.testing.idx import write_idx_dataset

    raw = root / "FashionMNIST" / "raw"
    if _has_files(raw):
        return f"FashionMNIST files found in {raw}"
    write_idx_dataset(root, "FashionMNIST", n_train=n_train, n_test=n_test, seed=0)
    return f"generated FashionMNIST-format data ({n_train:,} + {n_test:,} images, gzip'd IDX) in {raw}"


def run_mpsrun(root: Path, device: str, epochs: int, store: Path, extra: list[str]) -> dict[str, Any]:
    """(c): the real CLI in a subprocess, as a user runs it; figures read back from MLflow."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{store / 'bench.db'}"
    cmd = [
        str(Path(sys.executable).parent / "mpsrun"),
        "run",
        str(RECIPE),
        f"device={device}",
        f"epochs={epochs}",
        f"dataset.root={root}",
        "tracking.experiment=fashion_bench",
        *extra,
        "--quiet",
        "--tracking-uri",
        uri,
    ]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"mpsrun failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name("fashion_bench")
    run = c.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    m = {**from_mlflow(run.data.metrics), **_timings(c, run.info.run_id)}
    times = [x.value for x in sorted(c.get_metric_history(run.info.run_id, "system/epoch_time_s"), key=lambda x: x.step)]
    return {
        "epoch_times_s": times,
        "first_epoch_s": m["first_epoch_time_s"],
        "steady_epoch_s": m["steady_epoch_time_s"],
        "val_accuracy": m["final_val_accuracy"],
        "val_loss": m["final_val_loss"],
        "mlflow_log_time_s": m.get("mpsrun/mlflow_log_time_s", m.get("mlflow_log_time_s", float("nan"))),
        "mlflow_handoff_time_s": m.get("mpsrun/mlflow_handoff_time_s", m.get("mlflow_handoff_time_s", float("nan"))),
        "mlflow_during_s": m.get("mpsrun/mlflow_log_time_during_training_s", m.get("mlflow_log_time_during_training_s", float("nan"))),
        "process_wall_s": wall,
        "graphs": run.data.params.get("resolved.graphs"),
        "data_path": run.data.tags.get("data.path"),
        "notes": run.data.tags.get("mpsrun.notes", ""),
        "command": " ".join(shlex.quote(x) for x in cmd[1:-2]),
        "stdout": p.stdout,
    }


def machine(device: str) -> str:
    from mpsrun.devices import sysinfo

    cpu = sysinfo.cpu_status().details
    desc = f"{platform.system()} {platform.machine()}, {cpu.get('brand', '?')}, {os.cpu_count()} logical CPUs"
    if device.startswith("cuda") and torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name(0)}"
    return desc + f", torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--baseline-epochs", type=int, default=None, help="epochs for (a) and (b); default --epochs")
    ap.add_argument("--root", type=Path, default=None, help="folder holding FashionMNIST/raw (default: a temp folder)")
    ap.add_argument("--n-train", type=int, default=60000)
    ap.add_argument("--n-test", type=int, default=10000)
    ap.add_argument("--which", default="a,b,c")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="markdown file to append to")
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--label", default="", help="a note for the results heading")
    ap.add_argument("mpsrun_overrides", nargs="*", help="extra key=value overrides for (c)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="mpsrun-bench-"))
    root = args.root or tmp / "data"
    data_note = ensure_data(root, args.n_train, args.n_test)
    print(data_note, flush=True)
    device = torch.device(args.device)
    be = args.baseline_epochs or args.epochs
    which = set(args.which.split(","))
    results: dict[str, dict[str, Any]] = {}
    if "a" in which:
        print(f"(a) tutorial loop, {be} epochs on {device} ...", flush=True)
        results["a"] = tutorial_loop(str(root), device, be, args.seed)
    if "b" in which:
        print(f"(b) hand-written resident loop, {be} epochs on {device} ...", flush=True)
        results["b"] = resident_loop(str(root), device, be, args.seed)
    if "c" in which:
        print(f"(c) mpsrun run, {args.epochs} epochs on {device} ...", flush=True)
        results["c"] = run_mpsrun(root, args.device, args.epochs, tmp, args.mpsrun_overrides)
        print(results["c"]["stdout"], flush=True)

    report = render(args, results, data_note, be)
    print(report)
    if not args.no_append:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write("\n" + report + "\n")
        print(f"appended to {args.out}")


def render(args: argparse.Namespace, r: dict[str, dict[str, Any]], data_note: str, be: int) -> str:
    names = {"a": "(a) tutorial loop", "b": "(b) hand-written resident loop", "c": "(c) mpsrun run"}
    lines = [
        f"### {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} — FashionMNIST MLP on `{args.device}`"
        + (f" — {args.label}" if args.label else ""),
        "",
        f"- machine: {machine(args.device)}",
        f"- command: `python benchmarks/fashion_bench.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`",
        f"- data: {data_note}",
        f"- epochs: (a), (b) {be}; (c) {args.epochs}. Steady = median of the epochs after the first.",
        "",
        "| loop | first epoch (s) | steady epoch (s) | total (s) | final val acc |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k, v in r.items():
        total = sum(v["epoch_times_s"])
        lines.append(
            f"| {names[k]} | {v['first_epoch_s']:.3f} | {v['steady_epoch_s']:.4f} | {total:.2f} | {v['val_accuracy']:.4f} |"
        )
    lines.append("")
    if "c" in r:
        c = r["c"]
        for k in ("a", "b"):
            if k in r:
                lines.append(f"- steady epoch, {names[k]} / mpsrun: **{r[k]['steady_epoch_s'] / c['steady_epoch_s']:.1f}x**")
        if "b" in r:
            lines.append(f"- final val accuracy, mpsrun − (b): {100 * (c['val_accuracy'] - r['b']['val_accuracy']):+.2f} points")
        total = sum(c["epoch_times_s"])
        lines.append(
            f"- mpsrun: {len(c['epoch_times_s'])} epochs in {total:.2f} s of training time (warm-up included); "
            f"process wall time {c['process_wall_s']:.1f} s (start-up, data load, MLflow included)"
        )
        lines.append(
            f"- MLflow metric logging during training: {1e3 * c['mlflow_handoff_time_s']:.2f} ms handing metrics "
            f"over on the training thread + {1e3 * c['mlflow_during_s']:.1f} ms of batched writes on the background "
            f"writer = {100 * (c['mlflow_handoff_time_s'] + c['mlflow_during_s']) / total:.2f}% of training time "
            f"({1e3 * c['mlflow_log_time_s']:.1f} ms of writes in all, the rest after the last epoch)"
        )
        lines.append(f"- mpsrun resolved: data path {c['data_path']}, CUDA graphs {c['graphs']}; notes: {c['notes'] or 'none'}")
        lines.append(f"- mpsrun command: `mpsrun {c['command']}`")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
