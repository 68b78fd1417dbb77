"""Where a first-time user's short run spends its wall time, phase by phase, with and without the exporter.

Runs `mpsrun run RECIPE ARGS` `--repeats` times per variant (alternating, each in a new folder with a new
MLflow store) and reads each run's `mpsrun_timings.json`: seconds since the process started at the end of
set-up (`prepared`), when the run opened, its records began, the canary ended, training ended and the
test split was scored, then `done` (the records written: figures and the logged model) and the process's
exit, measured from outside. Variants: `MPSRUN_EXPORT_AHEAD=1` (the exporter process: the model exported
while training, the end figures drawn beside the helper) and `=0` (both at the end, as before).
The whole-process wall time of such runs swings by seconds between rounds on a shared GPU machine; the
phases say which part moved.

    python benchmarks/startup_phases.py --repeats 4 -- recipes/fashion_mlp_mps.yaml device=cuda epochs=10 \
        dataset.root=DATA dataset.download=false
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("prepared", "run_opened", "records_begun", "canary_done", "trained", "tested")


def one(args: list[str], ahead: str, folder: Path) -> dict[str, float]:
    env = {**os.environ, "MPSRUN_EXPORT_AHEAD": ahead, "PYTHONWARNINGS": "ignore"}
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mpsrun", "run", *args, "-q"], cwd=folder, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"exit {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{folder}/mlruns/mlflow.db")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    t = json.loads(mlflow.artifacts.load_text(f"runs:/{run.info.run_id}/mpsrun_timings.json"))
    out = {k: float(t["since_process_start_s"][k]) for k in PHASES}
    out["records_end"] = out["tested"] + float(t.get("end_flush_time_s", 0.0)) + float(t.get("end_records_time_s", 0.0))
    out["exit"] = wall
    return out


def main() -> int:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("run_args", nargs="+", help="the recipe and its overrides (after --)")
    a = ap.parse_args()
    args = [str(Path(a.run_args[0]).resolve()), *a.run_args[1:]]
    args = [f"dataset.root={Path(x.split('=', 1)[1]).resolve()}" if x.startswith("dataset.root=") else x for x in args]
    got: dict[str, list[dict[str, float]]] = {"1": [], "0": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.repeats):
            for ahead in (("1", "0") if i % 2 == 0 else ("0", "1")):
                folder = Path(tempfile.mkdtemp(dir=d))
                got[ahead].append(one(args, ahead, folder))
                r = got[ahead][-1]
                print(f"round {i + 1} ahead={ahead}: " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    print("\n| seconds since the process started (median) | exporter (`MPSRUN_EXPORT_AHEAD=1`) | at the end (`=0`) |")
    print("| --- | ---: | ---: |")
    for k in (*PHASES, "records_end", "exit"):
        m1, m0 = statistics.median(r[k] for r in got["1"]), statistics.median(r[k] for r in got["0"])
        print(f"| {k} | {m1:.2f} | {m0:.2f} |")
    spans = {"set-up (to prepared)": ("start", "prepared"), "training (canary_done to trained)": ("canary_done", "trained"),
             "the end (tested to records written)": ("tested", "records_end"), "records written to exit": ("records_end", "exit")}
    print("\n| span (median of the runs' own spans) | exporter | at the end |")
    print("| --- | ---: | ---: |")
    for label, (x, y) in spans.items():
        med = [statistics.median(r[y] - (r[x] if x != "start" else 0.0) for r in got[v]) for v in ("1", "0")]
        print(f"| {label} | {med[0]:.2f} | {med[1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
