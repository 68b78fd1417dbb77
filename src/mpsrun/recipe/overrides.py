"""Command-line overrides (`optimizer.lr=0.01`) and the matrix keys they may pin.

Values are read as YAML scalars; every key an override sets is located at the
override itself, so a problem it causes is reported against the command line.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from mpsrun.recipe.model import SPECIAL, key_problem
from mpsrun.recipe.problems import Problem, RecipeSource, yaml_load


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optimizer.lr=0.01` -> (['optimizer', 'lr'], 0.01); values are YAML scalars."""
    if "=" not in text:
        raise ValueError("expected key=value")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ValueError("expected a dotted key such as optimizer.lr")
    try:
        value = yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"value is not valid YAML: {getattr(e, 'problem', e)}") from None
    return key.split("."), value


def apply_overrides(src: RecipeSource, overrides: list[str]) -> tuple[RecipeSource, list[Problem]]:
    """Return a new source with overrides applied; their keys are located at the override."""
    data = copy.deepcopy(src.data)
    positions = dict(src.positions)
    problems: list[Problem] = []
    for text in overrides:
        where = f"override '{text}'"
        try:
            keys, value = parse_override(text)
        except ValueError as e:
            problems.append(Problem("", str(e), where))
            continue
        node = data
        ok = True
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                problems.append(
                    Problem(".".join(keys[: i + 1]), f"is a {type(nxt).__name__}, not a section", where)
                )
                ok = False
                break
            node = nxt
        if not ok:
            continue
        node[keys[-1]] = value
        for j in range(1, len(keys) + 1):
            positions[tuple(keys[:j])] = where
        # Nested positions from the file no longer describe the new value.
        for loc in [loc for loc in positions if loc[: len(keys)] == tuple(keys) and len(loc) > len(keys)]:
            del positions[loc]
    return RecipeSource(src.path, data, positions), problems


def _is_override(where: str) -> bool:
    return where.startswith("override ")


def normalize(src: RecipeSource, overrides: list[str]) -> tuple[RecipeSource, list[Problem]]:
    """Flatten nested matrix keys and apply command-line pins; every entry keeps its location.

    Called by `load.resolve` after overrides are applied and before validation.
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
