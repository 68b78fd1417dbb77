"""The bottom of the recipe wing: problems, their positions, did-you-mean and YAML loading.

Everything that reports on a recipe (the Pydantic models, overrides, matrices and the
plugin argument checks in `mpsrun.plugins`) imports this module and nothing above it,
so the wings stay free of import circles.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


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


class Loader(yaml.SafeLoader):
    """Safe loading with YAML 1.2's scalars, which is what users read in the docs of every
    other tool: `lr: 1e-3` is a number (PyYAML's 1.1 rules make it the string '1e-3'),
    and only `true`/`false` are booleans, so `canary: on` or `answer: no` stay strings
    instead of silently turning into True/False."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
# Start from SafeLoader's resolvers without the YAML 1.1 bool (yes/no/on/off/y/n).
Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
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


# Hostile input. YAML aliases let a few hundred bytes stand for billions of nodes
# (nine levels of ten aliases: 10**9), and everything that walks the loaded recipe
# (positions, validation, printing) expands them: minutes and gigabytes before any
# error. A recipe is a few dozen keys, so both bounds sit far above any real one.
MAX_RECIPE_BYTES = 1 << 20  # 1 MiB of YAML
MAX_YAML_NODES = 100_000  # nodes once every alias is expanded


class YAMLTooLarge(yaml.YAMLError):
    """The document would expand past MAX_YAML_NODES (or refers to itself)."""

    def __init__(self, problem: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


def check_expansion(node: yaml.Node | None, limit: int = MAX_YAML_NODES) -> int:
    """Count the nodes `node` stands for with every alias expanded, without expanding them.

    Aliases share node objects, so sizes are memoised per object: linear in the
    document, whatever it expands to. Raises YAMLTooLarge past `limit`, or on a
    node that contains itself.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(n: yaml.Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise YAMLTooLarge("a YAML alias refers to a node that contains it (a recursive recipe)", n.start_mark)
        active.add(key)
        total = 1
        if isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        elif isinstance(n, yaml.SequenceNode):
            children = list(n.value)
        else:
            children = []
        for c in children:
            total += size(c)
            if total > limit:
                raise YAMLTooLarge(
                    f"the YAML expands to more than {limit:,} nodes once its aliases (*name) are expanded "
                    "(an alias bomb?); a recipe is a few dozen keys",
                    n.start_mark,
                )
        active.discard(key)
        sizes[key] = total
        return total

    return size(node) if node is not None else 0


def yaml_compose_load(text: str) -> tuple[yaml.Node | None, Any]:
    """One parse: the node tree (for positions) and the data, with alias expansion bounded."""
    loader = Loader(text)
    try:
        node = loader.get_single_node()
        check_expansion(node)
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return node, data


def yaml_load(text: str) -> Any:
    """Safe, YAML 1.2 scalars, alias expansion bounded (raises yaml.YAMLError)."""
    return yaml_compose_load(text)[1]


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
