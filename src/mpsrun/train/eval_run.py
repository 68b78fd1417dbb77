"""`mpsrun eval`: a logged model on a dataset section, measured and logged as a run linked to the model.

The dataset comes from the training run's own recipe (its `recipe.yaml` artifact),
with dataset overrides on top (`dataset.root=/new/data`, `dataset.val_fraction=0.5`),
so "the same data as in training" needs no arguments and "new data" needs only
the keys that change. The model is loaded the MLflow way (`mlflow.pytorch`), the
way a user outside mpsrun would load it, so eval also proves the logged model works.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from mpsrun.devices import resolve as devices
from mpsrun.plugins import registry as plugins
from mpsrun.plugins import resolve as resolve_recipe
from mpsrun.plugins.components import METRICS
from mpsrun.plugins.contract import DataSplits
from mpsrun.track.records import eval_log
from mpsrun.track.records import figures
from mpsrun.track.records import standard
from mpsrun.track.store import client as tracking
from mpsrun.track.records.datasets import Split
from mpsrun.train.loop.data import raw_tensors
from mpsrun.train.loop.losses import build_loss
from mpsrun.train.loop.metrics import MetricSet, target_units
from mpsrun.train.setup import InputError

SPLITS = {"val": "validation", "test": "test", "train": "training"}
ALLOWED_OVERRIDES = ("dataset.", "batch_size=")


@dataclass
class EvalResult:
    run_id: str
    experiment_id: str
    model_uri: str
    source_run_id: str
    split: str
    samples: int
    device: str
    metrics: dict[str, float] = field(default_factory=dict)


def _check_overrides(overrides: list[str]) -> None:
    bad = [o for o in overrides if not o.startswith(ALLOWED_OVERRIDES)]
    if bad:
        raise InputError(
            f"eval takes dataset overrides (dataset.KEY=VALUE) and batch_size=N; not {', '.join(bad)}"
        )


def _data(recipe: Any, recipe_dir: Path) -> DataSplits:
    from mpsrun.plugins.builtin.datasets import DatasetUnavailable

    try:
        splits = plugins.build("dataset", recipe.dataset.name, recipe.dataset.kwargs, {"seed": recipe.seed, "recipe_dir": str(recipe_dir)})
    except (DatasetUnavailable, plugins.PluginError) as e:
        raise InputError(str(e)) from None
    if not isinstance(splits, DataSplits):
        raise InputError(f"dataset plugin '{recipe.dataset.name}' returned {type(splits).__name__}, not mpsrun.DataSplits")
    return splits


def _batches(ds: Any, batch_size: int) -> Any:
    t = raw_tensors(ds)
    if t is not None:
        x, y = t
        for i in range(0, len(y), batch_size):
            yield x[i : i + batch_size], y[i : i + batch_size]
        return
    yield from torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False)


@torch.no_grad()
def measure(
    model: torch.nn.Module,
    ds: Any,
    batch_size: int,
    device: torch.device,
    splits: DataSplits | None = None,
    loss: dict[str, Any] | None = None,
    extra_metrics: Sequence[str] = (),
) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
    """Loss and the task's metrics over `ds`, as training computes them; (metrics, targets, outputs).

    The task, the loss (the recipe's `loss:` section, {"name": ..., **kwargs}) and the
    metrics are the training run's own (train/loop/losses.py, train/loop/metrics.py), so `eval_loss`
    of the logged model on the same split equals the run's `val_loss` for those weights, and a
    regression run reports `eval_mae`, `eval_rmse`, `eval_r2` in the target's own units (the
    dataset's `target_std`), never an accuracy. Without `splits` the task is read from the data:
    integer targets with one output per class are classification, anything else regression.
    """
    model = model.to(device)
    try:
        model.eval()
    except NotImplementedError:  # a torch.export program (MLflow's pt2 format) is frozen in eval mode already
        pass
    outs, ys = [], []
    for x, y in _batches(ds, batch_size):
        outs.append(model(x.to(device)).float())
        ys.append(y.to(device))
    out, y = torch.cat(outs), torch.cat(ys)
    n = int(y.shape[0])
    if splits is not None:
        task = splits.task
    else:
        task = "classification" if not torch.is_floating_point(y) and out.dim() == 2 and out.shape[1] > 1 else "regression"
    info = (splits.info if splits is not None else None) or {}
    loss = dict(loss or {})
    loss_fn = build_loss(loss.pop("name", None), loss, task, device)
    num_classes = int(out.shape[1]) if task == "classification" and out.dim() == 2 else 0
    num_outputs = 1 if task == "classification" or y.dim() == 1 else int(y[0].numel())
    wanted = [m for m in extra_metrics if m in METRICS[task]]
    metric_set = MetricSet(task, device, wanted, num_classes, num_outputs, info.get("target_mean"), info.get("target_std"))
    metric_set.update(out, y)
    metrics = {"eval_loss": float(loss_fn(out, y).item()), **metric_set.compute(n, prefix="eval_")}
    metrics["eval_samples"] = float(n)
    return metrics, y.cpu().numpy(), out.cpu().numpy()


def evaluate(target: str, overrides: list[str], tracking_uri: str | None = None, device: str = "auto", split: str = "val") -> EvalResult:
    """Load the model behind `target`, evaluate it on the recipe's dataset section, log a linked run.

    `device`: auto (the best this machine has: the GPU a CUDA run trained on, else the CPU) or a device name.
    """
    if split not in SPLITS:
        raise InputError(f"--split must be one of {', '.join(SPLITS)}, not '{split}'")
    _check_overrides(overrides)
    uri, _ = tracking.resolve_uri(tracking_uri)
    c = tracking.client(uri)
    try:
        t = eval_log.find(c, target)
    except eval_log.EvalInputError as e:
        raise InputError(str(e)) from None
    try:
        choice = devices.resolve(device, ["cpu"] if device == "auto" else [])
    except devices.DeviceUnavailable as e:
        raise InputError(str(e)) from None
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"recipe-of-run-{t.run_id}.yaml"  # named in any recipe problem
        p.write_text(t.recipe_text)
        resolved = resolve_recipe(p, overrides)  # RecipeError: the CLI lists the problems, exit 2
        original = Path(t.recipe_path) if t.recipe_path else None
        recipe_dir = original.resolve().parent if original is not None and original.parent.exists() else Path(d)
        recipe = resolved.recipe
        splits = _data(recipe, recipe_dir)
    ds = {"val": splits.val, "test": getattr(splits, "test", None), "train": splits.train}[split]
    if ds is None:
        raise InputError(f"dataset '{recipe.dataset.name}' has no {split} split")
    model, on = eval_log.load(uri, t.model_uri, choice.device)
    ran_on = torch.device(on)  # the CPU where the program could not be moved (said by the loader's warning)
    t0 = time.perf_counter()
    loss = {"name": recipe.loss.name, **recipe.loss.kwargs} if recipe.loss is not None else None
    metrics, y, out = measure(model, ds, recipe.batch_size, ran_on, splits, loss, recipe.metrics)
    metrics["eval_time_s"] = time.perf_counter() - t0
    raw = raw_tensors(ds)
    features = raw[0] if raw is not None else torch.empty(0)
    name = standard.run_name(f"eval-{recipe.model.name}", recipe.dataset.name, str(ran_on))
    shown = {k: v for k, v in metrics.items() if k in ("eval_accuracy", "eval_loss", "eval_mae", "eval_r2")}
    tags = {
        "mpsrun.eval.model_uri": t.model_uri,
        "mpsrun.eval.source_run": t.run_id,
        "mpsrun.eval.split": split,
        "mpsrun.eval.overrides": " ".join(overrides),
        "mpsrun.command": "mpsrun eval " + " ".join([target, *overrides]),
        "device.actual": str(ran_on),
        "device.requested": device,
        "device.fallback": "true" if ran_on.type != choice.device.type else "false",  # a program that could not be moved
        "mlflow.note.content": f"Evaluated {t.model_uri} (trained in run {t.run_id}) on the {split} split of "
        f"`{recipe.dataset.name}`: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) + ".",
    }
    title = f"eval of {t.model_uri} on {recipe.dataset.name} ({split})"

    def _figures(c_: Any, run_id: str) -> None:
        shown_y, shown_out = target_units(y, out, splits.info or {}) if splits.task == "regression" else (y, out)
        figures.log_predictions(c_, run_id, shown_y, shown_out, title, split=SPLITS[split])

    run_id = eval_log.log(c, t, name, metrics, tags, recipe.dataset.name, Split(SPLITS[split], features, torch.as_tensor(y)), _figures)
    return EvalResult(run_id, t.experiment_id, t.model_uri, t.run_id, split, int(metrics["eval_samples"]), str(ran_on), metrics)
