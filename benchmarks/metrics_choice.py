"""Why train/loop/metrics.py is hand-written: torchmetrics against it, measured.

Prints, for a validation pass of batch-64 updates: import time, time per update
(classification accuracy + top-5; regression MAE + MSE + R^2) and whether each
side's update keeps Python-side state a CUDA graph replay would not re-run.

    PYTHONPATH=/path/to/torchmetrics python benchmarks/metrics_choice.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch


def import_time(stmt: str) -> float:
    code = f"import time, torch; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def timed(fn, n: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    for _ in range(10):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, default=2000)
    a = p.parse_args()
    dev = torch.device(a.device)
    import torchmetrics
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, R2Score

    from mpsrun.train.loop.metrics import MetricSet

    logits, y = torch.randn(64, 100, device=dev), torch.randint(0, 100, (64,), device=dev)
    out, t = torch.randn(64, device=dev), torch.randn(64, device=dev)
    ours_c = MetricSet("classification", dev, num_classes=100)
    ours_r = MetricSet("regression", dev)
    tm_c = [MulticlassAccuracy(100, average="micro", validate_args=False).to(dev), MulticlassAccuracy(100, top_k=5, average="micro", validate_args=False).to(dev)]
    tm_r = [MeanAbsoluteError().to(dev), MeanSquaredError().to(dev), R2Score().to(dev)]
    rows = [
        ("import", f"{import_time('import torchmetrics') * 1e3:.0f} ms", f"{import_time('import mpsrun.train.loop.metrics') * 1e3:.0f} ms"),
        ("classification update (acc + top-5)", f"{timed(lambda: [m.update(logits, y) for m in tm_c], a.n, dev):.1f} us", f"{timed(lambda: ours_c.update(logits, y), a.n, dev):.1f} us"),
        ("regression update (mae + mse + r2)", f"{timed(lambda: [m.update(out, t) for m in tm_r], a.n, dev):.1f} us", f"{timed(lambda: ours_r.update(out, t), a.n, dev):.1f} us"),
        ("Python state per update (lost in graph replay)", "_update_count, _computed", "none"),
    ]
    print(f"device {dev}, torch {torch.__version__}, torchmetrics {torchmetrics.__version__}\n")
    print("| | torchmetrics | mpsrun.train.loop.metrics |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


if __name__ == "__main__":
    main()
