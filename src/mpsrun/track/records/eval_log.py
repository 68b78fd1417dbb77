"""The MLflow side of `mpsrun eval`: find a logged model and its training run, load it, log the evaluation.

An evaluation is a run of its own in the training run's experiment, linked to the
model both ways MLflow 3 knows: the LoggedModel is an input of the run, and the
metrics carry the model's id (and the dataset's name and digest), so they show on
the model's page beside the training run's.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsrun.track.records import datasets as track_datasets
from mpsrun.track.records import model_pt2, pyfunc_loader, standard
from mpsrun.track.records.model_log import ARTIFACT


class EvalInputError(Exception):
    """The target is not a run or registered model version with a logged model: exit code 2."""


@dataclass
class Target:
    model_uri: str  # what mlflow.pytorch.load_model takes
    run_id: str  # the training run
    experiment_id: str
    model_id: str | None
    recipe_text: str  # the training run's resolved recipe.yaml
    recipe_path: str | None  # where that recipe was read from when it trained (tag mpsrun.recipe)


def _logged_model_id(run: Any) -> str | None:
    outputs = getattr(run, "outputs", None)
    ids = [o.model_id for o in (outputs.model_outputs if outputs else [])]
    return run.data.tags.get("mpsrun.model_id") or (ids[-1] if ids else None)


def find(c: Any, target: str) -> Target:
    """RUN_ID, runs:/RUN_ID/model or models:/NAME/VERSION -> the model and its training run."""
    model_id = None
    if target.startswith("models:/"):
        parts = target.removeprefix("models:/").split("/")
        if len(parts) != 2 or not all(parts):
            raise EvalInputError(f"'{target}' is not models:/NAME/VERSION")
        name, version = parts
        try:
            mv = c.get_model_version(name, version)
        except Exception:
            names = [m.name for m in c.search_registered_models()]
            hint = f"; registered models: {', '.join(names)}" if names else "; the registry is empty"
            raise EvalInputError(f"no version {version} of registered model '{name}'{hint}") from None
        run_id, model_uri, model_id = mv.run_id, target, getattr(mv, "model_id", None)
    else:
        run_id = target.removeprefix("runs:/").split("/")[0]
        model_uri = f"runs:/{run_id}/{ARTIFACT}"
    try:
        run = c.get_run(run_id)
    except Exception:
        raise EvalInputError(f"no run '{run_id}' in this tracking store (pass a run ID, runs:/ID/model or models:/NAME/VERSION)") from None
    model_id = model_id or _logged_model_id(run)
    if model_id is None:
        raise EvalInputError(f"run {run_id} has no logged model (was it trained with tracking.log_model: false?)")
    with tempfile.TemporaryDirectory() as d:
        try:
            recipe_text = Path(c.download_artifacts(run_id, "recipe.yaml", d)).read_text()
        except Exception:
            raise EvalInputError(f"run {run_id} has no recipe.yaml artifact: it was not made by mpsrun run") from None
    return Target(model_uri, run_id, run.info.experiment_id, model_id, recipe_text, run.data.tags.get("mpsrun.recipe"))


def load(uri: str, model_uri: str, device: Any = "cpu") -> tuple[Any, str]:
    """The logged torch module on `device` (whatever device it was trained on); (module, where it is).

    A pt2 program (the usual format) is moved with `torch.export`'s own pass, since its devices
    are baked in (track/records/pyfunc_loader.py says why); a pickled module (the fallback
    format) is an ordinary module that `.to()` moves.
    """
    import mlflow

    mlflow.set_tracking_uri(uri)
    with tempfile.TemporaryDirectory() as d:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=d))
        pt2 = local / model_pt2.DATA / pyfunc_loader.PT2_FILE
        if pt2.exists():
            pyfunc_loader.validate(str(pt2))
            return pyfunc_loader.load_program(str(pt2), device)
        model = mlflow.pytorch.load_model(str(local), map_location="cpu")
    return model.to(device), str(device)


def log(
    c: Any,
    target: Target,
    run_name: str,
    metrics: dict[str, float],
    tags: dict[str, str],
    dataset_name: str,
    split: track_datasets.Split,
    figures_fn: Any = None,
) -> str:
    """A FINISHED run holding the evaluation, linked to the model; returns its id."""
    from mlflow.entities import DatasetInput, InputTag, LoggedModelInput, Metric

    all_tags = {**standard.source_tags(target.recipe_path), **tags}
    run = c.create_run(target.experiment_id, run_name=run_name, tags=all_tags)
    run_id = run.info.run_id
    try:
        (ds, context), = track_datasets.datasets_for(dataset_name, [split], None, {"mpsrun.evaluated": target.model_uri})
        c.log_inputs(
            run_id,
            datasets=[DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(key="mlflow.data.context", value=context)])],
            models=[LoggedModelInput(target.model_id)] if target.model_id else None,
        )
        ts = int(time.time() * 1000)
        items = [
            Metric(k, float(v), ts, 0, model_id=target.model_id, dataset_name=ds.name, dataset_digest=ds.digest)
            for k, v in metrics.items()
        ]
        c.log_batch(run_id, metrics=items)
        if figures_fn is not None:
            figures_fn(c, run_id)
    except BaseException as e:
        c.set_tag(run_id, "mpsrun.error", f"{type(e).__name__}: {e}"[:4900])
        c.set_terminated(run_id, "FAILED")
        raise
    c.set_terminated(run_id, "FINISHED")
    return run_id
