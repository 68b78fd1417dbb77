"""Recipe loading: file -> overrides -> matrix normalisation -> validated `Resolved`.

Every problem is collected and reported at once, each pointing at the file, line
and column (or the override) it came from, so a user fixes a recipe in one pass
instead of one error per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import ValidationError

from mpsrun.recipe.model import Recipe
from mpsrun.recipe.overrides import apply_overrides, normalize
from mpsrun.recipe.problems import (  # noqa: F401 - Loader and yaml_load are re-exported
    MAX_RECIPE_BYTES,
    Loader,
    Problem,
    RecipeError,
    RecipeSource,
    _positions,
    did_you_mean,
    yaml_compose_load,
    yaml_load,
)

Check = Callable[[RecipeSource], "list[Problem]"]


def load_source(path: str | Path) -> RecipeSource:
    """Read YAML safely, keeping line:column of every key for error messages."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_RECIPE_BYTES:  # checked before reading: a huge file is refused at once
            raise RecipeError(
                [Problem("", f"the file is {size:,} bytes, over the {MAX_RECIPE_BYTES:,}-byte limit for a recipe", f"{p}:1:1")],
                str(p),
            )
        text = p.read_text()
    except FileNotFoundError:
        raise RecipeError([Problem("", f"file not found: {p}")], str(p)) from None
    except OSError as e:
        raise RecipeError([Problem("", f"cannot read {p}: {e.strerror}")], str(p)) from None
    except UnicodeDecodeError as e:
        raise RecipeError([Problem("", f"not a text file ({e.reason} at byte {e.start})", f"{p}:1:1")], str(p)) from None
    try:
        node, data = yaml_compose_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeError([Problem("", f"invalid YAML: {problem}", where)], str(p)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [Problem("", f"expected a mapping of recipe keys, found {type(data).__name__}", f"{p}:1:1")],
            str(p),
        )
    positions: dict[tuple, str] = {(): f"{p}:1:1"}
    if node is not None:
        _positions(node, (), str(p), positions)
    return RecipeSource(p, data, positions)




def _pydantic_problems(err: ValidationError, src: RecipeSource) -> list[Problem]:
    problems = []
    for e in err.errors():
        loc = tuple(x for x in e["loc"] if not (isinstance(x, str) and x.startswith("function-")))
        # pydantic adds the union branch name ('bool', "literal['auto']") to the loc.
        loc = tuple(x for x in loc if not (isinstance(x, str) and (x in ("bool", "[key]") or x.startswith("literal["))))
        path = ".".join(str(x) for x in loc)
        if e["type"] == "extra_forbidden":
            parent_fields = _fields_at(loc[:-1])
            msg = f"unknown key{did_you_mean(str(loc[-1]), parent_fields)}"
        elif e["type"] == "missing":
            msg = "required key is missing"
        else:
            found = repr(e.get("input"))
            msg = f"{e['msg']} (found {found})" if len(found) <= 60 else e["msg"]  # a whole section is no help
        problems.append(Problem(path, msg, src.where(loc)))
    # Union errors repeat per branch: keep one line per path and message.
    seen, unique = set(), []
    for p in problems:
        if (p.path, p.where) in seen and not p.message.startswith("unknown"):
            continue
        seen.add((p.path, p.where))
        unique.append(p)
    return unique


def _fields_at(loc: tuple) -> list[str]:
    model: Any = Recipe
    skip_key = False
    for part in loc:
        if skip_key:  # a dict's key (a sweep's searched path): its values' model goes on
            skip_key = False
            continue
        f = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if f is None:
            return []
        model, skip_key = _section_model(f.annotation)
    return list(model.model_fields) if hasattr(model, "model_fields") else []


def _section_model(ann: Any) -> tuple[Any, bool]:
    """The model inside `Optional[Model]`, `dict[str, Model]` or `Annotated[Model, ...]`; True for a dict."""
    import typing

    origin = typing.get_origin(ann)
    if origin is dict:
        return _section_model(typing.get_args(ann)[1])[0], True
    if origin is typing.Annotated:
        return _section_model(typing.get_args(ann)[0])
    for arg in typing.get_args(ann) if origin is typing.Union or type(ann).__name__ == "UnionType" else ():
        if hasattr(arg, "model_fields"):
            return arg, False
    return ann, False


@dataclass
class Resolved:
    """A validated recipe together with where it came from."""

    recipe: Recipe
    source: RecipeSource
    overrides: list[str]
    check: Check | None = None  # the extra check it passed (plugin arguments); matrix cells reuse it

    @property
    def path(self) -> Path:
        return self.source.path

    def as_dict(self) -> dict[str, Any]:
        # No `sweep: null` in every run's params and recipe.yaml: the section exists only where written.
        return self.recipe.model_dump(mode="json", exclude={"sweep"} if self.recipe.sweep is None else None)

    def as_yaml(self) -> str:
        return yaml.safe_dump(self.as_dict(), sort_keys=False)


def resolve(path: str | Path, overrides: list[str] | None = None, check: Check | None = None) -> Resolved:
    """Load, override and validate a recipe; `check` adds problems of its own (plugin arguments).

    Raises RecipeError listing every problem found; nothing is loaded or trained.
    The recipe wing never imports plugins: the caller passes their check in
    (`mpsrun.plugins.resolve` does), and matrix cells reuse it through `Resolved.check`.
    """
    overrides = list(overrides or [])
    src = load_source(path)
    src, problems = apply_overrides(src, overrides)
    if isinstance(src.data.get("matrix"), dict):
        src, more = normalize(src, overrides)
        problems.extend(more)
    return validate_source(src, overrides, problems, check)


def validate_source(
    src: RecipeSource, overrides: list[str], problems: list[Problem] | None = None, check: Check | None = None
) -> Resolved:
    """Validate recipe data already loaded (and overridden); each matrix cell comes through here."""
    problems = list(problems or [])
    recipe = None
    try:
        recipe = Recipe.model_validate(src.data)
    except ValidationError as e:
        problems.extend(_pydantic_problems(e, src))
    if check is not None:
        problems.extend(check(src))
    if problems:
        raise RecipeError(sorted(problems, key=_line_order), str(src.path))
    assert recipe is not None
    return Resolved(recipe, src, overrides, check)


def _line_order(p: Problem) -> tuple:
    """File problems in line order, then override problems."""
    parts = p.where.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return (0, int(parts[1]), int(parts[2]))
    return (1, 0, 0)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> dotted keys, for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
