"""`mpsrun resume`: from a run id to a recipe and a checkpoint to continue from, or a clear refusal.

Everything comes from the tracking store (the recipe logged on the run, its
`checkpoints/last.pt`, or the newest readable of the others when that one is damaged),
so a run resumes from any folder or machine that reaches the store. Refusals are bad
input (exit 2): an unknown id, no readable checkpoint, a finished run without more
epochs, a run whose owner is still alive (track/store/owner.py; the runner claims the
run before it writes to it, so two resumes started together cannot both train).

A data-parallel run (tagged `distributed.world_size`) resumes as a job of that many
ranks (cli/resume.py launches them). The launcher plans in full and leaves the files
it fetched in a folder named by `MPSRUN_RESUME_DIR`; rank 0 plans again from those
files (or downloads them, under torchrun), the other ranks read only the recipe
(`checkpoint=False`) and take the checkpoint from rank 0 once the group is joined
(`distributed.broadcast_object`): one download, and only rank 0's pid is the run's.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mpsrun.recipe.load import Resolved
from mpsrun.track.store import liveness, owner
from mpsrun.track.store.runs import CHECKPOINTS, RunFiles, experiment_names, get_run
from mpsrun.train.keep import checkpoint as ckpt
from mpsrun.train.keep.continuity import ResumePoint


ENV_FILES = "MPSRUN_RESUME_DIR"  # set by the launcher of a multi-rank resume: the files it already fetched
WORLD_TAG = "distributed.world_size"


class ResumeRefused(Exception):
    """Why this run cannot be resumed (exit code 2)."""


@dataclass
class Plan:
    resolved: Resolved
    point: ResumePoint
    experiment: str
    status: str  # the run's status before resuming (INTERRUPTED for a RUNNING run whose process is gone)
    workdir: Path  # the downloaded files; the caller removes it when the run ends
    world_size: int = 1  # the ranks the run last trained on (its `distributed.world_size` tag)


def plan(uri: str, run_id: str, overrides: list[str], checkpoint: bool = True, files_dir: Path | None = None) -> Plan:
    """Check the run can go on and fetch what it needs; raises ResumeRefused or RecipeError.

    `checkpoint=False` (ranks 1.. of a resumed job): the recipe alone, no checks; the
    checkpoint comes from rank 0. `files_dir`: files a launcher already fetched.
    """
    from mpsrun.plugins import resolve

    run = get_run(uri, run_id)
    if run is None:
        exps = experiment_names(uri)
        hint = f" (experiments there: {', '.join(exps[:8])}; list runs with `mpsrun runs`)" if exps else " (the store has no experiments)"
        raise ResumeRefused(f"no run '{run_id}' in the tracking store {uri}{hint}")
    status = run.info.status
    tags = run.data.tags
    top = owner.latest(run.data.params)  # one owner per run: a live one is named and left alone
    if top is not None and checkpoint:
        v = owner.verdict(top, tags, status)
        if v.state == "alive":
            raise ResumeRefused(owner.owned_by(run_id, top, v))
    if status == "RUNNING" and checkpoint:
        v = liveness.check(tags)
        if top is None and not v.gone:  # a run from before owner claims
            raise ResumeRefused(
                f"run {run_id} is still running ({v.reason}); stop it first (Ctrl-C or SIGTERM checkpoints it), "
                "or wait for it to finish"
            )
        status = "INTERRUPTED"
    files = RunFiles(uri, run_id)
    work = Path(tempfile.mkdtemp(prefix=f"mpsrun-resume-{run_id[:8]}-"))
    world = _int(tags.get(WORLD_TAG), 1)
    exp = files.c.get_experiment(run.info.experiment_id).name

    def fetch(name: str) -> Path | None:
        if files_dir is not None and (files_dir / name).is_file():
            return files_dir / name  # the launcher's copy: it removes that folder after the job
        return files.download(name, work)

    recipe_file = fetch("recipe.yaml")
    if recipe_file is None:
        raise ResumeRefused(f"run {run_id} has no recipe.yaml artifact: it was not started by `mpsrun run`")
    if not checkpoint:
        resolved = resolve(recipe_file, overrides)
        _place(resolved, tags)
        return Plan(resolved, ResumePoint(run_id, {}, None, list(overrides), world), exp, status, work, world)
    state, best, source = _newest_readable(run_id, files.names(), fetch, tags)
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
    same_path = status in ("INTERRUPTED", "KILLED", "FINISHED") and all(o.startswith("epochs=") for o in overrides)
    landed = _landed_after(files, run_id, done) if same_path else frozenset()
    point = ResumePoint(run_id, state, best, list(overrides), world, landed, top.generation if top is not None else -1, source)
    return Plan(resolved, point, exp, status, work, world)


def _newest_readable(run_id: str, names: list[str], fetch: Callable[[str], Path | None], tags: dict[str, str]) -> tuple[dict[str, Any], Path | None, str]:
    """The checkpoint to go on from, the best file, and what to say when it is not `last.pt`.

    `last.pt` when it reads; else the newest readable of the others (`prev.pt`, the last
    `last.pt` before it, kept until a new one is written and verified; the per-epoch files;
    `best.pt`), by the epoch inside. Refused only when none reads.
    """
    def read(name: str) -> tuple[dict[str, Any] | None, Path | None, str]:
        path = fetch(f"{CHECKPOINTS}/{name}") if name in names else None
        if path is None:
            return None, None, "missing"
        try:
            return ckpt.load(path), path, ""
        except ValueError as e:
            return None, path, str(e).replace(str(path), f"{CHECKPOINTS}/{name}")
    best_state, best_path, best_why = read(ckpt.BEST)
    state, _, why = read(ckpt.LAST)
    if state is not None:
        return state, best_path if best_state is not None else None, ""
    tried = {ckpt.LAST: why, ckpt.BEST: best_why}
    found: list[tuple[int, int, str, dict[str, Any]]] = []  # (epoch, preference, name, state)
    if best_state is not None:
        found.append((int(best_state["epoch"]), 0, ckpt.BEST, best_state))
    others = [ckpt.PREV] + sorted((n for n in names if n.startswith("epoch-") and n.endswith(".pt")), reverse=True)
    for i, name in enumerate(others):
        got, _, why_other = read(name)
        tried[name] = why_other
        if got is not None:
            found.append((int(got["epoch"]), len(others) - i, name, got))
    if not found:
        if not names or all(w == "missing" for w in tried.values()):
            why = tags.get("mpsrun.checkpoint", "it stopped before its first checkpoint was written")
            raise ResumeRefused(f"run {run_id} has no checkpoint to resume from (checkpoints/last.pt): {why}")
        listed = "; ".join(f"{n}: {w}" for n, w in tried.items() if w != "missing")
        raise ResumeRefused(f"run {run_id} has no readable checkpoint ({listed})")
    epoch, _, name, state = max(found, key=lambda f: (f[0], f[1]))
    lost = f"{CHECKPOINTS}/{ckpt.LAST} is missing" if why == "missing" else why
    source = (f"{lost}; going on from {CHECKPOINTS}/{name}, the newest readable checkpoint (epoch {epoch + 1}, "
              f"MLflow step {epoch}); the epochs after it are trained again along the same trajectory")
    return state, best_path if best_state is not None else None, source


def _landed_after(files: RunFiles, run_id: str, done: int) -> frozenset[int]:
    """Epochs at or after `done` whose per-epoch metrics are already in the run.

    An epoch's metrics are made durable before its checkpoint is written (so a checkpoint
    never runs ahead of its metrics); a stop between the two leaves that epoch's metrics
    in the store and its checkpoint not. The resumed run trains that epoch again along
    the same trajectory and must not log it a second time. Only asked where the path is
    the same: a stopped run resumed without overrides other than `epochs=` (a FAILED run's
    diverged epoch stays as evidence beside its retry, which logs its own figures).
    """
    try:
        # train_loss is logged every epoch, in the same batch as the epoch's other metrics
        # (runs before it carried an `mpsrun/epochs_done` metric at the same steps)
        history = files.c.get_metric_history(run_id, "train_loss")
    except Exception:  # a store that does not answer: log as usual
        return frozenset()
    return frozenset(int(m.step) for m in history if int(m.step) >= done)


def files_from_env() -> Path | None:
    """The folder a resume launcher fetched the run's files into (rank 0 of the job it started)."""
    d = os.environ.get(ENV_FILES)
    return Path(d) if d and Path(d).is_dir() else None


def world_note(recorded: int, chosen: int) -> str | None:
    """What to say when a run resumes on another number of ranks than it trained on."""
    if recorded == chosen:
        return None
    how = f"{chosen} rank{'s' if chosen > 1 else ''}" if chosen > 1 else "one process"
    return (
        f"the run trained on {recorded} rank{'s' if recorded > 1 else ''} (distributed.world_size {recorded}); resuming on {how}. "
        "batch_size stays the global batch, so the trajectory is the same up to float rounding "
        "(a last batch smaller than the rank count is dropped; BatchNorm statistics are per rank)"
    )


def _int(v: str | None, default: int) -> int:
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


def _place(resolved: Resolved, tags: dict[str, str]) -> None:
    """Paths in the recipe (a CSV beside it) are read relative to where the run's recipe was, when that folder exists."""
    where = tags.get("mpsrun.recipe_dir")
    if where and Path(where).is_dir():
        resolved.source.path = Path(where) / Path(tags.get("mpsrun.recipe", "recipe.yaml")).name
