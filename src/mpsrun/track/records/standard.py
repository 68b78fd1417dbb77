"""MLflow's own conventions, so its UI shows an mpsrun run the way it shows an autologged one.

The UI reads a handful of reserved tags: `mlflow.experimentKind` picks the
experiment's view (without it MLflow 3 opens the GenAI view, traces and all),
`mlflow.user` is "Created by", `mlflow.source.*` is "Source", `mlflow.note.content`
is the run's description. MLflow sets these itself only for fluent `mlflow.start_run`
calls from a script; the runner uses the client API, so it sets them here.
"""

from __future__ import annotations

import getpass
import os
import re
import secrets
import subprocess
from pathlib import Path
from typing import Any

EXPERIMENT_KIND = "custom_model_development"
# mpsrun's own bookkeeping (what logging, figures, the model and checkpoints cost, the best
# epoch) is one JSON artifact, not metrics: MLflow's UI draws a chart per metric and puts
# every "prefix/" section before the unprefixed "Model metrics" one, so bookkeeping metrics
# (they were `mpsrun/...`) opened a run's charts ahead of its losses.
TIMINGS_FILE = "mpsrun_timings.json"


def mark_experiment(c: Any, experiment_id: str) -> None:
    """Tag the experiment as model training (idempotent; MLflow's UI then opens its training view)."""
    exp = c.get_experiment(experiment_id)
    if exp.tags.get("mlflow.experimentKind") != EXPERIMENT_KIND:
        c.set_experiment_tag(experiment_id, "mlflow.experimentKind", EXPERIMENT_KIND)


def run_name(model: str, dataset: str, device: str) -> str:
    """`<model>-<dataset>-<device>-<suffix>`: says what ran; the suffix tells repeats apart."""
    clean = [str(p).replace(":", "").replace("/", "_").replace(" ", "_") for p in (model, dataset, device)]
    return "-".join(clean + [secrets.token_hex(2)])


def _git(folder: Path, *args: str) -> str | None:
    """`git -C folder ARGS`'s output, or None outside a checkout (or without git)."""
    try:
        p = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _git_commit(folder: Path) -> str | None:
    """HEAD of the git checkout holding `folder`, or None outside one (or without git)."""
    sha = _git(folder, "rev-parse", "HEAD")
    return sha if sha and len(sha) == 40 else None


def _without_credentials(url: str) -> str:
    """https://user:token@host/x.git -> https://host/x.git (as MLflow strips them from its own tag)."""
    return re.sub(r"^([a-z+]+://)[^/@]+@", r"\1", url)


def git_tags(path: Path) -> dict[str, str]:
    """The git state of the checkout holding `path` (a recipe): commit, branch, remote, and whether
    the file differs from that commit (`mpsrun.source.git.dirty`); {} outside a checkout."""
    sha = _git_commit(path.parent)
    if not sha:
        return {}
    tags = {"mlflow.source.git.commit": sha}
    branch = _git(path.parent, "rev-parse", "--abbrev-ref", "HEAD")
    if branch and branch != "HEAD":
        tags["mlflow.source.git.branch"] = branch
    url = _git(path.parent, "config", "--get", "remote.origin.url")
    if url:
        tags["mlflow.source.git.repoURL"] = _without_credentials(url)
    status = _git(path.parent, "status", "--porcelain", "--", path.name)
    if status is not None:
        tags["mpsrun.source.git.dirty"] = "true" if status else "false"
    return tags


def source_tags(recipe_path: Path | str | None) -> dict[str, str]:
    """`mlflow.user`, `mlflow.source.name/type` and, in a git checkout, the recipe's git state.

    The source is the recipe (what a person would rerun), not the mpsrun script, and the git
    state is the recipe's checkout's, not mpsrun's.
    """
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        user = os.environ.get("USER", "unknown")
    tags = {"mlflow.user": user, "mlflow.source.type": "LOCAL"}
    if recipe_path is not None:
        path = Path(recipe_path).resolve()
        tags["mlflow.source.name"] = str(path)
        tags.update(git_tags(path))
    return tags


SOURCE_KEYS = ("mlflow.user", "mlflow.source.")  # a run's tags that say where it came from (prefixes)


def model_source(c: Any, run_id: str, model_id: str | None) -> None:
    """Give the run's logged model the run's source tags.

    MLflow tags a LoggedModel from the process that logs it: `mlflow.source.name` would be
    mpsrun's MLflow helper module ("Logged from: process.py" in the UI) and the git tags
    mpsrun's own checkout. The model's source is the run's: the recipe and its git state.
    """
    if not model_id:
        return
    run_tags = c.get_run(run_id).data.tags
    mine = {k: v for k, v in run_tags.items() if k.startswith(SOURCE_KEYS) or k == "mpsrun.source.git.dirty"}
    model = c.get_logged_model(model_id)
    for k in model.tags:
        if k.startswith("mlflow.source.git.") and k not in mine:  # the logging process's checkout, not the recipe's
            c.delete_logged_model_tag(model_id, k)
    if mine:
        c.set_logged_model_tags(model_id, mine)


def note(model: str, dataset: str, device: str, epochs: int, summary: dict[str, float], stop_reason: str | None = None) -> str:
    """The run's description (`mlflow.note.content`): the result in a sentence."""
    parts = [f"Trained `{model}` on `{dataset}` on {device} for {epochs} epoch{'s' if epochs != 1 else ''}"]
    if stop_reason:
        parts[0] += f" (stopped early: {stop_reason})"
    results = []
    if "final_val_accuracy" in summary:
        results.append(f"validation accuracy {summary['final_val_accuracy']:.4f}")
    if "final_val_r2" in summary:  # regression: R^2 and the error in the target's own units
        results.append(f"validation R^2 {summary['final_val_r2']:.4f}")
    if "final_val_mae" in summary:
        results.append(f"validation MAE {summary['final_val_mae']:.4g}")
    if "final_val_loss" in summary:
        results.append(f"validation loss {summary['final_val_loss']:.4g}")
    if "steady_epoch_time_s" in summary:
        results.append(f"steady epoch {summary['steady_epoch_time_s']:.3f} s")
    if results:
        parts.append("reaching " + ", ".join(results))
    return ", ".join(parts) + "."


def bookkeeping(values: dict[str, Any]) -> str:
    """mpsrun's own figures as the text of `TIMINGS_FILE` (sorted keys, seconds unrounded)."""
    import json

    return json.dumps(values, indent=2, sort_keys=True, default=str) + "\n"
