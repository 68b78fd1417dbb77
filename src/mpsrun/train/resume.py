"""`mpsrun resume`: from a run id to a recipe and a checkpoint to continue from, or a clear refusal.

Everything comes from the tracking store (the recipe logged on the run, its
`checkpoints/last.pt`), so a run resumes from any folder or machine that reaches
the store. Refusals are bad input (exit 2): an unknown id, no checkpoint, a
finished run without more epochs, a run whose process is still alive.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from mpsrun.recipe.load import Resolved
from mpsrun.track import liveness
from mpsrun.track.runs import RunFiles, experiment_names, get_run
from mpsrun.train import checkpoint as ckpt
from mpsrun.train.continuity import ResumePoint


class ResumeRefused(Exception):
    """Why this run cannot be resumed (exit code 2)."""


@dataclass
class Plan:
    resolved: Resolved
    point: ResumePoint
    experiment: str
    status: str  # the run's status before resuming (INTERRUPTED for a RUNNING run whose process is gone)
    workdir: Path  # the downloaded files; the caller removes it when the run ends


def plan(uri: str, run_id: str, overrides: list[str]) -> Plan:
    """Check the run can go on and fetch what it needs; raises ResumeRefused or RecipeError."""
    from mpsrun.plugins import resolve

    run = get_run(uri, run_id)
    if run is None:
        exps = experiment_names(uri)
        hint = f" (experiments there: {', '.join(exps[:8])}; list runs with `mpsrun runs`)" if exps else " (the store has no experiments)"
        raise ResumeRefused(f"no run '{run_id}' in the tracking store {uri}{hint}")
    status = run.info.status
    tags = run.data.tags
    if status == "RUNNING":
        v = liveness.check(tags)
        if not v.gone:
            raise ResumeRefused(
                f"run {run_id} is still running ({v.reason}); stop it first (Ctrl-C or SIGTERM checkpoints it), "
                "or wait for it to finish"
            )
        status = "INTERRUPTED"
    files = RunFiles(uri, run_id)
    work = Path(tempfile.mkdtemp(prefix=f"mpsrun-resume-{run_id[:8]}-"))
    last = files.download("checkpoints/last.pt", work)
    if last is None:
        why = tags.get("mpsrun.checkpoint", "it stopped before its first checkpoint was written")
        raise ResumeRefused(f"run {run_id} has no checkpoint to resume from (checkpoints/last.pt): {why}")
    recipe_file = files.download("recipe.yaml", work)
    if recipe_file is None:
        raise ResumeRefused(f"run {run_id} has no recipe.yaml artifact: it was not started by `mpsrun run`")
    try:
        state = ckpt.load(last)
    except ValueError as e:
        raise ResumeRefused(str(e)) from None
    resolved = resolve(recipe_file, overrides)
    _place(resolved, tags)
    done = int(state["epoch"]) + 1
    epochs = resolved.recipe.epochs
    if done >= epochs:
        if status == "FINISHED" or not any(o.startswith("epochs=") for o in overrides):
            raise ResumeRefused(
                f"run {run_id} is {status} with all {epochs} epochs trained; pass epochs=N with N > {done} to train more"
            )
        raise ResumeRefused(f"epochs={epochs} is not more than the {done} epochs already trained")
    if status == "FINISHED" and not any(o.startswith("epochs=") for o in overrides):
        raise ResumeRefused(f"run {run_id} is FINISHED; pass epochs=N with N > {done} to train more")
    best = files.download("checkpoints/best.pt", work)
    exp = files.c.get_experiment(run.info.experiment_id).name
    return Plan(resolved, ResumePoint(run_id, state, best, list(overrides)), exp, status, work)


def _place(resolved: Resolved, tags: dict[str, str]) -> None:
    """Paths in the recipe (a CSV beside it) are read relative to where the run's recipe was, when that folder exists."""
    where = tags.get("mpsrun.recipe_dir")
    if where and Path(where).is_dir():
        resolved.source.path = Path(where) / Path(tags.get("mpsrun.recipe", "recipe.yaml")).name
