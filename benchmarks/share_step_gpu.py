"""Several processes replaying the fashion step on one GPU at once (issue 24, item 5): what sharing buys.

A sweep's workers on one GPU each replay graphs of the fashion MLP's step; under NVIDIA MPS their
kernels may run at once. This starts a private MPS daemon (its own pipe and log folders, as
`mpsrun sweep` does), then for each variant of `benchmarks/step_fuse_gpu.py` runs 1 process and then
N at once, each timing its replays only after all N have built their graphs (`--barrier`), and
prints each process's microseconds per step and the steps per second of all of them together
against one alone. Variants: `ce+addcmul` (torch's Linear kernels), `ce+addcmul+mlp:j` (the
shipped fused layers, about 256 programs a forward), `ce+addcmul+mlp:j@P` (about P programs).

    source benchmarks/gpu_setup.sh && python benchmarks/share_step_gpu.py [--procs 1,4] [--variants ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_set(variant: str, n: int, rounds: int, replays: int, env: dict[str, str]) -> list[float]:
    """us per step of each of n processes replaying `variant` at the same time."""
    with tempfile.TemporaryDirectory(prefix="share-") as bar:
        procs = [subprocess.Popen([sys.executable, "benchmarks/step_fuse_gpu.py", "--variants", variant, "--rounds", str(rounds),
                                   "--replays", str(replays), "--barrier", f"{bar}:{n}"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(n)]
        outs = [p.communicate()[0] for p in procs]
    us = []
    for out in outs:
        m = re.search(r"^\| " + re.escape(variant) + r" \| ([0-9.]+) \|", out, re.M)
        if not m:
            sys.exit(f"{variant}: no timing in\n{out[-3000:]}")
        us.append(float(m.group(1)))
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="ce+addcmul,ce+addcmul+mlp:j,ce+addcmul+mlp:j@64,ce+addcmul+mlp:j@16")
    ap.add_argument("--procs", default="1,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--no-mps", action="store_true", help="time-sliced: no MPS daemon")
    a = ap.parse_args()
    env = dict(os.environ)
    work = Path(tempfile.mkdtemp(prefix="share-mps-"))
    mps = not a.no_mps and shutil.which("nvidia-cuda-mps-control") is not None
    if mps:
        env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"] = str(work / "pipe"), str(work / "log")
        for k in ("pipe", "log"):
            (work / k).mkdir()
        mps = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env).returncode == 0
    print(f"sharing: {'NVIDIA MPS (a private daemon)' if mps else 'time-slicing'}\n")
    print("| variant | processes | us/step each | steps/s all together | vs one process |")
    print("| --- | ---: | --- | ---: | ---: |")
    try:
        for v in a.variants.split(","):
            base = None
            for n in (int(x) for x in a.procs.split(",")):
                us = run_set(v, n, a.rounds, a.replays, env)
                rate = sum(1e6 / u for u in us)
                base = base or rate
                print(f"| {v} | {n} | {', '.join(f'{u:.1f}' for u in us)} (median {statistics.median(us):.1f}) | {rate:,.0f} | {rate / base:.2f}x |", flush=True)
    finally:
        if mps:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
