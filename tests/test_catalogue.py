"""The plugin catalogue: built-ins, the recipe schema, the scaffold, the example package, the docs.

Plugin packages are really built and pip-installed (offline: --no-index, and
--no-build-isolation with the hatchling that the `dev` extra installs) into a
temporary --target folder put on sys.path / PYTHONPATH, so the test venv is never
modified and nothing leaks between tests.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mpsrun.recipe import yaml_load

from .conftest import RECIPES, ROOT, _clear_plugin_cache, run_subprocess

EXAMPLE = ROOT / "examples" / "mpsrun-plugin-example"
DOCS = ROOT / "docs" / "plugins.md"
SCHEMA_FILE = ROOT / "docs" / "recipe.schema.json"
TINY = """
from torch import nn

def tiny(input_shape: tuple, num_classes: int, width: int = 16):
    '''A tiny model for tests.'''
    import math
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(), nn.Linear(width, num_classes))
"""


def pip_install(src: Path, site: Path) -> None:
    """Build and install a package the way pip does, offline, into `site` only."""
    if importlib.util.find_spec("hatchling") is None:
        pytest.fail("hatchling is missing: install the dev extra (pip install -e '.[dev]')")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(site), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture
def install(tmp_path: Path):  # type: ignore[no-untyped-def]
    """pip-install a package into a temp site folder and make it importable in-process."""
    sites: list[str] = []
    before = set(sys.modules)

    def _install(src: Path) -> Path:
        site = tmp_path / f"site{len(sites)}"
        pip_install(src, site)
        sys.path.insert(0, str(site))
        sites.append(str(site))
        _clear_plugin_cache()
        return site

    yield _install
    for s in sites:
        sys.path.remove(s)
    # everything imported from the sites, namespace packages (no __file__) included
    tops = {p.name.split(".")[0] for s in sites for p in Path(s).iterdir() if not p.name.endswith(("-info", "__pycache__"))}
    for mod in set(sys.modules) - before:
        if mod.split(".")[0] in tops:
            del sys.modules[mod]
    _clear_plugin_cache()


def last(work, run, key: str) -> float:  # type: ignore[no-untyped-def]
    return work.history(run.info.run_id, key)[-1][1]


# ----------------------------------------------------------------------------- catalogue CLI


def test_plugins_json_lists_builtins_with_structured_parameters(work) -> None:
    r = work.cli("plugins", "--json")
    assert r.exit_code == 0, r.output
    rows = {(x["kind"], x["name"]): x for x in json.loads(r.stdout)}
    for key in [("model", "cnn"), ("model", "mlp"), ("model", "tabular_mlp"), ("dataset", "tabular"), ("dataset", "synthetic")]:
        assert rows[key]["distribution"] == "mpsrun" and rows[key]["error"] is None, key
        assert rows[key]["qualified"] == f"mpsrun:{key[1]}"
        assert rows[key]["summary"], key
    params = {p["name"]: p for p in rows[("model", "cnn")]["parameters"]}
    assert params["channels"] == {"name": "channels", "type": "list[int]", "required": False, "default": [32, 64]}
    assert "input_shape" not in params and rows[("model", "cnn")]["filled"] == ["input_shape", "num_classes"]
    assert rows[("model", "tabular_mlp")]["filled"] == ["input_shape", "num_classes", "data_info", "num_outputs"]
    tab = {p["name"]: p for p in rows[("dataset", "tabular")]["parameters"]}
    assert tab["path"]["required"] and tab["target"]["required"] and not tab["val_path"]["required"]
    assert "recipe_dir" not in tab and rows[("dataset", "tabular")]["filled"] == ["seed", "recipe_dir"]


def test_plugins_kind_filter(work) -> None:
    r = work.cli("plugins", "--json", "--kind", "dataset")
    assert r.exit_code == 0
    kinds = {x["kind"] for x in json.loads(r.stdout)}
    assert kinds == {"dataset"}
    r = work.cli("plugins", "--kind", "optimizer")
    assert r.exit_code == 2 and "model, dataset, callback or loss" in r.stderr


def test_plugins_show_prints_type_hints_and_filled_parameters(work) -> None:
    r = work.cli("plugins", "show", "mpsrun:cnn")
    assert r.exit_code == 0, r.output
    # list[int] used to vanish: rich read "[int]" as a markup tag
    assert "channels: list[int] = [32, 64]" in r.stdout
    assert "filled in by the runner: input_shape, num_classes" in r.stdout
    assert "any" in r.stdout and "C x H x W" in r.stdout  # the docstring in full
    r = work.cli("plugins", "show", "mlp")
    assert r.exit_code == 0 and "hidden: list[int] = [512, 512]" in r.stdout


def test_clash_in_show_and_run_then_distribution_prefix_trains(work, fake_dist) -> None:
    fake_dist("lab-a", TINY, models={"tiny": "tiny"})
    fake_dist("lab-b", TINY, models={"tiny": "tiny"}, version="2.0")
    r = work.cli("plugins", "show", "tiny")
    assert r.exit_code == 0
    assert "from lab-a 0.1" in r.stdout and "from lab-b 2.0" in r.stdout and "lab-a:tiny or lab-b:tiny" in r.stdout
    r = work.cli("plugins", "show", "lab_b:tiny")  # spelled as pip would accept it
    assert r.exit_code == 0 and "lab-b 2.0" in r.stdout and "lab-a" not in r.stdout
    recipe = work.write("clash.yaml", "dataset: {name: digits}\nmodel: {name: tiny}\noptimizer: {name: adam}\ndevice: cpu\n")
    r = work.cli("run", recipe, "-q")
    assert r.exit_code == 2
    assert "lab-a" in r.stderr and "lab-b" in r.stderr and "'lab-b:tiny'" in r.stderr
    assert not work.runs("clash")
    r = work.cli("run", recipe, "model.name=lab-b:tiny", "-q")
    assert r.exit_code == 0, r.output
    assert work.runs("clash")[0].data.tags["plugin.model"] == "lab-b 2.0 (lab_b_mod:tiny)"


def test_value_error_from_a_plugin_is_bad_input_naming_it(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "dataset.val_fraction=2", "-q")
    assert r.exit_code == 2
    assert "dataset plugin 'digits'" in r.stderr and "from distribution mpsrun" in r.stderr and "val_fraction" in r.stderr
    assert "Traceback" not in r.output
    assert not work.runs("digits_mlp")


# ----------------------------------------------------------------------------- cnn, synthetic


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8), (2, 9, 13)])
def test_cnn_fits_any_chw(shape) -> None:
    from mpsrun.plugins.builtin.cnn import cnn

    model = cnn(shape, 7)
    assert model(torch.zeros(5, *shape)).shape == (5, 7)


def test_cnn_rejects_inputs_too_small_for_its_stages(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "model.name=cnn", "model.hidden=16", "model.channels=[4,4,4,4]", "-q")
    assert r.exit_code == 2
    assert "too small for 4 stages" in r.stderr and "1x1" in r.stderr


def test_cnn_trains_on_digits(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "model.name=cnn", "model.hidden=64", "model.channels=[16,32]", "epochs=3", "-q")
    assert r.exit_code == 0, r.output
    run = work.runs("digits_mlp")[0]
    assert run.data.tags["plugin.model"].startswith("mpsrun ") and "builtin.cnn:cnn" in run.data.tags["plugin.model"]
    assert last(work, run, "val_accuracy") > 0.6  # chance is 0.1


def test_mnist_cnn_recipe_trains_offline_with_fallback(work, tmp_path) -> None:
    from mpsrun.testing.idx import write_idx_dataset

    root = tmp_path / "mnist"
    write_idx_dataset(root, "MNIST", n_train=640, n_test=128, seed=0)
    r = work.cli("run", RECIPES / "mnist_cnn_mps.yaml", "epochs=2", f"dataset.root={root}", "dataset.download=false", "-q")
    assert r.exit_code == 0, r.output
    run = work.runs("mnist_cnn_mps")[0]
    assert run.data.tags["device.requested"] == "mps" and run.data.tags["device.fallback"] == "true"
    assert run.data.params["model.name"] == "cnn" and run.data.params["batch_size"] == "64"
    assert run.data.tags["data.path"] == "resident"
    assert last(work, run, "val_accuracy") > 0.3


def test_synthetic_is_seeded_and_shaped() -> None:
    from mpsrun.plugins.builtin.synthetic import synthetic

    a = synthetic(shape=[3, 8, 8], num_classes=5, train_size=64, val_size=16, seed=1)
    b = synthetic(shape=[3, 8, 8], num_classes=5, train_size=64, val_size=16, seed=1)
    c = synthetic(shape=[3, 8, 8], num_classes=5, train_size=64, val_size=16, seed=2)
    x, y = a.train.tensors
    assert x.shape == (64, 3, 8, 8) and x.dtype == torch.uint8 and y.max() < 5
    assert torch.equal(x, b.train.tensors[0]) and not torch.equal(x, c.train.tensors[0])
    assert a.input_shape == (3, 8, 8) and a.transform is not None
    assert 0.0 <= float(a.transform(x).min()) and float(a.transform(x).max()) <= 1.0
    f = synthetic(shape=[10], dtype="float32", train_size=8, val_size=8)
    assert f.train.tensors[0].dtype == torch.float32 and f.transform is None
    with pytest.raises(ValueError):
        synthetic(shape=[0, 3])


def test_synthetic_trains_on_the_resident_path(work) -> None:
    recipe = work.write(
        "synth.yaml",
        """\
        device: cpu
        dataset: {name: synthetic, shape: [1, 28, 28], train_size: 512, val_size: 128}
        model: {name: mlp, hidden: [32]}
        optimizer: {name: sgd, lr: 0.01}
        """,
    )
    r = work.cli("run", recipe, "-q")
    assert r.exit_code == 0, r.output
    run = work.runs("synth")[0]
    assert run.data.tags["data.path"] == "resident"
    assert run.data.params["data.train_size"] == "512"


# ----------------------------------------------------------------------------- tabular


def test_tabular_recipe_trains_offline_from_a_fresh_working_directory(work) -> None:
    """The CSV is named relative to the recipe, so a bare temp cwd must be enough."""
    assert not (work.path / "data").exists()
    r = work.cli("run", RECIPES / "tabular_categorical.yaml", "-q")
    assert r.exit_code == 0, r.output
    run = work.runs("tabular_categorical")[0]
    assert run.data.tags["data.path"] == "resident"
    assert run.data.params["data.train_size"] == "1920" and run.data.params["data.val_size"] == "480"
    # the rule's best is about 0.87; always answering "no" scores about 0.53
    assert last(work, run, "val_accuracy") > 0.8
    local = work.client().download_artifacts(run.info.run_id, "data_info.json", str(work.path))
    info = json.loads(Path(local).read_text())  # the vocabularies: what makes the weights usable later
    assert info["vocabulary"]["contract"] == ["monthly", "one_year", "two_year"] and info["classes"] == ["no", "yes"]


def test_tabular_codes_unknowns_and_standardises_with_training_statistics_only(tmp_path) -> None:
    from mpsrun.plugins.builtin.tabular import tabular, tabular_mlp

    (tmp_path / "train.csv").write_text("colour,size,label\nred,1,2\nblue,2,10\nred,3,2\n,6,10\n")
    (tmp_path / "val.csv").write_text("colour,size,label\ngreen,4,2\nblue,,10\n")
    s = tabular("train.csv", "label", categorical=["colour"], numeric=["size"], val_path="val.csv", recipe_dir=str(tmp_path))
    assert s.num_classes == 2 and s.input_shape == (2,)
    assert s.info["classes"] == ["2", "10"]  # numeric order, not "10" < "2"
    assert s.info["cardinalities"] == [3]  # blue=1, red=2, plus the reserved 0
    assert s.info["vocabulary"] == {"colour": ["blue", "red"]}
    x, y = s.train.tensors
    assert x[:, 0].tolist() == [2, 1, 2, 0]  # the empty cell is code 0
    assert y.tolist() == [0, 1, 0, 1]
    mean, std = 3.0, (sum((v - 3.0) ** 2 for v in (1, 2, 3, 6)) / 4) ** 0.5
    assert s.info["numeric_mean"] == [mean] and s.info["numeric_std"] == pytest.approx([std])
    assert x[:, 1].mean().item() == pytest.approx(0.0, abs=1e-6)
    vx, _ = s.val.tensors
    assert vx[0].tolist() == pytest.approx([0.0, (4 - mean) / std])  # green: unseen in training
    assert vx[1].tolist() == pytest.approx([1.0, 0.0])  # empty number: the training mean
    model = tabular_mlp(s.input_shape, s.num_classes, s.info, hidden=[8])
    assert model(vx).shape == (2, 2)


def test_tabular_seeded_split_is_reproducible_and_disjoint() -> None:
    from mpsrun.plugins.builtin.tabular import tabular

    kw = dict(path="data/churn.csv", target="churn", categorical=["plan"], numeric=["tenure_months"], recipe_dir=str(RECIPES))
    a, b, c = tabular(**kw, seed=0), tabular(**kw, seed=0), tabular(**kw, seed=1)
    assert len(a.train) == 1920 and len(a.val) == 480
    assert torch.equal(a.val.tensors[0], b.val.tensors[0]) and not torch.equal(a.val.tensors[0], c.val.tensors[0])


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.target=churm", "column 'churm' is not in"),
        ("dataset.path=data/nope.csv", "nope.csv does not exist"),
        ("dataset.numeric=[customer_id]", "numeric column 'customer_id' of"),
        ("dataset.numeric=[plan]", "plan named more than once"),
        ("dataset.categorical=[]", ""),  # fine: numeric columns alone
    ],
)
def test_tabular_bad_data_is_exit_2_naming_the_problem(work, override, message) -> None:
    r = work.cli("run", RECIPES / "tabular_categorical.yaml", override, "epochs=1", "-q")
    if not message:
        assert r.exit_code == 0, r.output
        return
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "dataset plugin 'tabular'" in r.stderr
    if "churm" in override:
        assert "did you mean 'churn'" in r.stderr


def test_tabular_mlp_without_cardinalities_is_bad_input(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "model.name=tabular_mlp", "model.hidden=[8]", "-q")
    assert r.exit_code == 2
    assert "data_info['cardinalities']" in r.stderr


def test_data_info_is_filled_not_set(work) -> None:
    r = work.cli("validate", RECIPES / "tabular_categorical.yaml", "model.data_info={}")
    assert r.exit_code == 2 and "filled in by the runner" in r.stderr


def test_make_tabular_reproduces_the_committed_csv(tmp_path) -> None:
    out = tmp_path / "churn.csv"
    p = subprocess.run([sys.executable, str(RECIPES / "data" / "make_tabular.py"), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes() == (RECIPES / "data" / "churn.csv").read_bytes()


# ----------------------------------------------------------------------------- schema


def shipped_recipes() -> list[Path]:
    return sorted(RECIPES.rglob("*.yaml")) + sorted((ROOT / "examples").rglob("recipes/*.yaml"))


def test_schema_command_matches_the_committed_file(work) -> None:
    r = work.cli("schema")
    assert r.exit_code == 0
    assert r.stdout == SCHEMA_FILE.read_text(), "docs/recipe.schema.json is stale: run `mpsrun schema > docs/recipe.schema.json`"


def _validator():  # type: ignore[no-untyped-def]
    import jsonschema

    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_recipe_validates_against_the_schema_it_names(path: Path) -> None:
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in _validator().iter_errors(yaml_load(path.read_text()))]
    assert not errors
    first = path.read_text().splitlines()[0]
    m = re.fullmatch(r"# yaml-language-server: \$schema=(\S+)", first)
    assert m, f"{path} should start with '# yaml-language-server: $schema=...'"
    assert (path.parent / m.group(1)).resolve() == SCHEMA_FILE


def test_schema_rejects_unknown_top_level_keys_and_keeps_plugin_sections_open(work) -> None:
    v = _validator()
    base = yaml_load((RECIPES / "digits_mlp.yaml").read_text())
    assert not list(v.iter_errors(base))
    bad = {**base, "epochz": 3}
    assert any("epochz" in e.message for e in v.iter_errors(bad))
    assert list(v.iter_errors({**base, "device": "gpu"}))
    assert list(v.iter_errors({**base, "tracking": {"experimnt": "x"}}))
    open_ = {**base, "dataset": {"name": "digits", "anything": [1, 2]}}
    assert not list(v.iter_errors(open_))
    assert list(v.iter_errors({**base, "dataset": {"val_fraction": 0.2}}))  # name is required
    # what the runner coerces, the schema accepts: no false alarms in editors
    lenient = {**base, "device_fallback": "cpu", "tracking": {"tags": {"seed": 1}}}
    assert not list(v.iter_errors(lenient))
    p = work.write("lenient.yaml", yaml.safe_dump(lenient))
    assert work.cli("validate", p).exit_code == 0


# ----------------------------------------------------------------------------- scaffold, example, docs


def _tree(root: Path) -> dict[str, str]:
    skip = {"__pycache__", ".pytest_cache", "mlruns", "build", "dist"}
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not skip & set(p.relative_to(root).parts) and not p.name.endswith(".egg-info")
    }


def test_example_package_is_the_scaffold_output() -> None:
    from mpsrun.plugins import scaffold

    names = scaffold.Names.make("mpsrun-plugin-example", model="residual_mlp", dataset="spirals")
    expected = scaffold.files(names, schema_ref="../../../docs/recipe.schema.json")
    assert _tree(EXAMPLE) == expected, (
        "examples/mpsrun-plugin-example differs from `mpsrun new plugin`'s output; regenerate it with "
        "mpsrun.plugins.scaffold.write(Path('examples/mpsrun-plugin-example'), Names.make('mpsrun-plugin-example', "
        "model='residual_mlp', dataset='spirals'), schema_ref='../../../docs/recipe.schema.json')"
    )


def _says_resident(stdout: str) -> bool:
    """The run's first line says resident data; on CUDA (`resident_max_gb: auto`) the data is placed after a measured
    step, and the note that follows says it went onto the device: a note, not a warning (nothing fell back)."""
    return "data=resident" in stdout or ("data=placed after a measured step" in stdout and "of raw tensors on the device (room" in stdout
                                         and "warning: data:" not in stdout)


def test_example_package_installs_and_trains_through_the_console_script(tmp_path, template_db) -> None:
    """As a user types it: pip install the package, then `mpsrun run` its recipe from elsewhere."""
    site = tmp_path / "site"
    pip_install(EXAMPLE, site)
    cwd = tmp_path / "cwd"
    (cwd / "mlruns").mkdir(parents=True)
    shutil.copy(template_db, cwd / "mlruns" / "mlflow.db")
    mpsrun = Path(sys.executable).with_name("mpsrun")
    if not mpsrun.exists():
        mpsrun = Path(shutil.which("mpsrun") or "mpsrun")
    recipe = EXAMPLE / "recipes" / "spirals.yaml"
    r = run_subprocess(str(mpsrun), "run", str(recipe), "-q", cwd=cwd, env={"PYTHONPATH": str(site)})
    assert r.exit_code == 0, r.output
    assert _says_resident(r.stdout), r.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd / 'mlruns' / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("spirals").experiment_id])[0]
    assert run.data.tags["data.path"] == "resident"
    assert run.data.tags["plugin.model"] == "mpsrun-plugin-example 0.1.0 (mpsrun_plugin_example.models:residual_mlp)"
    assert run.data.metrics["val_accuracy"] > 0.85  # three spirals: chance is 1/3


def test_new_plugin_writes_a_package_that_installs_and_trains(work, install) -> None:
    r = work.cli("new", "plugin", "my-lab")
    assert r.exit_code == 0, r.output
    pkg = work.path / "my-lab"
    assert (pkg / "pyproject.toml").is_file() and (pkg / "src" / "my_lab" / "models.py").is_file()
    from mpsrun.recipe.schema import render

    assert (pkg / "recipe.schema.json").read_text() == render()
    before = _tree(pkg)
    r = work.cli("new", "plugin", "my-lab")
    assert r.exit_code == 2 and "already exists" in r.stderr
    assert _tree(pkg) == before  # nothing overwritten
    assert work.cli("new", "plugin", "my lab!").exit_code == 2
    assert work.cli("new", "plugin", "ok-name", "--model", "Bad-Name").exit_code == 2

    recipe = pkg / "recipes" / "my_lab_spirals.yaml"
    r = work.cli("validate", recipe)
    assert r.exit_code == 2 and "unknown dataset 'my_lab_spirals'" in r.stderr  # not installed yet
    install(pkg)
    r = work.cli("plugins", "--json")
    rows = {(x["kind"], x["name"]): x for x in json.loads(r.stdout)}
    assert rows[("model", "my_lab_mlp")]["distribution"] == "my-lab" and rows[("model", "my_lab_mlp")]["version"] == "0.1.0"
    assert rows[("dataset", "my_lab_spirals")]["entry_point"] == "my_lab.datasets:my_lab_spirals"
    r = work.cli("plugins", "show", "my-lab:my_lab_mlp")
    assert r.exit_code == 0 and "from my-lab 0.1.0" in r.stdout
    r = work.cli("run", recipe, "epochs=3", "-q")
    assert r.exit_code == 0, r.output
    run = work.runs("my_lab_spirals")[0]
    assert run.data.tags["plugin.dataset"] == "my-lab 0.1.0 (my_lab.datasets:my_lab_spirals)"
    assert last(work, run, "val_accuracy") > 0.5  # chance is 1/3


def _doc_section() -> str:
    text = DOCS.read_text()
    return text.split("## Worked example", 1)[1].split("\n## ", 1)[0]


def test_docs_worked_example(work, install, monkeypatch) -> None:
    """Follow docs/plugins.md's worked example literally: its files, then its commands.

    `pip install -e .` becomes an install into a temp --target folder (same build,
    no change to the test venv); `mpsrun ...` lines run through the real CLI; a line
    whose comment says "exit code N" must exit with N, every other line with 0.
    """
    section = _doc_section()
    files = re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', section, re.S)
    assert {f for f, _ in files} == {"my-lab/pyproject.toml", "my-lab/src/my_lab/plugins.py", "my-lab/recipes/stripes.yaml"}
    commands = [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines() if line.strip()]
    cwd = work.path
    for rel, text in files:
        (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
        (cwd / rel).write_text(text)
    ran = []
    for line in commands:
        cmd, _, comment = line.partition("#")
        args = shlex.split(cmd)
        m = re.search(r"exit code (\d+)", comment)
        want = int(m.group(1)) if m else 0
        if args[0] == "mkdir":
            for d in args[1:]:
                if not d.startswith("-"):
                    (cwd / d).mkdir(parents=True, exist_ok=True)
        elif args[0] == "cd":
            cwd = cwd / args[1]
            monkeypatch.chdir(cwd)
        elif args[:3] == ["pip", "install", "-e"]:
            install(cwd / args[3])
        elif args[0] == "mpsrun":
            out = None
            if ">" in args:
                i = args.index(">")
                args, out = args[:i], cwd / args[i + 1]
            monkeypatch.setenv("MLFLOW_TRACKING_URI", work.uri)
            r = work.cli(*args[1:])
            assert r.exit_code == want, f"{line}\n{r.output}"
            if out is not None:
                out.write_text(r.stdout)
            ran.append((args, r))
        else:
            pytest.fail(f"the test does not know how to follow: {line}")
    byname = {" ".join(a[1:3]): r for a, r in ran}
    validations = [r for a, r in ran if a[1] == "validate"]
    assert "did you mean 'width'" in validations[0].stderr and "'avg' or 'max'" in validations[1].stderr
    show = byname["plugins show"].stdout
    assert "model stripe_net  from my-lab 0.1.0  (my_lab.plugins:stripe_net)" in show
    assert "width: int = 16, pool: Literal['avg', 'max'] = 'avg'" in show and "filled in by the runner: input_shape, num_classes" in show
    assert _says_resident(byname["run recipes/stripes.yaml"].stdout)
    run = work.runs("stripes")[0]
    assert run.data.tags["data.path"] == "resident"
    assert run.data.tags["plugin.model"] == "my-lab 0.1.0 (my_lab.plugins:stripe_net)"
    assert last(work, run, "val_accuracy") > 0.5  # the doc says: well above the 25% of guessing
    assert json.loads((work.path / "my-lab" / "recipe.schema.json").read_text())["title"] == "mpsrun recipe"
