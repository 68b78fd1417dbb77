"""The reference pages, written from the code at build time (mkdocs-gen-files runs gen_reference.py).

Why generated: a reference written by hand drifts from the code it describes. These pages are
built from the objects `mpsrun` itself uses: the Pydantic `Recipe` model (the same one that
validates recipes and writes `mpsrun schema`) and the Typer app behind the `mpsrun` command.
Neither import pulls in torch or MLflow (the CLI keeps them off `--help`'s path), so the site
builds in seconds on a machine without a GPU.
"""

from __future__ import annotations

import inspect

import typing
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

# --------------------------------------------------------------------------- recipe reference


def _type_name(tp: Any) -> str:
    """A Python annotation as a reader writes it in YAML terms: `int`, `"auto" | bool`, `list[str]`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return "(its own defaults)"
        return f"`{value!r}`" if value not in ([], {}) else ("`[]`" if value == [] else "`{}`")
    if field.default is PydanticUndefined:
        return "**required**"
    if field.default is None:
        return "`null`"
    if isinstance(field.default, bool):
        return f"`{str(field.default).lower()}`"
    if isinstance(field.default, tuple):
        return f"`{list(field.default)!r}`"
    return f"`{field.default!r}`" if not isinstance(field.default, str) else f"`{field.default}`"


def _constraints(field: Any) -> str:
    """ge/gt/le/min_length and patterns, said in words next to the type."""
    said = []
    names = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "at least", "pattern": "matches"}
    for m in field.metadata:
        for attr, word in names.items():
            value = getattr(m, attr, None)
            if value is not None:
                said.append(f"{word} `{value}`" if attr != "min_length" else f"at least {value} item(s)")
    return ", ".join(said)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _field_rows(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        desc = field.description or ""
        cons = _constraints(field)
        type_text = _type_name(field.annotation)
        yield f"| `{prefix}{name}` | {_cell(type_text)}{' (' + _cell(cons) + ')' if cons else ''} | {_cell(_default(field))} | {_cell(desc)} |"


def _nested_models(model: type[BaseModel], seen: dict[str, type[BaseModel]]) -> None:
    for field in model.model_fields.values():
        for tp in _walk_types(field.annotation):
            if isinstance(tp, type) and issubclass(tp, BaseModel) and tp.__name__ not in seen:
                seen[tp.__name__] = tp
                _nested_models(tp, seen)


def _walk_types(tp: Any) -> Iterator[Any]:
    yield tp
    for a in typing.get_args(tp):
        yield from _walk_types(a)


def recipe_fields() -> dict[str, list[str]]:
    """Every section's field names, by model name (`Recipe` first): what the page lists."""
    from mpsrun.recipe.model import Recipe

    models: dict[str, type[BaseModel]] = {"Recipe": Recipe}
    _nested_models(Recipe, models)
    return {n: list(m.model_fields) for n, m in models.items()}


def recipe_page() -> str:
    """docs/reference/recipe.md: every key of a recipe, its type, default and description."""
    from mpsrun.recipe.augment import OPS
    from mpsrun.recipe.model import Recipe

    models: dict[str, type[BaseModel]] = {"Recipe": Recipe}
    _nested_models(Recipe, models)
    out = [
        "# Recipe reference",
        "",
        "Generated at build time from the Pydantic models that validate every recipe",
        "(`src/mpsrun/recipe/model.py`); `mpsrun schema` prints the same models as a JSON Schema for editors",
        "(`docs/recipe.schema.json`). Unknown keys are errors with file, line, column and a did-you-mean;",
        "`mpsrun validate RECIPE` checks a recipe without running it. A guided tour of these keys is",
        "[Recipes](../guides/recipes.md).",
        "",
        "## Top-level keys",
        "",
        "| key | type | default | description |",
        "| --- | --- | --- | --- |",
        *_field_rows(Recipe),
        "",
        "Sections written `{name: ..., <arguments>}` (`dataset`, `model`, `optimizer`, `loss`, `scheduler`, `callbacks`)",
        "take that plugin's keyword arguments flat beside `name`, checked against its signature before anything",
        "heavy starts: `mpsrun plugins show NAME` lists them, and [Built-in plugins](#built-in-plugins) below.",
        "",
    ]
    for name, model in models.items():
        if name == "Recipe":
            continue
        doc = inspect.cleandoc(model.__doc__ or "") if model.__doc__ and model.__doc__ is not BaseModel.__doc__ else ""
        out += [f"## {name}", "", *(doc.splitlines()), "" if doc else "",
                "| key | type | default | description |", "| --- | --- | --- | --- |", *_field_rows(model), ""]
    out += ["## Augmentations", "", "Each entry of `augment:` is `{name: ..., <arguments>}` with one of these names:", ""]
    for op, model in OPS.items():
        doc = inspect.cleandoc(model.__doc__) if model.__doc__ else ""
        out += [f"### `{op}`", "", doc, "", "| argument | type | default | description |", "| --- | --- | --- | --- |",
                *_field_rows(model), ""]
    out += builtin_plugins_section()
    return "\n".join(out) + "\n"


def builtin_plugins_section() -> list[str]:
    """The built-in models and datasets with their parameters, read from source (no torch import)."""
    try:
        from mpsrun.plugins import registry
    except Exception as exc:  # pragma: no cover - said on the page rather than failing the build
        return ["## Built-in plugins", "", f"(not generated: {exc})", ""]
    out = ["## Built-in plugins", "",
           "The models and datasets mpsrun ships, registered through the same entry points as any plugin",
           "(`mpsrun plugins` lists every installed one, yours included; [Writing a plugin](../plugins.md)).",
           "Parameters marked *filled in* come from the dataset or the recipe (the number of classes, the input's",
           "shape, the seed), not from the recipe's section.", ""]
    rows = _builtin_rows(registry)
    if not rows:
        return out + ["(no built-in plugin found in this environment's entry points)", ""]
    for kind, entries in rows.items():
        out += [f"### {kind.capitalize()}s", "", "| name | parameters | what it is |", "| --- | --- | --- |"]
        for name, params, doc in entries:
            out.append(f"| `{name}` | {_cell(params)} | {_cell(doc)} |")
        out.append("")
    return out


def _builtin_rows(registry: Any) -> dict[str, list[tuple[str, str, str]]]:
    from importlib.metadata import entry_points

    rows: dict[str, list[tuple[str, str, str]]] = {}
    for kind, group in (("model", "mpsrun.models"), ("dataset", "mpsrun.datasets")):
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            if not ep.value.startswith("mpsrun.plugins.builtin"):
                continue
            params, doc = _signature_from_source(ep.value, FILLED[kind])
            rows.setdefault(kind, []).append((ep.name, params, doc))
    return rows


# Parameters the runner fills in itself (Writing a plugin, "Parameters the runner fills in"): not recipe keys.
FILLED = {"model": {"num_classes", "input_shape", "num_outputs", "data_info"}, "dataset": {"seed", "recipe_dir"}}


def _signature_from_source(value: str, filled: set[str] = frozenset()) -> tuple[str, str]:  # type: ignore[assignment]
    """`module:function` -> its parameters and the first line of its docstring, by reading the source (ast)."""
    import ast
    import importlib.util

    module, _, attr = value.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "", ""
    tree = ast.parse(open(spec.origin).read())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == attr:
            fn = node
            if isinstance(node, ast.ClassDef):
                fn = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            params = []
            if isinstance(fn, ast.FunctionDef):
                args = fn.args
                positional = args.posonlyargs + args.args
                defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
                pairs = list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
                for a, d in pairs:
                    if a.arg in ("self",):
                        continue
                    ann = f": {ast.unparse(a.annotation)}" if a.annotation is not None else ""
                    text = f"`{a.arg}{ann}{' = ' + ast.unparse(d) if d is not None else ''}`"
                    params.append(f"{text} (filled in)" if a.arg in filled else text)
            doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
            return ", ".join(params), doc
    return "", ""


# --------------------------------------------------------------------------- CLI reference


def cli_root() -> Any:
    """The click command Typer builds for `mpsrun` (the same object `mpsrun --help` prints)."""
    import typer.main

    from mpsrun.cli import app

    return typer.main.get_command(app)


def walk_commands(cmd: Any, path: tuple[str, ...] = ("mpsrun",)) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command and sub-command, depth first, in the order `--help` lists them."""
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from walk_commands(sub, path + (name,))


def _usage(path: tuple[str, ...], cmd: Any) -> str:
    pieces = [" ".join(path)]
    if any(p.param_type_name == "option" for p in cmd.params):
        pieces.append("[OPTIONS]")
    for p in cmd.params:
        if p.param_type_name != "argument":
            continue
        text = p.name.upper() + ("..." if p.nargs == -1 else "")
        pieces.append(text if p.required else f"[{text}]")
    if getattr(cmd, "commands", None):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(pieces)


def cli_page() -> str:
    """docs/reference/cli.md: every command, its usage, arguments and options, from the Typer app."""
    import typer._click as click  # Typer's own copy of click (typer >= 0.20)

    root = cli_root()
    out = ["# CLI reference", "",
           "Generated at build time from the Typer app behind the `mpsrun` command (`src/mpsrun/cli/`):",
           "what `mpsrun COMMAND --help` prints, every command and option. The guides show them in use;",
           "[Commands at a glance](../guides/commands.md) says what each is for in a line.", "",
           "Exit codes, for every command: 0 done, 2 bad input (recipe, override, CLI, unusable device, missing data,",
           "a run that cannot be resumed, an unreachable tracking server), 1 failure while running,",
           "130 interrupted (SIGINT), 143 terminated (SIGTERM).", "",
           "| command | what it does |", "| --- | --- |"]
    entries = list(walk_commands(root))
    for path, cmd in entries[1:]:
        anchor = "-".join(path)
        out.append(f"| [`{' '.join(path)}`](#{anchor}) | {_cell((cmd.help or '').strip().splitlines()[0] if cmd.help else '')} |")
    out.append("")
    contexts: dict[tuple[str, ...], Any] = {}
    for path, cmd in entries:
        parent = contexts.get(path[:-1])
        ctx = click.Context(cmd, info_name=path[-1], parent=parent)
        contexts[path] = ctx
        if len(path) == 1:
            continue
        level = "#" * min(len(path), 4)
        out += [f"{level} `{' '.join(path)}` {{#{'-'.join(path)}}}", "", "```text", _usage(path, cmd), "```", ""]
        if cmd.help:
            out += [inspect.cleandoc(cmd.help), ""]
        rows = []
        for p in cmd.params:
            record = p.get_help_record(ctx)
            if record is None:
                continue
            flags, help_text = record
            kind = "argument" if p.param_type_name == "argument" else "option"
            rows.append(f"| `{_cell(flags)}` | {kind} | {_cell(help_text)} |")
        if rows:
            out += ["| name | kind | description |", "| --- | --- | --- |", *rows, ""]
        if getattr(cmd, "commands", None):
            out += ["Sub-commands: " + ", ".join(f"[`{' '.join(path + (n,))}`](#{'-'.join(path + (n,))})" for n in cmd.commands), ""]
    return "\n".join(out) + "\n"


def command_names() -> list[str]:
    """`mpsrun run`, `mpsrun plugins show`, ...: every command a user can type."""
    return [" ".join(p) for p, _ in list(walk_commands(cli_root()))[1:]]


