"""`mpsrun new plugin NAME`: a plugin package that installs and trains before you edit a line.

The shipped example, examples/mpsrun-plugin-example, is this scaffold's output
(a test keeps them identical), so the template is exercised end to end by the
test suite and the example never drifts from what new authors get.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

# PEP 508 project names; the import name is the normalised form with underscores.
_DIST = re.compile(r"^([A-Z0-9]|[A-Z0-9][A-Z0-9._-]*[A-Z0-9])$", re.IGNORECASE)
_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")


class ScaffoldError(Exception):
    """Bad input for the scaffold (name, existing folder): exit code 2."""


@dataclass(frozen=True)
class Names:
    dist: str  # my-lab
    module: str  # my_lab
    model: str  # entry-point name of the model plugin
    dataset: str  # entry-point name of the dataset plugin

    @classmethod
    def make(cls, dist: str, model: str | None = None, dataset: str | None = None) -> "Names":
        if not _DIST.match(dist):
            raise ScaffoldError(
                f"'{dist}' is not a valid package name: use letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit (e.g. my-lab-models)"
            )
        module = re.sub(r"[-_.]+", "_", dist).lower()
        if module[0].isdigit():
            module = f"plugin_{module}"
        names = cls(dist, module, model or f"{module}_mlp", dataset or f"{module}_spirals")
        for what, value in (("model", names.model), ("dataset", names.dataset)):
            if not _IDENT.match(value) or keyword.iskeyword(value):
                raise ScaffoldError(f"{what} name '{value}' must be a lower-case Python identifier (e.g. resnet_tiny)")
        if keyword.iskeyword(module):
            raise ScaffoldError(f"'{dist}' gives the module name '{module}', a Python keyword; pick another name")
        return names


def files(names: Names, schema_ref: str | None = None) -> dict[str, str]:
    """Relative path -> text of every file in the package.

    schema_ref: where the recipe's editor modeline points; None writes the schema
    into the package (recipe.schema.json) and points there.
    """
    from mpsrun.recipe.schema import render

    ref = schema_ref or "../recipe.schema.json"
    subs = {"dist": names.dist, "module": names.module, "model": names.model, "dataset": names.dataset, "schema_ref": ref, "callback": f"{names.module}_best"}
    out = {Template(path).substitute(subs): Template(text).substitute(subs) for path, text in _TEMPLATES.items()}
    if schema_ref is None:
        out["recipe.schema.json"] = render()
    return out


def write(dest: Path, names: Names, schema_ref: str | None = None) -> list[Path]:
    """Write the package into `dest`, which must not exist yet: nothing is ever overwritten."""
    if dest.exists():
        raise ScaffoldError(f"{dest} already exists; pick another name or folder (nothing was written)")
    written = []
    for rel, text in files(names, schema_ref).items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        written.append(p)
    return written


# ----------------------------------------------------------------------------- templates
# string.Template: $name is substituted, $$ is a literal dollar.

_PYPROJECT = '''\
[build-system]
requires = ["hatchling>=1.21"]
build-backend = "hatchling.build"

[project]
name = "$dist"
version = "0.1.0"
description = "mpsrun plugins: the $model model and the $dataset dataset."
requires-python = ">=3.10"
# Install into the environment that has mpsrun: `pip install -e .`
dependencies = ["mpsrun>=0.1", "torch>=2.4"]

# How mpsrun finds the plugins: NAME = "module:callable" under its two groups.
# NAME is what recipes write after `name:`.
[project.entry-points."mpsrun.models"]
$model = "$module.models:$model"

[project.entry-points."mpsrun.datasets"]
$dataset = "$module.datasets:$dataset"

[project.entry-points."mpsrun.callbacks"]
$callback = "$module.callbacks:BestMetric"

[tool.hatch.build.targets.wheel]
packages = ["src/$module"]
'''

_INIT = '''\
"""$dist: mpsrun plugins. Registered in pyproject.toml; nothing to import by hand."""
'''

_MODELS = '''\
"""Model plugins: callables that return a torch.nn.Module.

mpsrun fills in `input_shape` and `num_classes` from the dataset because the
function declares them; every other parameter is a recipe key under `model:`,
checked against these type hints before any data loads.
"""

from __future__ import annotations

import math

from torch import nn


class _Block(nn.Module):
    """x + MLP(LayerNorm(x)): the pre-norm residual block of transformers, on vectors."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout), nn.Linear(width, width)
        )

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x + self.body(x)


def $model(
    input_shape: tuple[int, ...],
    num_classes: int,
    width: int = 64,
    depth: int = 2,
    dropout: float = 0.0,
) -> nn.Module:
    """Residual MLP: flatten, project to `width`, `depth` pre-norm residual blocks, classify.

    Works on any input shape (it flattens), so it also runs on mpsrun's built-in
    datasets: `mpsrun run RECIPE dataset.name=digits`.
    """
    if width < 1 or depth < 0:
        raise ValueError(f"width must be positive and depth non-negative, got {width} and {depth}")
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), width),
        *[_Block(width, dropout) for _ in range(depth)],
        nn.LayerNorm(width),
        nn.Linear(width, num_classes),
    )
'''

_DATASETS = '''\
"""Dataset plugins: callables that return mpsrun.DataSplits.

mpsrun fills in `seed` (the recipe's seed) and `recipe_dir` (the recipe file's
folder, for data files named relative to the recipe) when the function declares
them; every other parameter is a recipe key under `dataset:`.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset

from mpsrun import DataSplits


def $dataset(
    arms: int = 3,
    points_per_arm: int = 500,
    noise: float = 0.15,
    turns: float = 1.0,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> DataSplits:
    """Interleaved 2-D spirals, one class per arm: tiny, offline, and not linearly separable.

    Returns TensorDatasets of raw tensors (float32 points, int64 labels), so mpsrun
    keeps them on the device and batches there. Raise ValueError for bad arguments:
    mpsrun reports it as bad input (exit code 2) naming this plugin.
    """
    if arms < 2:
        raise ValueError(f"arms must be at least 2, got {arms}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(arms, points_per_arm, generator=g)  # distance along the arm, 0..1
    angle = r * turns * 2 * math.pi + torch.arange(arms).unsqueeze(1) * (2 * math.pi / arms)
    x = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=-1)
    x = (x + noise * r.unsqueeze(-1) * torch.randn(x.shape, generator=g)).reshape(-1, 2)
    y = torch.arange(arms).repeat_interleave(points_per_arm)
    order = torch.randperm(len(y), generator=g)
    n_val = max(1, int(len(y) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return DataSplits(
        train=TensorDataset(x[train].float(), y[train]),
        val=TensorDataset(x[val].float(), y[val]),
        num_classes=arms,
        input_shape=(2,),
    )
'''

_CALLBACKS = '''\
"""Callback plugins: classes (or callables) that return an mpsrun Callback.

Hooks run between epochs, never inside the step loop. `run.log` records on the
run's MLflow run; `run.request_stop(reason)` ends the run after this epoch
(FINISHED, the reason printed). `state_dict` travels in checkpoints.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from mpsrun import Callback, RunState


class BestMetric(Callback):
    """Logs the best value so far of `monitor` as best_<monitor>; stops once it reaches `stop_at`."""

    def __init__(self, monitor: str = "val_accuracy", mode: Literal["min", "max"] = "max", stop_at: Optional[float] = None) -> None:
        self.monitor = monitor
        self.mode = mode
        self.stop_at = stop_at
        self.best: Optional[float] = None

    def on_epoch_end(self, run: RunState, epoch: int, metrics: dict[str, float]) -> None:
        value = metrics[self.monitor]
        better = self.best is None or (value > self.best if self.mode == "max" else value < self.best)
        if better:
            self.best = value
        run.log.log_metrics({f"best_{self.monitor}": self.best}, step=epoch)
        reached = self.stop_at is not None and (self.best >= self.stop_at if self.mode == "max" else self.best <= self.stop_at)
        if reached:
            run.request_stop(f"{self.monitor} reached {self.stop_at}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
'''

_RECIPE = '''\
# yaml-language-server: $$schema=$schema_ref
# $model on $dataset: trains in seconds on a CPU, to over 90% validation accuracy.
#   mpsrun run recipes/$dataset.yaml
#   mpsrun run recipes/$dataset.yaml model.depth=4 dataset.noise=0.3
device: auto
epochs: 30
batch_size: 64
seed: 0
dataset:
  name: $dataset
  arms: 3
  noise: 0.1
model:
  name: $model
  width: 64
  depth: 2
optimizer:
  name: adam
  lr: 0.01
callbacks:              # logs best_val_accuracy; add stop_at: 0.95 to end the run there
  - name: $callback
tracking:
  experiment: $dataset
'''

_TEST = '''\
"""Fast checks of the plugins themselves; `mpsrun run recipes/$dataset.yaml` is the real test."""

from __future__ import annotations

import torch

from $module.callbacks import BestMetric
from $module.datasets import $dataset
from $module.models import $model


def test_dataset_is_seeded_and_shaped() -> None:
    a, b = $dataset(seed=1), $dataset(seed=1)
    x, y = a.train.tensors
    assert x.shape[1:] == a.input_shape and y.dtype == torch.int64
    assert torch.equal(x, b.train.tensors[0])
    assert set(y.tolist()) == set(range(a.num_classes))


def test_model_maps_inputs_to_class_scores() -> None:
    splits = $dataset()
    model = $model(input_shape=splits.input_shape, num_classes=splits.num_classes)
    x, _ = splits.val.tensors
    assert model(x[:8]).shape == (8, splits.num_classes)


def test_callback_logs_the_best_value_and_stops_at_the_target() -> None:
    from mpsrun import RunState

    model = torch.nn.Linear(2, 2)
    run = RunState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), epochs=5)
    cb = BestMetric(stop_at=0.9)
    for epoch, acc in enumerate([0.5, 0.7, 0.6]):
        cb.on_epoch_end(run, epoch, {"val_accuracy": acc})
    assert cb.best == 0.7 and not run.should_stop
    cb.on_epoch_end(run, 3, {"val_accuracy": 0.95})
    assert run.should_stop
'''

_README = '''\
# $dist

mpsrun plugins: the model `$model` and the dataset `$dataset`.
Written by `mpsrun new plugin $dist`; edit freely.

```bash
pip install -e .                       # into the environment that has mpsrun
mpsrun plugins show $model             # found through the entry points in pyproject.toml
mpsrun run recipes/$dataset.yaml       # trains in seconds on a CPU
python -m pytest -q tests              # the plugins' own quick checks
```

- `src/$module/models.py`: `$model(input_shape, num_classes, ...)` returns an `nn.Module`.
- `src/$module/datasets.py`: `$dataset(..., seed)` returns `mpsrun.DataSplits`.
- `src/$module/callbacks.py`: `BestMetric`, the callback `$callback`: logs a metric of
  its own each epoch and can stop the run (`callbacks: [{name: $callback, stop_at: 0.95}]`).
- `pyproject.toml`: the entry points, `NAME = "module:callable"`. After renaming or
  adding one, run `pip install -e .` again: entry points are read from the
  installed metadata, not from the source.
- `recipe.schema.json` (when present): the recipe schema from `mpsrun schema`, so
  YAML editors complete recipe keys; regenerate it after upgrading mpsrun.

The plugin contract (what the runner fills in, how arguments are checked, how to
keep data on the device) is in mpsrun's docs/plugins.md.
'''

_TEMPLATES = {
    "pyproject.toml": _PYPROJECT,
    "README.md": _README,
    "src/$module/__init__.py": _INIT,
    "src/$module/models.py": _MODELS,
    "src/$module/datasets.py": _DATASETS,
    "src/$module/callbacks.py": _CALLBACKS,
    "recipes/$dataset.yaml": _RECIPE,
    "tests/test_plugin.py": _TEST,
}
