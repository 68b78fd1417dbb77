"""Where a trial's time goes, phase by phase: `MPSRUN_SWEEP_TRACE=1 mpsrun sweep ...`.

Why: on one GPU, N workers gain only by overlapping each trial's CPU work (model, optimizer,
child run, records) with the other workers' GPU epochs; which phase dominates decides what to
fix, and the GPU machine is measured rarely. With the variable set, every worker writes one line
per trial to stderr (`sweep-trace worker=W trial=N ask=... data=... ...`, seconds) and one
`sweep-trace-total` line when it ends; `benchmarks/sweep_bench.py --trace` averages them.

Phases, in order: `ask` (lost trials reaped, the budget read, a trial asked for), `data` (the
worker's dataset cache), `prepare` (device, model, optimizer, batch plan), `open` (the child run
started, its params, tags and dataset inputs handed over, the device canary), `train` (the
epochs, from the first step to the last epoch's end), `close` (summary, records, the run
finished in MLflow), `tell` (the study told, the run's state tag), `release` (device memory
given back), `report` (handing the trial's end to the line on screen). `wait` is the part of
all of them spent waiting for the MLflow helper's answers; `canary` the part of `open` the device
canary took.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "MPSRUN_SWEEP_TRACE"
PHASES = ("ask", "data", "prepare", "open", "train", "close", "tell", "release", "report")


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


class Phases:
    """Lap times of one trial; `lap(name)` charges the time since the previous lap to `name`."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.start = self.t
        self.s: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name] = self.s.get(name, 0.0) + now - self.t
        self.t = now

    def add(self, name: str, seconds: float) -> None:
        self.s[name] = self.s.get(name, 0.0) + seconds

    def line(self, worker: int, number: int) -> str:
        parts = " ".join(f"{k}={self.s[k]:.3f}" for k in (*PHASES, "wait", "canary") if k in self.s)
        # `at`: the wall clock at the trial's end, so a benchmark can lay the workers' trials on one timeline
        return f"sweep-trace worker={worker} trial={number} {parts} total={time.perf_counter() - self.start:.3f} at={time.time():.3f}"


class Totals:
    """A worker's sums over its trials, written when it ends."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.trials = 0
        self.s: dict[str, float] = {}
        self.t0 = time.perf_counter()

    def add(self, p: Phases, number: int) -> None:
        self.trials += 1
        for k, v in p.s.items():
            self.s[k] = self.s.get(k, 0.0) + v
        emit(p.line(self.worker, number))

    def emit(self, ready_s: float, start: dict[str, float] | None = None) -> None:
        """`ready`: the worker module's import to its first ask; `start_*`: its laps (imports, data, warm, study)."""
        parts = " ".join(f"{k}={v:.3f}" for k, v in self.s.items())
        laps = "".join(f" start_{k}={v:.3f}" for k, v in (start or {}).items())
        emit(f"sweep-trace-total worker={self.worker} trials={self.trials} ready={ready_s:.3f}{laps} {parts} "
             f"loop={time.perf_counter() - self.t0:.3f} at={time.time():.3f}")


def mark(what: str) -> None:
    """A moment of the launching command (workers ended, results published, ...) on the wall clock, when tracing."""
    if enabled():
        emit(f"sweep-trace-mark what={what} at={time.time():.3f}")


def emit(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
