"""Recipes: the YAML file a user writes, validated before anything heavy starts.

Every problem is collected and reported at once, each pointing at the file, line
and column (or the override) it came from, so a user fixes a recipe in one pass
instead of one error per run.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

DEVICE_PATTERN = r"^(auto|cpu|mps|cuda(:\d+)?)$"
Auto = Literal["auto"]


class PluginSection(BaseModel):
    """A `name:` plus that plugin's keyword arguments, flat beside it."""

    model_config = ConfigDict(extra="allow")
    name: str

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class TrackingSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    experiment: str | None = None
    run_name: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    log_model: bool = Field(True, description="save the final weights as the run's model.pt artifact")

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_as_strings(cls, v: Any) -> Any:
        # YAML turns `seed: 1` into an int; MLflow tags are strings anyway.
        if isinstance(v, dict):
            return {str(k): str(val) for k, val in v.items()}
        return v


class LoaderSection(BaseModel):
    """Options for the DataLoader path, used when data is not device-resident."""

    model_config = ConfigDict(extra="forbid")
    num_workers: int = Field(0, ge=0)
    persistent_workers: bool = True
    pin_memory: Union[Auto, bool] = "auto"


def _matrix_key(key: str) -> str:
    """A matrix key must be a recipe path a cell can set (see matrix.key_problem)."""
    from .matrix import key_problem  # local: matrix imports this module

    problem = key_problem(key)
    if problem:
        raise PydanticCustomError("matrix_key", problem)
    return key


MatrixKey = Annotated[str, AfterValidator(_matrix_key)]


class Recipe(BaseModel):
    """The validated recipe. Field docs become the JSON Schema's descriptions."""

    model_config = ConfigDict(extra="forbid")

    device: str = Field("auto", pattern=DEVICE_PATTERN, description="auto, cpu, mps, cuda or cuda:N")
    device_fallback: list[str] = Field(
        default_factory=list, description="devices to try, in order, when `device` is unusable"
    )
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(64, ge=1)
    seed: int = 0
    dataset: PluginSection
    model: PluginSection
    optimizer: PluginSection
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    loader: LoaderSection = Field(default_factory=LoaderSection)

    # Speed options: each `auto` is resolved per device by the engine and recorded.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    channels_last: Union[Auto, bool] = "auto"
    compile: Union[Auto, bool] = "auto"
    graphs: Union[Auto, bool] = Field("auto", description="CUDA graphs around the whole step")
    cudnn_benchmark: Union[Auto, bool] = Field(
        "auto", description="let cuDNN time its convolution algorithms (auto: on for conv models on CUDA)"
    )
    resident: Union[Auto, bool] = Field(
        "auto", description="keep the dataset on the device when it fits"
    )
    resident_max_gb: float = Field(
        2.0, gt=0, description="largest dataset (GiB) copied onto the device"
    )
    log_every: int = Field(
        0, ge=0, description="steps between progress reads of the loss (0: once per epoch)"
    )
    canary: Literal["on", "warn", "off"] = Field(
        "on",
        description="start-up check of known-fragile ops on the device against the CPU: "
        "on (stop on a mismatch), warn (warn and go on), off",
    )

    @field_validator("canary", mode="before")
    @classmethod
    def _canary_yaml_bool(cls, v: Any) -> Any:
        # YAML 1.1 reads unquoted `on` / `off` as booleans.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    # Benchmarks (`mpsrun bench`): one child run per combination and repeat.
    matrix: dict[MatrixKey, Annotated[list[Any], Field(min_length=1)]] = Field(
        default_factory=dict,
        description="dotted recipe path -> values to try (device, batch_size, model.arch, ...); "
        "`include`/`exclude`: lists of {path: value} as in GitHub Actions matrices",
    )
    repeats: int = Field(1, ge=1, description="runs of each matrix cell; the table reports medians and spread")

    @field_validator("device_fallback", mode="before")
    @classmethod
    def _fallback_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("device_fallback")
    @classmethod
    def _fallback_names(cls, v: list[str]) -> list[str]:
        for d in v:
            if not re.match(DEVICE_PATTERN, d):
                raise ValueError(f"'{d}' is not a device (expected auto, cpu, mps, cuda or cuda:N)")
        return v


# ----------------------------------------------------------------------------- errors


@dataclass
class Problem:
    """One thing wrong with a recipe, located as precisely as we can."""

    path: str
    message: str
    where: str = ""  # "file.yaml:3:5" or "override 'epochs=x'"

    def __str__(self) -> str:
        loc = f"{self.where}: " if self.where else ""
        field_ = f"{self.path}: " if self.path else ""
        return f"{loc}{field_}{self.message}"


class RecipeError(Exception):
    """Bad input: the CLI turns this into exit code 2 with every problem listed."""

    def __init__(self, problems: list[Problem], source: str = "") -> None:
        self.problems = problems
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source}: {n} problem{'s' if n != 1 else ''} in the recipe"
        return "\n".join([head] + [f"  - {p}" for p in self.problems])


def did_you_mean(word: str, choices: list[str] | set[str]) -> str:
    close = difflib.get_close_matches(str(word), sorted(choices), n=3, cutoff=0.6)
    if close:
        return " (did you mean " + " or ".join(f"'{c}'" for c in close) + "?)"
    return ""


# ----------------------------------------------------------------------------- loading


class Loader(yaml.SafeLoader):
    """Safe loading, with YAML 1.2 floats: `lr: 1e-3` is a number, not the string '1e-3'."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader


@dataclass
class RecipeSource:
    """Raw data of a recipe plus where each key came from."""

    path: Path
    data: dict[str, Any]
    positions: dict[tuple, str] = field(default_factory=dict)

    def where(self, loc: tuple) -> str:
        """The nearest located ancestor of `loc`: errors on a missing key point at its parent."""
        loc = tuple(loc)
        while loc:
            if loc in self.positions:
                return self.positions[loc]
            loc = loc[:-1]
        return self.positions.get((), str(self.path))


def _positions(node: yaml.Node, path: tuple, fname: str, out: dict[tuple, str]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            m = key_node.start_mark
            out[path + (key,)] = f"{fname}:{m.line + 1}:{m.column + 1}"
            _positions(value_node, path + (key,), fname, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            m = item.start_mark
            out[path + (i,)] = f"{fname}:{m.line + 1}:{m.column + 1}"
            _positions(item, path + (i,), fname, out)


def load_source(path: str | Path) -> RecipeSource:
    """Read YAML safely, keeping line:column of every key for error messages."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise RecipeError([Problem("", f"file not found: {p}")], str(p)) from None
    except OSError as e:
        raise RecipeError([Problem("", f"cannot read {p}: {e.strerror}")], str(p)) from None
    try:
        node = yaml.compose(text, Loader=Loader)
        data = yaml_load(text)
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
            found = e.get("input")
            msg = f"{e['msg']} (found {found!r})"
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
    for part in loc:
        f = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if f is None:
            return []
        model = f.annotation
    return list(model.model_fields) if hasattr(model, "model_fields") else []


@dataclass
class Resolved:
    """A validated recipe together with where it came from."""

    recipe: Recipe
    source: RecipeSource
    overrides: list[str]

    @property
    def path(self) -> Path:
        return self.source.path

    def as_dict(self) -> dict[str, Any]:
        return self.recipe.model_dump(mode="json")

    def as_yaml(self) -> str:
        return yaml.safe_dump(self.as_dict(), sort_keys=False)


def resolve(path: str | Path, overrides: list[str] | None = None, check_plugins: bool = True) -> Resolved:
    """Load, override and validate a recipe, plugin arguments included.

    Raises RecipeError listing every problem found; nothing is loaded or trained.
    """
    overrides = list(overrides or [])
    src = load_source(path)
    src, problems = apply_overrides(src, overrides)
    if isinstance(src.data.get("matrix"), dict):
        from .matrix import normalize  # local: matrix imports this module

        src, more = normalize(src, overrides)
        problems.extend(more)
    return validate_source(src, overrides, problems, check_plugins)


def validate_source(
    src: RecipeSource, overrides: list[str], problems: list[Problem] | None = None, check_plugins: bool = True
) -> Resolved:
    """Validate recipe data already loaded (and overridden); each matrix cell comes through here."""
    problems = list(problems or [])
    recipe = None
    try:
        recipe = Recipe.model_validate(src.data)
    except ValidationError as e:
        problems.extend(_pydantic_problems(e, src))
    if check_plugins:
        from . import plugins  # local: keeps `import mpsrun.recipe` light

        problems.extend(plugins.check_sections(src))
    if problems:
        raise RecipeError(sorted(problems, key=_line_order), str(src.path))
    assert recipe is not None
    return Resolved(recipe, src, overrides)


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
