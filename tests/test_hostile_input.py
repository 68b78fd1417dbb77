"""Hostile recipes: an alias bomb and an over-large file are refused fast, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from mpsrun.recipe import RecipeError, load_source, yaml_load
from mpsrun.recipe.problems import MAX_RECIPE_BYTES, MAX_YAML_NODES

from .proc_helpers import MPSRUN, clean_env


def bomb(levels: int = 9, width: int = 10) -> str:
    """The billion laughs in YAML: `levels` nested levels of `width` aliases each."""
    lines = ["a0: &a0 [" + ",".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_exits_2_fast(tmp_path: Path, work) -> None:  # type: ignore[no-untyped-def]
    """Nine levels of ten aliases (10**9 nodes): the real CLI says so in seconds (the issue's bound: 15 s)."""
    p = tmp_path / "bomb.yaml"
    p.write_text(bomb())
    t = time.monotonic()
    r = subprocess.run([MPSRUN, "validate", str(p)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t
    assert r.returncode == 2, r.stdout + r.stderr
    assert took < 15, took
    assert "alias" in r.stderr and "bomb.yaml" in r.stderr and "Traceback" not in r.stderr
    t = time.monotonic()
    r2 = work.cli("run", p)
    assert r2.exit_code == 2 and "alias" in r2.output and time.monotonic() - t < 5
    assert not work.runs("bomb")


def test_alias_bomb_in_process_is_linear() -> None:
    """The check itself costs nothing: even 10**18 nodes are measured without expanding them."""
    t = time.monotonic()
    with pytest.raises(RecipeError, match="alias"):
        load_source_text(bomb(levels=18))
    assert time.monotonic() - t < 2


def load_source_text(text: str) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    load_source(f.name)


def test_aliases_within_the_bound_still_work(tmp_path: Path) -> None:
    """Ordinary anchors (a shared optimizer block) load as before."""
    data = yaml_load("base: &b {name: sgd, lr: 0.1}\noptimizer: *b\nlist: [*b, *b]\n")
    assert data["optimizer"] == {"name": "sgd", "lr": 0.1} and len(data["list"]) == 2
    just_under = "a0: &a0 [" + ",".join(["x"] * 100) + "]\nb: [" + ",".join(["*a0"] * (MAX_YAML_NODES // 102 - 2)) + "]\n"
    assert len(yaml_load(just_under)["b"]) == MAX_YAML_NODES // 102 - 2


def test_bomb_in_an_override_is_refused(tmp_path: Path) -> None:
    """`key=value` values are YAML too: the same bound applies."""
    from .conftest import RECIPES

    r = subprocess.run(
        [MPSRUN, "validate", str(RECIPES / "digits_mlp.yaml"), "tracking.tags.x=" + "{" + bomb(levels=9).replace("\n", ", ").rstrip(", ") + "}"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "alias" in r.stderr, r.stdout + r.stderr


def test_recursive_alias_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "loop.yaml"
    p.write_text("a: &a [1, *a]\n")
    with pytest.raises(RecipeError, match="contains it|alias"):
        load_source(p)


def test_oversize_file_exits_2(tmp_path: Path) -> None:
    p = tmp_path / "huge.yaml"
    p.write_text("epochs: 1\n" + "# padding\n" * (MAX_RECIPE_BYTES // 10 + 1))
    r = subprocess.run([MPSRUN, "validate", str(p)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "huge.yaml" in r.stderr and "limit" in r.stderr and "Traceback" not in r.stderr
