"""A recipe's `sweep:` section as recipes: checked values, one trial's recipe, the plain best recipe.

A trial is the recipe without its `sweep:` section, with one value set at each searched
path, validated exactly like a recipe written by hand (plugin arguments included, through
`Resolved.check`). Before anything runs, every choice and both ends of every range are
put through that same validation, so a value a plugin's signature rejects is reported at
the line of the sweep entry that holds it (exit 2), not as a FAILED trial an hour later.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from mpsrun.recipe.load import Resolved, validate_source
from mpsrun.recipe.model import SweepSection
from mpsrun.recipe.problems import Problem, RecipeError, RecipeSource


def _set_path(data: dict, keys: list[str], value: Any) -> str | None:
    node = data
    for i, k in enumerate(keys[:-1]):
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            return f"'{'.'.join(keys[: i + 1])}' is a {type(nxt).__name__}, not a section"
        node = nxt
    node[keys[-1]] = copy.deepcopy(value)
    return None


def without_sweep(resolved: Resolved) -> Resolved:
    """The recipe as `mpsrun run` trains it: its own values, the `sweep:` section dropped."""
    if resolved.recipe.sweep is None:
        return resolved
    data = {k: v for k, v in resolved.source.data.items() if k != "sweep"}
    positions = {p: w for p, w in resolved.source.positions.items() if p[:1] != ("sweep",)}
    return validate_source(RecipeSource(resolved.path, data, positions), resolved.overrides, check=resolved.check)


def trial_recipe(resolved: Resolved, values: dict[str, Any], where: dict[str, str] | None = None) -> Resolved:
    """The recipe with `values` (dotted path -> value) set and no `sweep:` section; RecipeError if invalid."""
    src = resolved.source
    data = {k: v for k, v in copy.deepcopy(src.data).items() if k != "sweep"}
    positions = {p: w for p, w in src.positions.items() if p[:1] != ("sweep",)}
    problems: list[Problem] = []
    for key, value in values.items():
        keys = key.split(".")
        here = (where or {}).get(key, src.where(("sweep", "params", key)))
        err = _set_path(data, keys, value)
        if err:
            problems.append(Problem(key, err, here))
            continue
        for p in [p for p in positions if p[: len(keys)] == tuple(keys)]:
            del positions[p]
        positions[tuple(keys)] = here
    if problems:
        raise RecipeError(problems, str(src.path))
    overrides = resolved.overrides + [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}" for k, v in values.items()]
    return validate_source(RecipeSource(src.path, data, positions), overrides, check=resolved.check)


def check_values(resolved: Resolved) -> None:
    """Every choice and both ends of every range, validated as a trial would be; RecipeError listing each bad one."""
    sweep = resolved.recipe.sweep
    assert sweep is not None
    src = resolved.source
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for key, param in sweep.params.items():
        here = src.where(("sweep", "params", key))
        for value in param.candidates():
            try:
                trial_recipe(resolved, {key: value}, {key: here})
            except RecipeError as e:
                for p in e.problems:
                    msg = f"value {value!r}: {p.message}" if p.where == here else f"value {value!r} of sweep.params.{key}: {p.message}"
                    if (p.where, p.message) not in seen:  # a misspelt path: once, not once per value
                        seen.add((p.where, p.message))
                        problems.append(Problem(f"sweep.params.{key}" if p.where == here else p.path, msg, p.where))
    if problems:
        raise RecipeError(problems, str(src.path))


def problem(resolved: Resolved, loc: tuple, message: str) -> RecipeError:
    """One located problem in the sweep section (the sweep wing's checks that need more than the recipe)."""
    return RecipeError([Problem(".".join(str(x) for x in loc), message, resolved.source.where(loc))], str(resolved.path))


def section(resolved: Resolved) -> SweepSection:
    """The recipe's sweep section, or a located RecipeError when it has none."""
    if resolved.recipe.sweep is None:
        raise RecipeError([Problem("sweep", "this recipe has no `sweep:` section (see docs/guides/sweeps.md)", resolved.source.where(()))], str(resolved.path))
    return resolved.recipe.sweep
