"""Where a run's metrics sit in MLflow: the user's training metrics unprefixed, mpsrun's measurements under `system/`.

MLflow 3.17's run page draws one chart per metric, sorted by name (code-point order), and on its
"Model metrics" tab puts every `prefix/` section before the unprefixed one; only `system/` goes
elsewhere, to the "System metrics" tab (checked in headless Chromium: tests/test_ui_browser.py).
So `epoch_time_s`, `first_epoch_time_s`, `memory_bytes`, `final_val_loss` ... unprefixed sorted
before `train_loss` and `val_loss`, and a `timing/` section would have come first of all. mpsrun's
per-epoch and per-run measurements of the machine (times, throughput, memory) are logged as
`system/<name>`, beside MLflow's own CPU and memory samples; the `final_*` summaries are not
logged at all: MLflow's latest value of `val_loss` (and the rest) is the last epoch's, the same
number.

Inside mpsrun (callbacks, early stopping, sweeps' `metric:`, figures, the screen) the names stay
unprefixed: only what goes to, and comes back from, MLflow is renamed here. Pure Python, so the
training process can import it without importing mlflow.
"""

from __future__ import annotations

from collections.abc import Mapping

SYSTEM = "system/"
# per epoch (step = epoch) and per run: the machine's numbers, not the model's
EPOCH_SYSTEM = ("epoch_time_s", "train_time_s", "val_time_s", "train_samples_per_s", "memory_bytes")
RUN_SYSTEM = ("first_epoch_time_s", "steady_epoch_time_s", "total_train_time_s", "steady_train_samples_per_s", "peak_memory_bytes")
FINAL = "final_"  # TrainResult.summary()'s last-epoch copies: the screen and the run's description use them


def to_mlflow(metrics: Mapping[str, float]) -> dict[str, float]:
    """An epoch's metrics or a run's summary under the keys MLflow gets; `final_*` copies dropped."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k.startswith(FINAL) and k.removeprefix(FINAL).startswith("val_"):
            continue
        out[SYSTEM + k if k in EPOCH_SYSTEM or k in RUN_SYSTEM else k] = v
    return out


def from_mlflow(metrics: Mapping[str, float]) -> dict[str, float]:
    """A run's latest metrics under mpsrun's own names, for runs logged before this layout too.

    `system/epoch_time_s` reads as `epoch_time_s`, and each `val_*` also as `final_val_*` (the
    latest is the last epoch's); keys a run logged under the old names are kept as they are.
    """
    out = dict(metrics)
    for k in (*EPOCH_SYSTEM, *RUN_SYSTEM):
        if SYSTEM + k in metrics:
            out[k] = metrics[SYSTEM + k]
    for k, v in metrics.items():
        if k.startswith("val_"):
            out.setdefault(FINAL + k, v)
    return out


def param_value(v: object) -> str:
    """A param's value as mpsrun writes it to MLflow: None as `null`, booleans as YAML writes them, cut to MLflow's
    6000 characters (the store's runs and a fused sweep's member runs, track/apart.py, alike)."""
    s = "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return s[:6000]
