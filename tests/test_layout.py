"""The package's shape: wings with one job, imports only going down, no circles, small modules.

Read from the source with `ast` (nothing is imported), so a new module that breaks
the rule fails here rather than in a reader's head.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mpsrun.recipe import RecipeError, yaml_load

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "mpsrun"
MAX_LINES = 500
MAX_MODULES = 12  # modules side by side in one folder (its __init__ not counted)

# A wing may import the wings below it (and itself), never one above.
ALLOWED = {
    "cli": {"exitcodes", "cli", "bench", "sweep", "train", "devices", "plugins", "recipe", "track", "top"},
    "sweep": {"exitcodes", "sweep", "train", "devices", "plugins", "recipe", "track", "top"},  # Optuna trials through the runner
    "bench": {"bench", "train", "devices", "plugins", "recipe", "track", "top"},
    "train": {"exitcodes", "train", "devices", "plugins", "recipe", "track", "top"},
    "devices": {"devices", "train", "plugins", "recipe", "track", "top"},  # parity drives a training replica
    "plugins": {"plugins", "recipe", "top"},
    "track": {"track", "top"},
    "recipe": {"recipe"},
    "testing": {"testing"},
    "exitcodes": set(),  # the bottom: exit codes every wing may share
    "top": {"plugins", "cli", "train", "top"},  # __init__ (the public DataSplits, Callback) and __main__
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """mpsrun modules that `name` imports: at module level, inside functions, or under
    `TYPE_CHECKING` (a circle closed only by type hints is still two modules read together)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in known and t != name:
                out.add(t)
    return out


def _wing(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return "top"
    return parts[1] if parts[1] != "cli" else "cli"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def test_no_module_is_over_500_lines() -> None:
    long = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert {m: n for m, n in long.items() if n > MAX_LINES} == {}


def test_no_folder_holds_more_than_12_modules() -> None:
    crowded = {}
    for folder in [PKG, *(p for p in PKG.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        mods = [m for m in folder.glob("*.py") if m.name != "__init__.py"]
        if len(mods) > MAX_MODULES:
            crowded[str(folder.relative_to(SRC))] = len(mods)
    assert crowded == {}


def test_sub_wings_form_a_ladder() -> None:
    """Folders inside a wing (train/loop, train/keep, track/store, ...) import each other one
    way only: a reader can take them bottom to top, each folder readable without the ones above."""
    graph = _graph()
    edges: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        a = _folder(mod)
        for d in deps:
            b = _folder(d)
            if a != b and not a.startswith(b + ".") and not b.startswith(a + "."):
                edges.setdefault(a, set()).add(b)
    both = sorted(f"{a} <-> {b}" for a, bs in edges.items() for b in bs if a < b and a in edges.get(b, set()))
    assert both == []


def _folder(module: str) -> str:
    """The package a module sits in (a package's __init__ sits in the package itself)."""
    path = _modules()[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def test_imports_only_go_down_between_wings() -> None:
    wrong = []
    for mod, deps in _graph().items():
        w = _wing(mod)
        for d in deps:
            if _wing(d) not in ALLOWED[w]:
                wrong.append(f"{mod} -> {d}")
    assert wrong == []


def test_no_import_circles() -> None:
    graph = _graph()
    # a package's __init__ importing its own submodules is how packages re-export; a
    # submodule importing back up into its package's __init__ is the circle that bites.
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_recipe_wing_never_imports_plugins_training_or_mlflow() -> None:
    graph = _graph()
    for mod, deps in graph.items():
        if mod.startswith("mpsrun.recipe"):
            assert {d for d in deps if not d.startswith("mpsrun.recipe")} == set(), mod
            tree = ast.parse(_modules()[mod].read_text())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not names & {"torch", "mlflow"}, mod


def test_yaml_booleans_are_yaml_1_2() -> None:
    data = yaml_load("a: on\nb: off\nc: yes\nd: no\ne: true\nf: False\ng: 1e-3\nh: y\n")
    assert data == {"a": "on", "b": "off", "c": "yes", "d": "no", "e": True, "f": False, "g": 1e-3, "h": "y"}


def test_canary_on_off_need_no_per_field_workaround(work) -> None:
    from tests.conftest import RECIPES

    text = (RECIPES / "digits_mlp.yaml").read_text()
    for value in ("on", "off", "warn"):
        p = work.write(f"c_{value}.yaml", text + f"canary: {value}\n")
        r = work.cli("validate", p)
        assert r.exit_code == 0, r.output
    # a bool where a string is expected is now reported, not silently mapped
    p = work.write("c_bool.yaml", text + "canary: true\n")
    r = work.cli("validate", p)
    assert r.exit_code == 2 and "canary" in r.stderr


def test_bool_fields_still_read_yes_no_and_string_fields_keep_them(work) -> None:
    """YAML keeps `no` a string; a boolean field still reads it as False (Pydantic's rule), and a
    string field (a tag) keeps 'no' instead of the 'False' YAML 1.1 would have made of it."""
    from mpsrun.plugins import resolve
    from tests.conftest import RECIPES

    text = (RECIPES / "digits_mlp.yaml").read_text().replace("tracking:", "tracking:\n  log_model: no\n  tags: {answer: no}", 1)
    r = resolve(work.write("t.yaml", text)).recipe
    assert r.tracking.log_model is False
    assert r.tracking.tags == {"answer": "no"}


def test_design_layout_table_names_every_sub_wing() -> None:
    """The design page's layout table is how a newcomer finds a room: every folder has its row."""
    design = (SRC.parent / "docs" / "design.md").read_text()
    table = design[design.index("## Code layout"):]
    table = table[: table.index("\n## ", 3)] if "\n## " in table[3:] else table
    missing = []
    for folder in sorted(p for p in PKG.rglob("*") if p.is_dir() and (p / "__init__.py").exists()):
        rel = str(folder.relative_to(PKG)) + "/"
        if f"`{rel}`" not in table and f"`{folder.name}/`" not in table:
            missing.append(rel)
    assert missing == []
