"""`mpsrun bench --parallel N`: up to N matrix cells at once, each a process of its own.

Why processes: a cell is a whole `runner.prepare` + `runner.execute` (its own CUDA
context, its own memory peak, its own failure), and a process is the unit the OS and
the GPU driver keep apart. On a machine with GPUs each running cell gets one GPU
through CUDA_VISIBLE_DEVICES (slot k -> GPU k), so `device: cuda` in a cell means
"this cell's GPU"; on the CPU the cells share the cores (each child's torch threads
are cores / N unless OMP_NUM_THREADS is set). Every cell stays a child run of the
bench's parent run, exactly as in the one-at-a-time bench, and the table is rebuilt
from MLflow the same way.

Cells running side by side share the machine (PCIe, host CPU, memory bandwidth):
the parent run records `bench.parallel` and the CLI says so, so a speed figure is
never read as if its cell had the machine alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mpsrun.bench import matrix_run
from mpsrun.recipe import matrix
from mpsrun.track.store import client as tracking


@dataclass
class Slot:
    index: int
    gpu: int | None  # CUDA_VISIBLE_DEVICES for the cell in this slot; None on the CPU


def slots(n: int, cells: list[matrix.Cell]) -> tuple[list[Slot], list[str]]:
    """N slots, one GPU each where cells ask for CUDA and GPUs exist; notes to show and record."""
    import torch

    wants_gpu = any(c.resolved.recipe.device.split(":")[0] in ("cuda", "auto") for c in cells)
    gpus = torch.cuda.device_count() if wants_gpu and torch.cuda.is_available() else 0
    notes = []
    if gpus:
        if n > gpus:
            notes.append(f"--parallel {n}: this machine has {gpus} GPU(s); running {gpus} cells at once, one per GPU")
            n = gpus
        return [Slot(i, i) for i in range(n)], notes
    notes.append(f"--parallel {n}: cells share this machine's {os.cpu_count()} CPU cores; timings are of cells running side by side")
    return [Slot(i, None) for i in range(n)], notes


def cells_runner(n: int, notes: list[str]) -> Callable[..., None]:
    """What `matrix_run.run` calls instead of its one-at-a-time loop."""

    def run_cells(p: matrix_run.Plan, parent: tracking.RunInfo, tracking_uri: str | None, uri: str, artifact_root: str | None, listener: matrix_run.BenchListener) -> None:
        run_all(p, parent, uri, listener, n, notes)

    return run_cells


def _env(slot: Slot, width: int) -> dict[str, str]:
    env = dict(os.environ)
    if slot.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu) if "CUDA_VISIBLE_DEVICES" not in os.environ else os.environ["CUDA_VISIBLE_DEVICES"].split(",")[slot.gpu]
    elif "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // width))
    return env


def run_all(p: matrix_run.Plan, parent: tracking.RunInfo, uri: str, listener: matrix_run.BenchListener, n: int, notes: list[str]) -> None:
    """Every (repeat, cell) in the bench's order, at most len(slots) at a time; blocks until all ended."""
    free, more = slots(n, p.cells)
    notes.extend(more)
    jobs = [(repeat, cell) for repeat in range(p.repeats) for cell in p.cells]
    running: dict[int, tuple[subprocess.Popen, Slot, int, int, matrix.Cell, Path]] = {}
    width = len(free)
    tmp = Path(tempfile.mkdtemp(prefix="mpsrun-bench-"))
    started = 0
    try:
        while jobs or running:
            while jobs and free:
                repeat, cell = jobs.pop(0)
                slot = free.pop(0)
                started += 1
                listener.on_cell_start(started, p.total, cell, repeat)
                result = tmp / f"cell{started}.json"
                spec = {
                    "recipe": str(p.resolved.path), "overrides": list(p.resolved.overrides), "cell": cell.index,
                    "repeat": repeat, "n": started, "parent": parent.run_id, "experiment_id": parent.experiment_id,
                    "experiment": parent.experiment, "uri": uri, "result": str(result),
                }
                proc = subprocess.Popen(
                    [sys.executable, "-m", "mpsrun.bench.parallel", json.dumps(spec)],
                    env=_env(slot, width), stdout=subprocess.DEVNULL, stderr=open(tmp / f"cell{started}.err", "w"),
                )
                running[proc.pid] = (proc, slot, started, repeat, cell, result)
            time.sleep(0.2)
            for pid, (proc, slot, k, repeat, cell, result) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[pid]
                free.append(slot)
                free.sort(key=lambda s: s.index)
                ok, message = _outcome(proc.returncode, result, tmp / f"cell{k}.err")
                listener.on_cell_end(k, p.total, cell, repeat, ok, message)
    except KeyboardInterrupt:
        for proc, *_ in running.values():
            proc.send_signal(2)  # SIGINT: each cell marks its own run KILLED
        for proc, *_ in running.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise


def _outcome(code: int, result: Path, errlog: Path) -> tuple[bool, str]:
    try:
        data = json.loads(result.read_text())
        return bool(data["ok"]), str(data["message"])
    except (OSError, ValueError, KeyError):
        tail = errlog.read_text(errors="replace").strip().splitlines()[-3:] if errlog.exists() else []
        return False, f"cell process exited with code {code}: {' | '.join(tail) or 'no output'}"


# ----------------------------------------------------------------------------- the child


class _Capture(matrix_run.BenchListener):
    def __init__(self) -> None:
        self.ok, self.message = False, "did not finish"

    def on_cell_end(self, n: int, total: int, cell: matrix.Cell, repeat: int, ok: bool, message: str) -> None:
        self.ok, self.message = ok, message


def child(spec: dict[str, Any]) -> int:
    """One cell, as `_run_cell` runs it in the one-at-a-time bench; the outcome goes to spec['result']."""
    from mpsrun.plugins import resolve

    resolved = resolve(Path(spec["recipe"]), spec["overrides"])
    p = matrix_run.plan(resolved)
    cell = next(c for c in p.cells if c.index == spec["cell"])
    parent = tracking.RunInfo(spec["parent"], spec["experiment_id"], spec["experiment"], spec["uri"])
    cap = _Capture()
    try:
        matrix_run._run_cell(p, cell, spec["repeat"], spec["n"], parent, spec["uri"], spec["uri"], None, cap)
    except KeyboardInterrupt:
        cap.ok, cap.message = False, "interrupted"
        return 130
    finally:
        Path(spec["result"]).write_text(json.dumps({"ok": cap.ok, "message": cap.message}))
    return 0


if __name__ == "__main__":
    sys.exit(child(json.loads(sys.argv[1])))
