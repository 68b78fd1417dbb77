"""The fashion recipe on CUDA with the fused Linear (+ ReLU) kernels on and off (issue 27, item 3).

Alternating rounds of `mpsrun run recipes/fashion_mlp_mps.yaml device=cuda epochs=N` through the real
CLI, `MPSRUN_FUSED_LINEAR=1` (the default) against `=0` (torch's Linear kernels), each round a new
store; prints the steady epoch (median of epochs 2..N), the first epoch, the process's wall time and
every epoch's val_accuracy and val_loss, so the trajectories can be compared side by side.

    python benchmarks/fused_linear_gpu.py [--rounds 3] [--epochs 10] [--root DATA]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from fashion_bench import RECIPE, ensure_data  # noqa: E402


def one(root: Path, store: Path, epochs: int, fused: str, extra: list[str]) -> dict:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{store / 'f.db'}"
    cmd = [str(Path(sys.executable).parent / "mpsrun"), "run", str(RECIPE), "device=cuda", f"epochs={epochs}", f"dataset.root={root}",
           "dataset.download=false", "tracking.experiment=fused", *extra, "--quiet", "--tracking-uri", uri]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "MPSRUN_FUSED_LINEAR": fused}, cwd=store)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"mpsrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    c = MlflowClient(uri)
    run = c.search_runs([c.get_experiment_by_name("fused").experiment_id], max_results=1)[0]

    def hist(name: str) -> list[float]:
        return [m.value for m in sorted(c.get_metric_history(run.info.run_id, name), key=lambda m: m.step)]

    times = hist("system/epoch_time_s")
    return {"wall": wall, "first": times[0], "steady": statistics.median(times[1:]) if len(times) > 1 else times[0],
            "acc": hist("val_accuracy"), "loss": hist("val_loss"), "fused": run.data.params.get("resolved.fused_linear"),
            "notes": run.data.tags.get("mpsrun.notes", "")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("extra", nargs="*", help="more key=value overrides")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fused-"))
    root = a.root or tmp / "data"
    print(ensure_data(root, 60000, 10000), flush=True)
    got: dict[str, list[dict]] = {"1": [], "0": []}
    for r in range(a.rounds):
        for fused in ("1", "0") if r % 2 == 0 else ("0", "1"):
            store = tmp / f"r{r}-{fused}"
            store.mkdir()
            res = one(root, store, a.epochs, fused, a.extra)
            got[fused].append(res)
            print(f"round {r} MPSRUN_FUSED_LINEAR={fused}: resolved.fused_linear={res['fused']} steady {res['steady']:.4f} s, "
                  f"first {res['first']:.3f} s, wall {res['wall']:.2f} s; notes: {res['notes']}", flush=True)
    print("\n| MPSRUN_FUSED_LINEAR | steady epoch s (median of rounds; each a median of epochs 2..N) | first epoch s | process wall s |")
    print("| --- | ---: | ---: | ---: |")
    for fused, rs in got.items():
        print(f"| {fused} | {statistics.median(r['steady'] for r in rs):.4f} ({', '.join('%.4f' % r['steady'] for r in rs)}) | "
              f"{statistics.median(r['first'] for r in rs):.3f} | {statistics.median(r['wall'] for r in rs):.2f} |")
    on, off = got["1"][0], got["0"][0]
    print("\nepoch: val_accuracy fused / torch's; val_loss fused / torch's (round 0)")
    for i, (a1, a0, l1, l0) in enumerate(zip(on["acc"], off["acc"], on["loss"], off["loss"])):
        print(f"  {i + 1}: {a1:.4f} / {a0:.4f}; {l1:.6f} / {l0:.6f} (rel {abs(l1 - l0) / abs(l0):.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
