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

from .recipe import (
    LoaderSection,
    PluginSection,
    Problem,
    Recipe,
    RecipeError,
    RecipeSource,
    Resolved,
    TrackingSection,
    did_you_mean,
    parse_override,
    validate_source,
)

SPECIAL = ("include", "exclude")
_NOT_AXES = ("matrix", "repeats")


def key_problem(key: str) -> str | None:
    """Why `key` is not a recipe path a matrix may vary, or None when it is one."""
    if key in SPECIAL:
        return None
    parts = key.split(".")
    if any(not p for p in parts):
        return "not a dotted recipe path such as optimizer.lr"
    top = parts[0]
    fields = [f for f in Recipe.model_fields if f not in _NOT_AXES]
    if top in _NOT_AXES:
        return f"'{top}' cannot vary inside a matrix"
    if top not in Recipe.model_fields:
        return f"unknown recipe path{did_you_mean(top, fields + list(SPECIAL))}"
    ann = Recipe.model_fields[top].annotation
    if ann is TrackingSection:
        return "tracking settings cannot vary: every cell is a child run of one parent, in one experiment"
    if len(parts) == 1 or ann is PluginSection:
        return None  # plugin arguments are checked against the plugin's signature, per cell
    if ann is LoaderSection:
        sub = list(LoaderSection.model_fields)
        if parts[1] not in sub:
            return f"unknown recipe path{did_you_mean(parts[1], sub)}; loader keys: {', '.join(sub)}"
        return None if len(parts) == 2 else f"'{top}.{parts[1]}' is a value, not a section"
    return f"'{top}' is a value, not a section"


def _is_override(where: str) -> bool:
    return where.startswith("override ")


def normalize(src: RecipeSource, overrides: list[str]) -> tuple[RecipeSource, list[Problem]]:
    """Flatten nested matrix keys and apply command-line pins; every entry keeps its location.

    Called by `recipe.resolve` after overrides are applied and before validation.
    """
    raw = src.data.get("matrix")
    if not isinstance(raw, dict):
        return src, []
    data = copy.deepcopy(src.data)
    positions = dict(src.positions)
    problems: list[Problem] = []
    flat: dict[str, Any] = {}
    origin: dict[str, tuple] = {}  # flattened key -> its location tuple before flattening

    def walk(node: dict, prefix: tuple) -> None:
        for k, v in node.items():
            loc = prefix + (str(k),)
            if isinstance(v, dict) and str(k) not in SPECIAL:
                walk(v, loc)
                continue
            key = ".".join(loc)
            if key in flat:
                old, new = src.where(("matrix",) + origin[key]), src.where(("matrix",) + loc)
                if _is_override(new) and not _is_override(old):
                    # the command line wins over the file; forget where the file's values were
                    stale = ("matrix",) + origin[key]
                    for p in [p for p in positions if p[: len(stale)] == stale]:
                        del positions[p]
                elif _is_override(old) and not _is_override(new):
                    continue
                else:
                    problems.append(Problem(f"matrix.{key}", "given twice (once as a dotted key, once nested); keep one", new))
                    continue
            flat[key] = v
            origin[key] = loc

    walk(raw, ())
    # Move positions of nested entries to their flattened keys.
    for key, loc in origin.items():
        if len(loc) == 1:
            continue
        full = ("matrix",) + loc
        for p in [p for p in positions if p[: len(full)] == full]:
            positions[("matrix", key) + p[len(full) :]] = positions[p]

    # A plain override of an axis's own path pins that axis.
    pinned: dict[str, Any] = {}
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ValueError:
            continue  # apply_overrides has reported it
        key = ".".join(keys)
        if key in flat and key not in SPECIAL:
            pinned[key] = value
            del flat[key]
    for name in SPECIAL:
        items = flat.get(name)
        if not isinstance(items, list):
            if name in flat:
                problems.append(Problem(f"matrix.{name}", "expected a list of {path: value} mappings", src.where(("matrix", name))))
            continue
        kept = []
        for j, item in enumerate(items):
            where = positions.get(("matrix", name, j)) or src.where(("matrix", name))
            if not isinstance(item, dict) or not item:
                problems.append(Problem(f"matrix.{name}[{j}]", "expected a mapping of recipe paths to values", where))
                continue
            bad = False
            for k in item:
                why = key_problem(str(k)) or ("not a path a cell can set" if str(k) in SPECIAL else None)
                if why is None and name == "exclude" and str(k) not in flat and str(k) not in pinned:
                    why = f"exclude may only name matrix axes ({', '.join(a for a in flat if a not in SPECIAL) or 'none'})"
                if why:
                    problems.append(Problem(f"matrix.{name}[{j}].{k}", why, positions.get(("matrix", name, j, k), where)))
                    bad = True
            if bad:
                continue
            # Items about a pinned axis apply only when they agree with the pin.
            if any(k in pinned and item[k] != pinned[k] for k in item):
                continue
            kept.append({k: v for k, v in item.items() if k not in pinned})
        flat[name] = [i for i in kept if i]
        if not flat[name]:
            del flat[name]
    data["matrix"] = flat
    return RecipeSource(src.path, data, positions), problems


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


def expand(resolved: Resolved, check_plugins: bool = True) -> list[Cell]:
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
                cells.append(Cell(index, values, axes, validate_source(cell_src, overrides, check_plugins=check_plugins), where))
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
