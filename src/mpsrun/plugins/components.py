"""Training components named in a recipe: losses, LR schedulers, callbacks and metrics.

Each resolves a name the way users spell it (`mse`, `cross_entropy`; `CosineAnnealingLR`,
`cosine_annealing_lr`) and checks its keyword arguments against the real signature,
so a typo is answered with a did-you-mean before any data is loaded (exit 2), the
same way models and datasets are. Plugin losses and callbacks come from the
entry-point groups `mpsrun.losses` and `mpsrun.callbacks` through the registry.
"""

from __future__ import annotations

import difflib
import inspect
import re
from functools import lru_cache
from typing import Any, Callable

import mpsrun.plugins.registry as registry
from mpsrun.plugins.registry import PluginError
from mpsrun.recipe.problems import Problem, RecipeSource, did_you_mean

# Metric names a recipe may add under `metrics:`, per task (train/loop/metrics.py computes them).
METRICS = {
    "classification": ("accuracy", "top5_accuracy"),
    "regression": ("mae", "rmse", "r2", "mse"),
}


def snake(name: str) -> str:
    """`BCEWithLogits` -> `bce_with_logits`, `SmoothL1` -> `smooth_l1`, `MSE` -> `mse`."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


@lru_cache(maxsize=1)
def torch_losses() -> dict[str, type]:
    """Every torch.nn loss class by snake_case name without the `Loss` suffix."""
    from torch import nn

    out = {}
    for attr in dir(nn):
        obj = getattr(nn, attr)
        if inspect.isclass(obj) and issubclass(obj, nn.Module) and attr.endswith("Loss") and not attr.startswith("Adaptive"):
            out[snake(attr[: -len("Loss")])] = obj
    return out


def loss_factory(name: str) -> Callable[..., Any]:
    """A torch.nn loss class, or a plugin from `mpsrun.losses` (which wins only when torch has no such name)."""
    losses = torch_losses()
    key = name.lower()
    if key in losses:
        return losses[key]
    plugin_names = registry.names("loss")
    if name in plugin_names or ":" in name:
        return registry.find("loss", name).load()
    choices = sorted(losses) + plugin_names
    raise PluginError(f"unknown loss '{name}'{did_you_mean(key, choices)}; available: {', '.join(choices)}")


def _norm_scheduler(name: str) -> str:
    return name.replace("_", "").lower()


@lru_cache(maxsize=1)
def schedulers() -> dict[str, type]:
    """torch.optim.lr_scheduler classes by their name lower-cased without underscores."""
    from torch.optim import lr_scheduler

    out = {}
    for attr in dir(lr_scheduler):
        obj = getattr(lr_scheduler, attr)
        if (
            inspect.isclass(obj)
            and issubclass(obj, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau))
            and attr not in ("LRScheduler", "_LRScheduler")
            and not attr.startswith("_")
        ):
            out[_norm_scheduler(attr)] = obj
    return out


def scheduler_class(name: str) -> type:
    """CosineAnnealingLR, cosineannealinglr and cosine_annealing_lr all name the same class."""
    table = schedulers()
    key = _norm_scheduler(name)
    if key not in table:
        shown = sorted(c.__name__ for c in table.values())
        by_key = {_norm_scheduler(n): n for n in shown}
        close = difflib.get_close_matches(key, sorted(by_key), n=3, cutoff=0.6)
        hint = " (did you mean " + " or ".join(f"'{by_key[c]}'" for c in close) + "?)" if close else ""
        raise PluginError(f"unknown scheduler '{name}'{hint}; available: {', '.join(shown)}")
    return table[key]


# Scheduler arguments the runner fills (the optimizer) or mpsrun's own keys in the section.
SCHEDULER_SKIP = ("optimizer",)
SCHEDULER_OWN = ("name", "interval", "warmup_epochs", "warmup_start_factor", "monitor")


def check_components(src: RecipeSource) -> list[Problem]:
    """Names and arguments of `loss`, `scheduler`, `callbacks` and `metrics`, as Problems with positions."""
    problems: list[Problem] = []
    data = src.data

    def named(section: Any) -> bool:
        return isinstance(section, dict) and isinstance(section.get("name"), str)

    loss = data.get("loss")
    if named(loss):
        _check(problems, src, ("loss",), lambda: loss_factory(loss["name"]), {k: v for k, v in loss.items() if k != "name"}, ())
    sched = data.get("scheduler")
    if named(sched):
        kwargs = {k: v for k, v in sched.items() if k not in SCHEDULER_OWN}
        _check(problems, src, ("scheduler",), lambda: scheduler_class(sched["name"]), kwargs, SCHEDULER_SKIP)
    for i, cb in enumerate(data.get("callbacks") or []):
        if named(cb):
            name = cb["name"]
            _check(problems, src, ("callbacks", i), lambda name=name: registry.find("callback", name).load(), {k: v for k, v in cb.items() if k != "name"}, ())
    known = sorted({m for ms in METRICS.values() for m in ms})
    for i, m in enumerate(data.get("metrics") or []):
        if isinstance(m, str) and m not in known:
            problems.append(Problem(f"metrics.{i}", f"unknown metric '{m}'{did_you_mean(m, known)}; available: {', '.join(known)}", src.where(("metrics", i))))
    return problems


def _check(problems: list[Problem], src: RecipeSource, path: tuple, resolve: Callable[[], Any], kwargs: dict[str, Any], skip: tuple[str, ...]) -> None:
    dotted = ".".join(str(p) for p in path)
    try:
        fn = resolve()
    except PluginError as e:
        problems.append(Problem(f"{dotted}.name", str(e), src.where((*path, "name"))))
        return
    _, errs = registry.validate_kwargs(fn, kwargs, skip)
    for key, msg in errs:
        problems.append(Problem(f"{dotted}.{key}", msg, src.where((*path, key.split(".")[0]))))


def check_all(src: RecipeSource) -> list[Problem]:
    """The plugin sections (dataset, model, optimizer) and the training components together."""
    return registry.check_sections(src) + check_components(src)
