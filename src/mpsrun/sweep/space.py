"""The search space in Optuna's terms: what each searched path suggests, and the sampler and pruner.

Optuna's categorical choices must be None, bool, int, float or str; a choice list that
holds lists or mappings (`model.hidden: [[64], [128, 64]]`) is offered to Optuna as the
choices' JSON text and decoded back, so any YAML value can be a choice. The sampler
is seeded from the recipe's seed, offset per worker and per start, so two workers (or
a second `mpsrun sweep` of the same study) do not propose the same first points.
"""

from __future__ import annotations

import json
import math
from typing import Any

from mpsrun.recipe.model import SweepParam, SweepSection


class SpaceError(ValueError):
    """A sampler that cannot search this space (bad input, exit 2); `path` is the sweep key to point at."""

    def __init__(self, message: str, path: tuple) -> None:
        super().__init__(message)
        self.path = path


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def encoded(param: SweepParam) -> list[Any]:
    """The choices as Optuna takes them: scalars as they are, anything else as JSON text."""
    assert param.choices is not None
    if all(_scalar(c) for c in param.choices):
        return list(param.choices)
    return [json.dumps(c, sort_keys=True) for c in param.choices]


def decode(param: SweepParam, value: Any) -> Any:
    if param.choices is not None and not all(_scalar(c) for c in param.choices):
        return json.loads(value)
    return value


def suggest(trial: Any, sweep: SweepSection) -> dict[str, Any]:
    """One value per searched path, through the trial's suggest_* (define-by-run)."""
    out: dict[str, Any] = {}
    for key, p in sweep.params.items():
        if p.choices is not None:
            out[key] = decode(p, trial.suggest_categorical(key, encoded(p)))
        elif p.is_int:
            out[key] = trial.suggest_int(key, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)  # type: ignore[arg-type]
        else:
            out[key] = trial.suggest_float(key, float(p.low), float(p.high), step=float(p.step) if p.step else None, log=p.log)  # type: ignore[arg-type]
    return out


def decode_params(sweep: SweepSection, params: dict[str, Any]) -> dict[str, Any]:
    """A finished trial's Optuna params back into recipe values."""
    return {k: decode(sweep.params[k], v) if k in sweep.params else v for k, v in params.items()}


def grid(sweep: SweepSection) -> dict[str, list[Any]]:
    """GridSampler's search space: every choice list, every range with a step; SpaceError otherwise."""
    out: dict[str, list[Any]] = {}
    for key, p in sweep.params.items():
        if p.choices is not None:
            out[key] = encoded(p)
        elif p.step is not None:
            n = int(math.floor((p.high - p.low) / p.step + 1e-9)) + 1  # type: ignore[operator]
            out[key] = [int(p.low + i * p.step) if p.is_int else float(p.low + i * p.step) for i in range(n)]  # type: ignore[operator]
        else:
            raise SpaceError(f"sampler grid needs a finite grid: give this range a `step`, or list its values", ("sweep", "params", key))
    return out


def grid_size(sweep: SweepSection) -> int:
    n = 1
    for values in grid(sweep).values():
        n *= len(values)
    return n


def check(sweep: SweepSection) -> None:
    """What the chosen sampler cannot do, said before anything runs."""
    if sweep.sampler == "grid":
        grid(sweep)
    if sweep.sampler in ("cmaes", "qmc"):
        for key, p in sweep.params.items():
            if p.choices is not None:
                raise SpaceError(
                    f"sampler {sweep.sampler} searches numeric ranges only, and this is a choice list: "
                    "use sampler tpe or random (or grid), or make it a range", ("sweep", "params", key))


def sampler(sweep: SweepSection, seed: int) -> Any:
    import optuna

    s = sweep.sampler
    if s == "tpe":  # fused groups ask several trials before telling any: the constant liar keeps them apart
        return optuna.samplers.TPESampler(seed=seed, constant_liar=sweep.fuse != "off")
    if s == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s == "grid":
        class Grid(optuna.samplers.GridSampler):
            def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
                """No `study.stop()` once the grid is covered (it needs `study.optimize`): the budget, capped at the grid's size, ends the sweep."""

        return Grid(grid(sweep), seed=seed)
    if s == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    return optuna.samplers.QMCSampler(seed=seed, scramble=True, warn_asynchronous_seeding=False)


def pruner(sweep: SweepSection, epochs: int) -> Any:
    import optuna

    p = sweep.pruner
    if p == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=0)
    if p == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(1, epochs))
    if p == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    return optuna.pruners.NopPruner()


def worker_seed(seed: int, worker: int, started_after: int) -> int:
    """A distinct, reproducible sampler seed per worker and per start of the study."""
    return (seed + 7919 * worker + 104_729 * started_after) % (2**32)
