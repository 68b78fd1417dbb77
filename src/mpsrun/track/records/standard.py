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
import secrets
import subprocess
from pathlib import Path
from typing import Any

EXPERIMENT_KIND = "custom_model_development"
# mpsrun's own bookkeeping metrics go under this prefix: the UI groups metrics by the
# part before "/", so they sit in a section apart from the losses.
PREFIX = "mpsrun/"


def mark_experiment(c: Any, experiment_id: str) -> None:
    """Tag the experiment as model training (idempotent; MLflow's UI then opens its training view)."""
    exp = c.get_experiment(experiment_id)
    if exp.tags.get("mlflow.experimentKind") != EXPERIMENT_KIND:
        c.set_experiment_tag(experiment_id, "mlflow.experimentKind", EXPERIMENT_KIND)


def run_name(model: str, dataset: str, device: str) -> str:
    """`<model>-<dataset>-<device>-<suffix>`: says what ran; the suffix tells repeats apart."""
    clean = [str(p).replace(":", "").replace("/", "_").replace(" ", "_") for p in (model, dataset, device)]
    return "-".join(clean + [secrets.token_hex(2)])


def _git_commit(folder: Path) -> str | None:
    """HEAD of the git checkout holding `folder`, or None outside one (or without git)."""
    try:
        p = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = p.stdout.strip()
    return sha if p.returncode == 0 and len(sha) == 40 else None


def source_tags(recipe_path: Path | str | None) -> dict[str, str]:
    """`mlflow.user`, `mlflow.source.name/type` and, in a git checkout, `mlflow.source.git.commit`.

    The source is the recipe (what a person would rerun), not the mpsrun script.
    """
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        user = os.environ.get("USER", "unknown")
    tags = {"mlflow.user": user, "mlflow.source.type": "LOCAL"}
    if recipe_path is not None:
        path = Path(recipe_path).resolve()
        tags["mlflow.source.name"] = str(path)
        sha = _git_commit(path.parent)
        if sha:
            tags["mlflow.source.git.commit"] = sha
    return tags


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


def bookkeeping(metrics: dict[str, float]) -> dict[str, float]:
    """mpsrun's own figures under the `mpsrun/` prefix (user-facing metric names stay as they are)."""
    return {k if k.startswith(PREFIX) else PREFIX + k: v for k, v in metrics.items()}
