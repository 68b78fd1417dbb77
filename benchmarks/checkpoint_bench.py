"""What do end-of-epoch checkpoints cost? Steady epoch time with `checkpoint.every` 0 and 1.

The checkpoint is copied to the host on the training thread (`checkpoint_copy_s` in the run's mpsrun_timings.json)
and written and uploaded by a background thread (`checkpoint_time_s`); this
script trains the same recipe both ways, interleaved, and prints a Markdown table.

    python benchmarks/checkpoint_bench.py --device cpu  [--repeats 3] [--epochs 6]
    python benchmarks/checkpoint_bench.py --device cuda --out "$OUT"

Runs unattended (a temporary SQLite store, synthetic data: no downloads).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import textwrap
from pathlib import Path
from mpsrun.track.records.names import from_mlflow  # system/steady_epoch_time_s -> steady_epoch_time_s; final_val_* from val_*

RECIPE = """\
device: {device}
epochs: {epochs}
batch_size: {batch}
seed: 0
dataset: {{name: synthetic, train_size: {n}, val_size: 2000}}
model: {{name: mlp, hidden: [1024, 1024]}}
optimizer: {{name: adam, lr: 0.001}}
model_from: last
tracking: {{experiment: ckpt_bench, log_model: false}}
"""



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

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--n", type=int, default=20000, help="training samples")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    from mlflow.tracking import MlflowClient

    from mpsrun.plugins import resolve
    from mpsrun.train import runner

    d = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    recipe = d / "r.yaml"
    recipe.write_text(RECIPE.format(device=a.device, epochs=a.epochs, batch=a.batch, n=a.n))
    uri = f"sqlite:///{d / 'mlflow.db'}"
    c = MlflowClient(uri)
    rows: dict[int, list[dict[str, float]]] = {0: [], 1: []}
    for _ in range(a.repeats):
        for every in (0, 1):
            resolved = resolve(recipe, [f"checkpoint.every={every}"])
            t = time.perf_counter()
            s = runner.run(resolved, uri)
            wall = time.perf_counter() - t
            m = {**from_mlflow(c.get_run(s.run.run_id).data.metrics), **_timings(c, s.run.run_id)}
            rows[every].append(
                {
                    "wall": wall,
                    "steady": m["steady_epoch_time_s"],
                    "copy": m.get("mpsrun/checkpoint_total_copy_s", 0.0) / a.epochs,
                    "write": m.get("mpsrun/checkpoint_total_time_s", 0.0) / a.epochs,
                }
            )
    device = str(s.setup.choice.device)
    med = {e: {k: statistics.median(r[k] for r in rows[e]) for k in ("wall", "steady", "copy", "write")} for e in rows}
    params = sum(p.numel() for p in s.setup.model.parameters())
    table = textwrap.dedent(
        f"""\
        Checkpoint cost on {device}: MLP 784-1024-1024-10 ({params / 1e6:.2f} M parameters, Adam: checkpoint
        {params * 12 / 2**20:.0f} MiB), synthetic {a.n} samples, batch {a.batch}, {a.epochs} epochs, medians of {a.repeats}.

        The steady epoch time is the engine's (train + validate); the host copy runs after it, at the
        epoch end, and shows in the run's wall time (set-up, MLflow and data included).

        | checkpoint.every | run wall time (s) | steady epoch (s) | host copy per epoch, training thread (s) | write + upload per epoch, background (s) |
        | --- | --- | --- | --- | --- |
        | 0 (off) | {med[0]['wall']:.3f} | {med[0]['steady']:.4f} | - | - |
        | 1 | {med[1]['wall']:.3f} | {med[1]['steady']:.4f} | {med[1]['copy']:.4f} | {med[1]['write']:.4f} |
        """
    )
    print(table)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"checkpoint_bench_{a.device.replace(':', '')}.md").write_text(table)


if __name__ == "__main__":
    main()
