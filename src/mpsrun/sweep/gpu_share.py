"""Whether sweep workers sharing one NVIDIA GPU run their kernels at once or take turns: said before they start.

Why: without NVIDIA's Multi-Process Service (MPS), kernels of different processes never run at once on a
GPU; the driver gives each process's queue the whole GPU in turn (time-slicing). A small model whose step
keeps the GPU busy (the fashion MLP under CUDA graphs: about 75% of the time) then gains little from more
workers. Measured on one H100 (`benchmarks/sweep_share_gpu.sh`, 32 trials of the shipped fashion recipe,
10 epochs each): 4 workers took 0.87x the wall time of one taking turns, 0.68x under MPS. Reading the
driver's files keeps torch out of the launching command's path: no CUDA context is made to ask.
"""

from __future__ import annotations

import os
from typing import Optional

from mpsrun.plugins.nvidia import PROC, visible_gpus


def mps_running() -> bool:
    """An MPS control daemon answers at $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps)."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def note(workers: int, device: str, proc: str = PROC) -> Optional[str]:
    """The note for `workers` sharing the recipe's `device`, or None when each has its own GPU (or uses none)."""
    if workers <= 1 or device not in ("auto", "cuda") and not device.startswith("cuda:"):
        return None
    n = visible_gpus(proc)
    if not n:
        return None  # no NVIDIA GPU here
    per = -(-workers // n) if device in ("auto", "cuda") else workers  # worker i takes cuda:(i % n); a pinned device: all on it
    if per <= 1:
        return None  # a GPU each
    who = f"{workers} workers share one GPU" if per == workers else f"{workers} workers on {n} GPUs: up to {per} share each"
    if mps_running():
        return f"{who} through NVIDIA MPS: their kernels run at once"
    return (f"{who} and take turns on it (time-slicing: kernels of different processes never run at once); "
            "NVIDIA MPS lets them (`nvidia-cuda-mps-control -d` before the sweep; README, Sweeps)")
