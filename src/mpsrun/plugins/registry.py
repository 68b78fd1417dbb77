"""Plugins: models and datasets found through entry points, loaded only when used.

Listing names reads package metadata only, so a broken or slow plugin costs
nothing until a recipe names it, and its failure names the entry point and the
distribution that shipped it instead of breaking `--help` or other plugins.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable

from pydantic import ConfigDict, ValidationError, create_model

from mpsrun.recipe.problems import Problem, RecipeSource, did_you_mean

GROUPS = {"model": "mpsrun.models", "dataset": "mpsrun.datasets", "callback": "mpsrun.callbacks", "loss": "mpsrun.losses"}
# Parameters the runner fills in itself; a recipe may not set them.
FILLED = {
    "model": ("num_classes", "num_outputs", "input_shape", "data_info"),
    "dataset": ("seed", "recipe_dir"),
    "callback": (),
    "loss": (),
}


class PluginError(Exception):
    """A plugin could not be found or loaded; bad input, exit code 2."""


@dataclass(frozen=True)
class PluginRef:
    kind: str
    name: str
    distribution: str
    version: str
    value: str
    entry_point: EntryPoint

    @property
    def qualified(self) -> str:
        return f"{self.distribution}:{self.name}"

    def describe(self) -> str:
        return f"{self.kind} plugin '{self.name}' ({self.value}) from distribution {self.distribution} {self.version}"

    def load(self) -> Callable[..., Any]:
        try:
            obj = self.entry_point.load()
        except Exception as e:  # any import-time failure is the plugin's, not ours
            raise PluginError(f"cannot load {self.describe()}: {type(e).__name__}: {e}") from e
        if not callable(obj):
            raise PluginError(f"{self.describe()} is not callable")
        return obj


@lru_cache(maxsize=None)
def discover(kind: str) -> tuple[PluginRef, ...]:
    """Every entry point of a kind, without importing any of them."""
    refs = []
    seen = set()
    for ep in entry_points(group=GROUPS[kind]):
        dist = getattr(ep, "dist", None)
        dname = dist.name if dist is not None else "unknown"
        version = dist.version if dist is not None else "?"
        key = (ep.name, dname, ep.value)
        if key in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(key)
        refs.append(PluginRef(kind, ep.name, dname, version, ep.value, ep))
    return tuple(sorted(refs, key=lambda r: (r.name, r.distribution)))


def names(kind: str) -> list[str]:
    return sorted({r.name for r in discover(kind)})


def find(kind: str, name: str) -> PluginRef:
    """Resolve `name` or `distribution:name`; clashes and typos are PluginErrors."""
    refs = discover(kind)
    if ":" in name:
        dist, _, short = name.partition(":")
        matches = [r for r in refs if r.name == short and _norm(r.distribution) == _norm(dist)]
        if not matches:
            choices = [r.qualified for r in refs]
            raise PluginError(f"no {kind} plugin '{name}'{did_you_mean(name, choices)}")
        return matches[0]
    matches = [r for r in refs if r.name == name]
    if not matches:
        avail = ", ".join(names(kind)) or "none installed"
        raise PluginError(f"unknown {kind} '{name}'{did_you_mean(name, names(kind))}; available: {avail}")
    dists = sorted({r.distribution for r in matches})
    if len(dists) > 1:
        picks = " or ".join(f"'{d}:{name}'" for d in dists)
        raise PluginError(
            f"{kind} name '{name}' is registered by several distributions ({', '.join(dists)}); "
            f"name one as {picks}"
        )
    return matches[0]


def _norm(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")


# ----------------------------------------------------------------------------- kwargs


def parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    target = fn.__init__ if inspect.isclass(fn) else fn  # type: ignore[misc]
    try:
        return typing.get_type_hints(target)
    except Exception:  # unresolvable forward references: fall back to Any
        return {}


def validate_kwargs(
    fn: Callable[..., Any], kwargs: dict[str, Any], skip: tuple[str, ...] = ()
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Check recipe kwargs against `fn`'s signature and type hints.

    Returns the coerced kwargs and a list of (key, message) problems. Done before
    any data is loaded, so a typo costs a second, not a download.
    """
    params = [p for p in parameters(fn) if p.kind not in (p.VAR_POSITIONAL,)]
    if inspect.isclass(fn) and params and params[0].name == "self":
        params = params[1:]
    hints = _hints(fn)
    accepts_any = any(p.kind == p.VAR_KEYWORD for p in params)
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind == p.VAR_KEYWORD or p.name in skip:
            continue
        ann = hints.get(p.name, Any if p.annotation is inspect.Parameter.empty else p.annotation)
        if isinstance(ann, str):
            ann = Any
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (ann, default)
    problems: list[tuple[str, str]] = []
    for k in kwargs:
        if k in skip:
            problems.append((k, "is filled in by the runner; remove it from the recipe"))
        elif k not in fields and not accepts_any:
            problems.append((k, f"unknown argument{did_you_mean(k, list(fields))}; accepted: {', '.join(fields) or 'none'}"))
    given = {k: v for k, v in kwargs.items() if k in fields}
    try:
        model = create_model(  # type: ignore[call-overload]
            "PluginKwargs",
            __config__=ConfigDict(arbitrary_types_allowed=True, extra="ignore"),
            **fields,
        )
        checked = model.model_validate(given)
    except ValidationError as e:
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            if err["type"] == "missing":
                problems.append((key, "required argument is missing"))
            else:
                problems.append((key, f"{err['msg']} (found {err.get('input')!r})"))
        return kwargs, problems
    except Exception:  # a hint pydantic cannot build a validator for: accept as-is
        return kwargs, problems
    out = {k: getattr(checked, k) for k in given}
    extra = {k: v for k, v in kwargs.items() if k not in fields and k not in skip and accepts_any}
    out.update(extra)
    return out, problems


# ----------------------------------------------------------------------------- optimizers


@lru_cache(maxsize=1)
def optimizers() -> dict[str, type]:
    import torch.optim

    out = {}
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            out[attr.lower()] = obj
    return out


def optimizer_class(name: str) -> type:
    opts = optimizers()
    key = name.lower()
    if key not in opts:
        raise PluginError(f"unknown optimizer '{name}'{did_you_mean(key, list(opts))}; available: {', '.join(sorted(opts))}")
    return opts[key]


def checkable_optimizer(name: str) -> Callable[..., Any]:
    """For argument checks only: torch.optim's class, or its stand-in read from source (no torch import)."""
    from mpsrun.plugins.signatures import optimizer_classes

    static = optimizer_classes()
    if static is None:
        return optimizer_class(name)
    # A name not found in the source is looked up in torch itself: "unknown" is always torch's verdict.
    return static.get(name.lower()) or optimizer_class(name)


# ----------------------------------------------------------------------------- recipe checks


def checkable(ref: PluginRef, listing: bool = False) -> Callable[..., Any]:
    """For argument checks and listings only: a built-in plugin's stand-in read from source
    (signature, hints, docstring; no torch import), else the loaded plugin (`signatures.py`)."""
    from mpsrun.plugins.signatures import builtin_plugin

    return builtin_plugin(ref.value, ref.distribution, listing) or ref.load()



def check_sections(src: RecipeSource) -> list[Problem]:
    """Names and kwargs of the dataset, model and optimizer sections, as Problems."""
    problems: list[Problem] = []
    for section in ("dataset", "model", "optimizer"):
        raw = src.data.get(section)
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            continue  # pydantic already reports the missing or wrong section
        name = raw["name"]
        kwargs = {k: v for k, v in raw.items() if k != "name"}
        try:
            if section == "optimizer":
                fn: Callable[..., Any] = checkable_optimizer(name)
                skip: tuple[str, ...] = ("params",)
            else:
                fn = checkable(find(section, name))
                skip = FILLED[section]
        except PluginError as e:
            problems.append(Problem(f"{section}.name", str(e), src.where((section, "name"))))
            continue
        _, errs = validate_kwargs(fn, kwargs, skip)
        for key, msg in errs:
            problems.append(Problem(f"{section}.{key}", msg, src.where((section, key.split(".")[0]))))
    return problems


def build(kind: str, name: str, kwargs: dict[str, Any], filled: dict[str, Any]) -> Any:
    """Call a plugin with validated kwargs plus the runner-filled ones it declares."""
    ref = find(kind, name)
    fn = ref.load()
    checked, errs = validate_kwargs(fn, kwargs, FILLED[kind])
    if errs:
        raise PluginError("; ".join(f"{kind}.{k}: {m}" for k, m in errs))
    declared = {p.name for p in parameters(fn)}
    extra = {k: v for k, v in filled.items() if k in declared}
    try:
        return fn(**checked, **extra)
    except (ValueError, FileNotFoundError) as e:
        # The contract: a plugin rejects bad arguments or missing data with these two,
        # and the user sees bad input (exit 2) naming the plugin, not a traceback.
        raise PluginError(f"{ref.describe()}: {e}") from e


def describe_all(kind: str) -> list[dict[str, Any]]:
    """Plugin facts for `mpsrun plugins`; a plugin that fails to import says why."""
    out = []
    for ref in discover(kind):
        info: dict[str, Any] = {
            "kind": kind,
            "name": ref.name,
            "distribution": ref.distribution,
            "version": ref.version,
            "entry_point": ref.value,
            "qualified": ref.qualified,
        }
        try:
            fn = checkable(ref, listing=True)
            info["signature"] = _signature_text(fn, FILLED[kind])
            info["parameters"] = _parameter_rows(fn, FILLED[kind])
            info["filled"] = [p.name for p in parameters(fn) if p.name in FILLED[kind]]
            doc = inspect.getdoc(fn) or ""
            info["summary"] = doc.strip().splitlines()[0] if doc.strip() else ""
            info["doc"] = doc
            info["error"] = None
        except PluginError as e:
            info.update(signature="", parameters=[], filled=[], summary="", doc="", error=str(e))
        out.append(info)
    return out


def matches(info: dict[str, Any], query: str) -> bool:
    """Does a describe_all row answer to `name` or `distribution:name` (spelled loosely)?"""
    if ":" in query:
        dist, _, short = query.partition(":")
        return info["name"] == short and _norm(info["distribution"]) == _norm(dist)
    return info["name"] == query


def _parameter_rows(fn: Callable[..., Any], filled: tuple[str, ...]) -> list[dict[str, Any]]:
    """The recipe-settable parameters, structured for tools (editors, `--json` readers)."""
    import json

    rows = []
    for p in parameters(fn):
        if p.name in filled or p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation
        row: dict[str, Any] = {
            "name": p.name,
            "type": None if ann is inspect.Parameter.empty else (ann if isinstance(ann, str) else inspect.formatannotation(ann)),
            "required": p.default is inspect.Parameter.empty,
        }
        if p.default is not inspect.Parameter.empty:
            try:
                json.dumps(p.default)
                row["default"] = p.default
            except (TypeError, ValueError):
                row["default"] = repr(p.default)
        rows.append(row)
    return rows


def _signature_text(fn: Callable[..., Any], filled: tuple[str, ...]) -> str:
    parts = []
    for p in parameters(fn):
        if p.name in filled or p.name == "self":
            continue
        s = p.name
        if p.annotation is not inspect.Parameter.empty:
            ann = p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)
            s += f": {ann}"
        if p.default is not inspect.Parameter.empty:
            s += f" = {p.default!r}"
        parts.append(s)
    return ", ".join(parts)
