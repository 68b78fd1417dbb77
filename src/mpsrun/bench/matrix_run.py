"""`mpsrun bench`: every cell of a recipe's matrix as a child run of one MLflow run.

Cells run one at a time, in this process, through the same `runner.prepare` and
`runner.execute` as `mpsrun run`, so a bench cell is timed exactly like a single
run. Repeats are interleaved (all cells once, then all cells again) so that slow
drift, such as a laptop heating up and throttling, spreads over every cell
instead of penalising the last ones. A cell that fails (unusable device, out of
memory, an operation the device lacks, any exception) becomes a FAILED child run
holding its error, and the bench goes on; the memory it held is released first.
"""

from __future__ import annotations

import gc
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpsrun.bench import compare
from mpsrun.devices import sysinfo
from mpsrun.recipe import matrix
from mpsrun.recipe.load import Resolved, flatten
from mpsrun.track.store import client as tracking
from mpsrun.train import runner
from mpsrun.train.loop.engine import Listener
from mpsrun.train.progress import quality

DEVICE_TYPES = ("cpu", "mps", "cuda")


class BenchInputError(Exception):
    """Bad bench options (e.g. a baseline no cell runs on): exit code 2, nothing run."""


class BenchListener:
    """What the CLI hears about the cells; bench itself never prints."""

    def on_cell_start(self, n: int, total: int, cell: matrix.Cell, repeat: int) -> Listener | None:
        """Returns the engine listener for this cell's epochs (or None)."""
        return None

    def on_cell_end(self, n: int, total: int, cell: matrix.Cell, repeat: int, ok: bool, message: str) -> None: ...


@dataclass
class Plan:
    """A validated bench: its cells, repeats and baseline, before anything runs."""

    resolved: Resolved
    cells: list[matrix.Cell]
    repeats: int
    baseline: str | None
    experiment: str
    notes: list[str] = field(default_factory=list)

    @property
    def axes(self) -> list[str]:
        return matrix.axes_of(self.resolved.recipe)

    @property
    def total(self) -> int:
        return len(self.cells) * self.repeats


def plan(resolved: Resolved, baseline: str | None = None) -> Plan:
    """Expand and validate every cell; choose the baseline (cpu when cells run there).

    Raises RecipeError (a bad cell value, located) or BenchInputError.
    """
    cells = matrix.expand(resolved)
    recipe = resolved.recipe
    asked = [c.resolved.recipe.device.split(":")[0] for c in cells]
    kinds = sorted(set(asked))
    if baseline is None:
        chosen = "cpu" if "cpu" in kinds and len(kinds) > 1 else None
    elif baseline == "none":
        chosen = None
    elif baseline not in DEVICE_TYPES:
        raise BenchInputError(f"--baseline must be cpu, mps, cuda or none, not '{baseline}'")
    elif baseline not in kinds and "auto" not in kinds:
        raise BenchInputError(f"--baseline {baseline}: no cell runs on {baseline} (cells ask for {', '.join(kinds)})")
    else:
        chosen = baseline
    notes = []
    file_axes = _file_axes(resolved)
    pinned = []
    for text in resolved.overrides:
        key = text.partition("=")[0].strip()
        if key in file_axes and key not in pinned:
            pinned.append(key)
    if pinned:
        notes.append("pinned by override: " + ", ".join(f"{a}={matrix.fmt_value(_get(resolved.source.data, a))}" for a in pinned))
    experiment = recipe.tracking.experiment or resolved.path.stem
    return Plan(resolved, cells, recipe.repeats, chosen, experiment, notes)


def _file_axes(resolved: Resolved) -> list[str]:
    """Axes the recipe file declares (before command-line pins)."""
    from mpsrun.recipe.load import load_source

    try:
        raw = load_source(resolved.path).data.get("matrix")
    except Exception:  # noqa: BLE001 - only used for a note
        return []
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and str(k) not in matrix.SPECIAL:
                walk(v, key + ".")
            elif str(k) not in matrix.SPECIAL:
                out.append(key)

    if isinstance(raw, dict):
        walk(raw, "")
    return out


def _get(data: dict, dotted: str) -> Any:
    node: Any = data
    for k in dotted.split("."):
        node = node.get(k) if isinstance(node, dict) else None
    return node


def machine_tags() -> dict[str, str]:
    """What this machine is (cpu.*, mps.*, cuda.*, sw.*), without claiming a device ran."""
    return {k: v for k, v in sysinfo.run_tags("cpu").items() if not k.startswith("device.")}


@dataclass
class Result:
    parent: tracking.RunInfo
    table: compare.Table
    files: dict[str, Path]

    @property
    def failed(self) -> int:
        return self.table.failed


def run(p: Plan, tracking_uri: str | None, listener: BenchListener | None = None, out: Path | None = None, cells_runner: Any = None, parallel: int = 1) -> Result:
    """Run every cell and repeat under one parent run; log the table, CSV, Markdown and chart on it.

    `cells_runner` (bench.parallel's) replaces the one-at-a-time loop: same cells, same child runs.
    """
    listener = listener or BenchListener()
    r = p.resolved
    uri, artifact_root = tracking.resolve_uri(tracking_uri)
    parent = tracking.Tracker(uri, p.experiment, artifact_root)
    tags = {
        **machine_tags(),
        "mpsrun.bench": "parent",
        "mpsrun.recipe": str(r.path),
        "mpsrun.overrides": " ".join(r.overrides),
        "bench.recipe": str(r.path),
        "bench.axes": json.dumps(p.axes),
        "bench.cells": str(len(p.cells)),
        "bench.repeats": str(p.repeats),
        "bench.baseline": p.baseline or "none",
        "bench.parallel": str(parallel),  # cells running side by side share the machine
        **r.recipe.tracking.tags,
    }
    info = parent.start(r.recipe.tracking.run_name or f"bench {r.path.stem}", tags)
    try:
        parent.log_params(flatten(r.as_dict()))
        parent.log_text(r.as_yaml(), "recipe.yaml")
        plan_doc = {"axes": p.axes, "repeats": p.repeats, "cells": [{"index": c.index, "values": c.values, "run": c.assignments()} for c in p.cells]}
        parent.log_text(json.dumps(plan_doc, indent=2, default=str), "plan.json")
        n = 0
        if cells_runner is not None:
            cells_runner(p, info, tracking_uri, uri, artifact_root, listener)
        for repeat in range(p.repeats if cells_runner is None else 0):
            for cell in p.cells:
                n += 1
                _run_cell(p, cell, repeat, n, info, tracking_uri, uri, artifact_root, listener)
        table = compare.load(uri, info.run_id, None)
        files = _log_results(parent, table, out)
        parent.set_tags({"bench.cells_failed": str(table.failed), "bench.cells_ok": str(len(table.rows) - table.failed)})
    except KeyboardInterrupt:
        try:  # table what finished: the interrupted cell is KILLED, the ones never started "not run"
            _log_results(parent, compare.load(uri, info.run_id, None), out)
        except Exception:  # noqa: BLE001 - the runs themselves are recorded; `mpsrun compare` can retry
            pass
        parent.finish("KILLED")
        raise
    except Exception as e:
        parent.finish("FAILED", e)
        raise
    parent.finish("FINISHED")
    return Result(info, table, files)


def _run_cell(
    p: Plan, cell: matrix.Cell, repeat: int, n: int, parent: tracking.RunInfo,
    tracking_uri: str | None, uri: str, artifact_root: str | None, listener: BenchListener,
) -> None:
    tags = {
        "mpsrun.bench": "child",
        "bench.parent": parent.run_id,
        "bench.cell": json.dumps(cell.values, default=str),
        "bench.cell_index": str(cell.index),
        "bench.repeat": str(repeat),
    }
    engine_listener = listener.on_cell_start(n, p.total, cell, repeat)
    if "checkpoint" not in cell.resolved.source.data:  # timing cells: no checkpoints unless the recipe asks
        cell.resolved.recipe.checkpoint.every = 0
    setup = None
    try:
        try:
            setup = runner.prepare(cell.resolved)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # unusable device, missing data, out of memory while moving the model...
            _record_failed(p, cell, tags, parent, uri, artifact_root, e)
            listener.on_cell_end(n, p.total, cell, repeat, False, _message(e))
            return
        try:
            summary = runner.execute(setup, tracking_uri, engine_listener, parent_run_id=parent.run_id, tags=tags)
        except runner.RunFailed as e:  # the child run is already FAILED with its error and traceback
            listener.on_cell_end(n, p.total, cell, repeat, False, str(e))
            return
        except Exception as e:  # failed before its MLflow run existed: record one, go on
            _record_failed(p, cell, tags, parent, uri, artifact_root, e)
            listener.on_cell_end(n, p.total, cell, repeat, False, _message(e))
            return
        s = summary.result.summary()
        listener.on_cell_end(
            n, p.total, cell, repeat, True,
            f"steady epoch {s['steady_epoch_time_s']:.3f} s  {s['steady_train_samples_per_s']:,.0f} samples/s  "
            f"{quality(summary.result.epochs[-1])}  on {setup.choice.device}",  # val_acc, or val_r2 and val_mae
        )
        del summary
    finally:
        device = setup.choice.device.type if setup is not None else None
        del setup
        release(device)


def _message(e: BaseException) -> str:
    return str(e) if isinstance(e, runner.InputError) else f"{type(e).__name__}: {e}"


def _record_failed(
    p: Plan, cell: matrix.Cell, tags: dict[str, str], parent: tracking.RunInfo, uri: str, artifact_root: str | None, error: BaseException
) -> None:
    """A child run for a cell that failed before training could start, with its error."""
    r = cell.resolved
    t = tracking.Tracker(uri, p.experiment, artifact_root)
    run_tags = {
        **machine_tags(),
        "device.requested": r.recipe.device,
        "device.actual": "none",
        "mpsrun.recipe": str(r.path),
        "mpsrun.overrides": " ".join(r.overrides),
        **r.recipe.tracking.tags,
        **tags,
    }
    t.start(r.recipe.tracking.run_name, run_tags, parent.run_id)
    try:
        t.log_params(flatten(r.as_dict()))
        t.log_text(r.as_yaml(), "recipe.yaml")
    finally:
        t.finish("FAILED", error)


def release(device_type: str | None) -> None:
    """Give back what a finished or failed cell held, so the next cell starts clean (an OOM must not cascade)."""
    gc.collect()
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif device_type == "mps":
        try:
            torch.mps.empty_cache()
        except Exception:  # noqa: BLE001 - older torch or no MPS
            pass


def _log_results(parent: tracking.Tracker, table: compare.Table, out: Path | None) -> dict[str, Path]:
    with tempfile.TemporaryDirectory() as d:
        files = compare.write(table, Path(d))
        for f in files.values():
            parent.log_file(f)
    if out is not None:
        return compare.write(table, out)
    return {}
