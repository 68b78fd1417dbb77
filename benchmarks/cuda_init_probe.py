"""Does starting CUDA on a thread overlap with a run's other start-up work? (issue 27 start-up, issue 25 decoding)

Each round is a fresh process: `import torch`, then the CUDA context (`torch.cuda.init()` and a
first tensor) and the run's other imports (mlflow, pydantic) either one after the other or with
CUDA on a thread; a pure-Python counter on the main thread during CUDA's start says whether it
holds the GIL. Prints seconds per phase, medians over rounds.

    python benchmarks/cuda_init_probe.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
mode = sys.argv[1]
def cuda():
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
out = {"import_torch": t1 - t0}
if mode == "gil":  # a counter on the main thread while CUDA starts on another; against the same loop alone
    done = threading.Event()
    th = threading.Thread(target=lambda: (cuda(), done.set()))
    s = time.perf_counter(); th.start(); n = 0
    while not done.is_set():
        n += 1
    took = time.perf_counter() - s
    s = time.perf_counter(); m = 0
    while time.perf_counter() - s < took:
        m += 1
    out.update(cuda=took, main_thread_share=n / max(m, 1))
elif mode == "serial":
    s = time.perf_counter(); cuda(); out["cuda"] = time.perf_counter() - s
    s = time.perf_counter(); import mlflow, pydantic; out["imports"] = time.perf_counter() - s
else:
    s = time.perf_counter()
    th = threading.Thread(target=cuda); th.start()
    import mlflow, pydantic
    out["imports"] = time.perf_counter() - s
    th.join()
out["total"] = time.perf_counter() - t0
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {"serial": [], "thread": [], "gil": []}
    for _ in range(a.rounds):
        for mode in got:
            p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True)
            if p.returncode:
                print(p.stderr[-2000:])
                return 1
            got[mode].append(json.loads(p.stdout.strip().splitlines()[-1]))
    for mode, rows in got.items():
        keys = rows[0].keys()
        print(f"{mode:7s} " + "  ".join(f"{k} {statistics.median(r[k] for r in rows):.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
