"""The documentation site builds, strictly, and says what the code has.

`mkdocs build --strict` (the `docs` extra; `.ci/run` installs it) fails on a broken link, a missing
page, a missing picture or a reference page that no longer generates. The site is built once, into a
temporary folder, and the checks below read the built pages: the CLI reference names every command
and option of the Typer app, the recipe reference every field of the Pydantic models, the guides show
every command in use and name every top-level recipe key, and every maintained benchmark is named.
The README stays a screen or two and runs the commands CI runs.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "scripts"))

import refgen  # noqa: E402  (docs/scripts/refgen.py: what the reference pages are generated from)

MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocs_gen_files") if importlib.util.find_spec(m) is None]
needs_mkdocs = pytest.mark.skipif(bool(MISSING), reason=f"the docs extra is not installed ({', '.join(MISSING)}): pip install -e '.[docs]'")


def _text(page: Path) -> str:
    """A built page's visible text (tags dropped, entities read), one line per line of HTML."""
    raw = page.read_text()
    raw = re.sub(r"<(script|style)\b.*?</\1>", "", raw, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return out


def _guides(site: Path) -> str:
    """Every built page but the generated reference: where things are shown in use."""
    return "\n".join(_text(p) for p in site.rglob("*.html") if "reference" not in p.parts)


@needs_mkdocs
def test_cli_reference_lists_every_command_and_option(site: Path) -> None:
    page = _text(site / "reference" / "cli" / "index.html")
    missing = []
    for path, cmd in list(refgen.walk_commands(refgen.cli_root()))[1:]:
        name = " ".join(path)
        if name not in page:
            missing.append(name)
        for p in cmd.params:
            for opt in p.opts if p.param_type_name == "option" else [p.name]:
                if opt not in page:
                    missing.append(f"{name} {opt}")
    assert missing == []


@needs_mkdocs
def test_recipe_reference_lists_every_field_with_a_description(site: Path) -> None:
    page = _text(site / "reference" / "recipe" / "index.html")
    fields = refgen.recipe_fields()
    assert "Recipe" in fields and len(fields) > 5
    missing = [f"{model}.{f}" for model, names in fields.items() for f in names if f"{f}" not in page]
    assert missing == []
    from mpsrun.recipe.augment import OPS
    from mpsrun.recipe.model import Recipe

    models = {"Recipe": Recipe}
    refgen._nested_models(Recipe, models)
    undescribed = [f"{n}.{f}" for n, m in [*models.items(), *OPS.items()] for f, info in m.model_fields.items() if not info.description]
    assert undescribed == [], "a recipe key without a description: give its Field a description= (it is the reference's text)"
    assert [op for op in OPS if op not in page] == []


@needs_mkdocs
def test_guides_name_every_top_level_recipe_key(site: Path) -> None:
    text = _guides(site)
    from mpsrun.recipe.model import Recipe

    assert [k for k in Recipe.model_fields if not re.search(rf"\b{re.escape(k)}\b", text)] == []


@needs_mkdocs
def test_guides_show_every_command_in_use(site: Path) -> None:
    """Each command appears in a code block of a guide, as typed: `mpsrun plugins show ...`."""
    blocks = []
    for p in site.rglob("*.html"):
        if "reference" in p.parts:
            continue
        blocks += [html.unescape(re.sub(r"<[^>]+>", "", b)) for b in re.findall(r"<code[^>]*>(.*?)</code>", p.read_text(), flags=re.S)]
    code = "\n".join(blocks)
    assert [c for c in refgen.command_names() if not re.search(rf"(^|\s|`|/){re.escape(c)}(\s|$|`)", code, re.M)] == []


@needs_mkdocs
def test_every_benchmark_is_named_in_the_docs_and_there_are_at_most_twelve(site: Path) -> None:
    files = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.is_file())
    assert len(files) <= 12, f"benchmarks/ keeps the maintained benchmarks only (one per headline figure): {files}"
    text = "\n".join(_text(p) for p in site.rglob("*.html"))
    assert [f for f in files if f"benchmarks/{f}" not in text] == []


@needs_mkdocs
def test_pictures_are_in_the_site(site: Path) -> None:
    """The screenshots the guides show (tests/test_docs_shots.py refreshes them) are real PNGs."""
    shots = sorted((ROOT / "docs" / "images").glob("*.png"))
    assert {p.name for p in shots} >= {"run_model_metrics.png", "sweep_figures.png", "bench_table.png"}
    for p in shots:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, p
        assert (site / "images" / p.name).is_file()


def test_reference_pages_are_generated_without_torch_or_mlflow() -> None:
    """The reference is built on any machine, quickly: no GPU, no torch, no MLflow import behind it."""
    code = ("import sys; sys.path.insert(0, 'docs/scripts'); import refgen; r = refgen.recipe_page(); c = refgen.cli_page(); "
            "heavy = [m for m in ('torch', 'mlflow', 'optuna', 'sklearn', 'matplotlib') if m in sys.modules]; "
            "assert not heavy, heavy; assert '`mpsrun run`' in c and '`batch_size`' in r and '`digits`' in r, 'pages incomplete'")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_environment_page_names_every_variable_the_code_reads() -> None:
    names = set()
    for f in (ROOT / "src" / "mpsrun").rglob("*.py"):
        names |= set(re.findall(r"MPSRUN_[A-Z0-9_]*[A-Z0-9]", f.read_text()))
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    assert sorted(n for n in names if n not in page) == [], "say what each variable does in docs/reference/environment.md"


def test_readme_is_short_and_runs_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    block = re.search(r"## Set up and run \(two commands\)\n\n```bash\n(.*?)\n```", readme, re.S)
    assert block, "the README's two commands are gone"
    setup, test = block.group(1).splitlines()
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"^\.venv/bin/pip install -q (-e \S+)$", ci, re.M)
    assert install and f".venv/bin/pip install {shlex.split(install.group(1))[0]} {install.group(1).split(' ', 1)[1]}" in setup
    assert setup.startswith("python3 -m venv .venv && ") and "python3 -m venv .venv" in ci
    assert re.search(rf"^{re.escape(test)}$", ci, re.M), f"CI does not run the README's test command {test!r}"
