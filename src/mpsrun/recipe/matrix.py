"""Matrices: one recipe, many cells. `matrix:` maps dotted recipe paths to lists of values.

A cell is the recipe with one value per axis set, validated exactly like a recipe
written by hand, so a bad value is reported at the line of the matrix entry that
holds it before anything runs. `include` and `exclude` follow GitHub Actions'
matrix rules (a well-known contract, rather than one of our own): `exclude` drops
the combinations that match an item; an `include` item adds its other keys to
every combination it matches, or is a combination of its own when it matches none.

From the command line, `matrix.device=[cpu,cuda]` replaces an axis's values (any
axis: `matrix.model.arch=[resnet18]` works too, nested keys are flattened), and a
plain override of an axis's own path (`device=cuda`) pins that axis to one value.
"""

from __future__ import annotations

import copy
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from mpsrun.recipe.load import Resolved, validate_source
from mpsrun.recipe.model import _NOT_AXES, SPECIAL, Recipe
from mpsrun.recipe.problems import Problem, RecipeError, RecipeSource

# ----------------------------------------------------------------------------- cells


@dataclass
class Cell:
    """One combination of matrix values, resolved into a runnable recipe."""

    index: int
    values: dict[str, Any]  # path -> value: the axes first, then `include` additions
    axes: list[str]  # the matrix's axes (not `include` additions); they identify the cell
    resolved: Resolved
    where: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return " ".join(f"{k}={fmt_value(v)}" for k, v in self.values.items())

    @property
    def extras(self) -> dict[str, Any]:
        """Values an `include` item added beyond the axes (shown in the results table)."""
        return {k: v for k, v in self.values.items() if k not in self.axes}

    def assignments(self) -> list[str]:
        """The cell as overrides: `mpsrun run RECIPE <these>` reruns exactly this cell."""
        return [f"{k}={fmt_value(v)}" for k, v in self.values.items()]


def fmt_value(v: Any) -> str:
    """A value as YAML flow text (what a user types in an override)."""
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def axes_of(recipe: Recipe) -> list[str]:
    return [k for k in recipe.matrix if k not in SPECIAL]


def combinations(recipe: Recipe, src: RecipeSource) -> list[tuple[dict[str, Any], dict[str, str]]]:
    """(values, where each value was written) for every cell, in axis order (first axis outermost)."""
    m = recipe.matrix
    axes = axes_of(recipe)
    combos: list[tuple[dict[str, Any], dict[str, str]]] = []
    if axes:
        for picks in itertools.product(*[list(enumerate(m[a])) for a in axes]):
            values = {a: v for a, (_, v) in zip(axes, picks)}
            where = {a: src.where(("matrix", a, i)) for a, (i, _) in zip(axes, picks)}
            combos.append((values, where))
    for ex in m.get("exclude", []):
        combos = [c for c in combos if not all(k in c[0] and c[0][k] == v for k, v in ex.items())]
    for j, item in enumerate(m.get("include", [])):
        here = {k: src.where(("matrix", "include", j, k)) for k in item}
        on_axes = {k: v for k, v in item.items() if k in axes}
        matched = [c for c in combos if all(c[0][k] == v for k, v in on_axes.items())] if axes else []
        for values, where in matched:
            for k, v in item.items():
                if k not in on_axes:
                    values[k] = v
                    where[k] = here[k]
        if not matched:
            combos.append((dict(item), here))
    if not combos and not axes and not m.get("include"):
        combos = [({}, {})]
    return combos


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


def expand(resolved: Resolved) -> list[Cell]:
    """Every cell of the recipe's matrix, each validated like a recipe of its own.

    Raises RecipeError listing every problem of every cell, each at the matrix
    entry (file:line:col or override) that holds the offending value.
    """
    src = resolved.source
    recipe = resolved.recipe
    axes = axes_of(recipe)
    cells: list[Cell] = []
    problems: list[Problem] = []
    seen: set[tuple[str, str, str]] = set()
    base = {k: v for k, v in src.data.items() if k not in _NOT_AXES}
    for index, (values, where) in enumerate(combinations(recipe, src)):
        data = copy.deepcopy(base)
        positions = {p: w for p, w in src.positions.items() if p[:1] not in (("matrix",), ("repeats",))}
        label = " ".join(f"{k}={fmt_value(v)}" for k, v in values.items())
        local: list[Problem] = []
        for key, value in values.items():
            keys = key.split(".")
            err = _set_path(data, keys, value)
            if err:
                local.append(Problem(key, err, where.get(key, "")))
                continue
            for p in [p for p in positions if p[: len(keys)] == tuple(keys) and len(p) > len(keys)]:
                del positions[p]
            positions[tuple(keys)] = where.get(key, src.where(("matrix",)))
        tracking = data.setdefault("tracking", {})
        if isinstance(tracking, dict) and label:
            tracking["run_name"] = f"{tracking['run_name']} {label}" if tracking.get("run_name") else label
        cell_src = RecipeSource(src.path, data, positions)
        overrides = resolved.overrides + [f"{k}={fmt_value(v)}" for k, v in values.items()]
        if not local:
            try:
                cells.append(Cell(index, values, axes, validate_source(cell_src, overrides, check=resolved.check), where))
                continue
            except RecipeError as e:
                local = e.problems
        matrix_places = set(where.values())
        for p in local:
            msg = p.message if p.where in matrix_places else f"{p.message} (in matrix cell {label})"
            key = (p.path, p.where, msg)
            if key not in seen:
                seen.add(key)
                problems.append(Problem(p.path, msg, p.where))
    if problems:
        raise RecipeError(problems, str(src.path))
    return cells


def single(resolved: Resolved) -> Resolved:
    """The one cell of a recipe whose matrix is pinned down to one (`mpsrun run`); else bad input."""
    if not resolved.recipe.matrix:
        return resolved
    cells = expand(resolved)
    if len(cells) == 1:
        return cells[0].resolved
    axes = [a for a in axes_of(resolved.recipe) if len(resolved.recipe.matrix[a]) > 1] or axes_of(resolved.recipe)
    example = " ".join(f"{a}={fmt_value(resolved.recipe.matrix[a][0])}" for a in axes)
    raise RecipeError(
        [
            Problem(
                "matrix",
                f"this recipe declares a matrix of {len(cells)} cells; run them all with "
                f"`mpsrun bench {resolved.path}`, or pin every axis to run one, e.g. "
                f"`mpsrun run {resolved.path} {example}`",
                resolved.source.where(("matrix",)),
            )
        ],
        str(resolved.path),
    )
