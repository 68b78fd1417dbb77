"""Recipe validation, overrides and the errors users see (through the real CLI)."""

from __future__ import annotations

import pytest

from mpsrun.plugins import resolve
from mpsrun.recipe import RecipeError, parse_override

from .conftest import RECIPES

GOOD = """\
device: cpu
epochs: 2
batch_size: 16
seed: 1
dataset:
  name: digits
model:
  name: mlp
  hidden: [32]
optimizer:
  name: sgd
  lr: 0.01
"""


def test_shipped_recipes_validate(work) -> None:
    for path in sorted(RECIPES.glob("*.yaml")):
        r = work.cli("validate", path)
        assert r.exit_code == 0, (path, r.output)


def test_validate_prints_resolved_recipe_with_overrides(work) -> None:
    p = work.write("r.yaml", GOOD)
    r = work.cli("validate", p, "epochs=5", "optimizer.lr=0.5", "model.hidden=[8,4]")
    assert r.exit_code == 0, r.output
    assert "epochs: 5" in r.stdout
    assert "lr: 0.5" in r.stdout
    assert "- 8" in r.stdout and "- 4" in r.stdout


def test_all_problems_reported_at_once_with_positions(work) -> None:
    p = work.write(
        "bad.yaml",
        """\
        device: cpu
        epocs: 2
        batch_size: -1
        dataset:
          name: digts
        model:
          name: mlp
          hiden: [32]
        optimizer:
          name: sgdd
          lr: 0.01
        """,
    )
    r = work.cli("run", p)
    assert r.exit_code == 2
    out = r.stderr
    assert "Traceback" not in r.output
    assert f"{p}:2:1: epocs: unknown key (did you mean 'epochs'?)" in out
    assert f"{p}:3:1: batch_size:" in out and "greater than or equal to 1" in out and "found -1" in out
    assert f"{p}:5:3: dataset.name: unknown dataset 'digts' (did you mean 'digits'?)" in out
    assert f"{p}:8:3: model.hiden: unknown argument (did you mean 'hidden'?)" in out
    assert f"{p}:10:3: optimizer.name: unknown optimizer 'sgdd' (did you mean 'sgd'" in out
    assert "5 problems" in out
    lines = [line for line in out.splitlines() if line.startswith("  - ")]
    assert [int(line.split(":")[1]) for line in lines] == [2, 3, 5, 8, 10], "problems in file order"
    assert not work.runs("bad"), "nothing may be logged for a bad recipe"


def test_plugin_kwarg_types_checked_against_hints(work) -> None:
    p = work.write("r.yaml", GOOD)
    r = work.cli("validate", p, "model.hidden=lots", "optimizer.momentum=fast", "dataset.val_fraction=[1]")
    assert r.exit_code == 2
    assert "override 'model.hidden=lots': model.hidden:" in r.stderr
    assert "override 'optimizer.momentum=fast': optimizer.momentum:" in r.stderr
    assert "dataset.val_fraction" in r.stderr


def test_runner_filled_parameters_are_refused(work) -> None:
    p = work.write("r.yaml", GOOD)
    r = work.cli("validate", p, "model.num_classes=3")
    assert r.exit_code == 2
    assert "filled in by the runner" in r.stderr


def test_bad_override_syntax_and_values(work) -> None:
    p = work.write("r.yaml", GOOD)
    r = work.cli("validate", p, "epochs", "device=tpu", "epochs=zero")
    assert r.exit_code == 2
    assert "override 'epochs': expected key=value" in r.stderr
    assert "override 'device=tpu': device:" in r.stderr
    assert "override 'epochs=zero': epochs:" in r.stderr


def test_missing_sections_and_invalid_yaml(work) -> None:
    p = work.write("r.yaml", "device: cpu\nepochs: 1\n")
    r = work.cli("validate", p)
    assert r.exit_code == 2
    for key in ("dataset", "model", "optimizer"):
        assert f"{key}: required key is missing" in r.stderr
    q = work.write("y.yaml", "device: cpu\n  epochs: [1\n")
    r = work.cli("validate", q)
    assert r.exit_code == 2 and "invalid YAML" in r.stderr and f"{q}:" in r.stderr
    r = work.cli("validate", work.path / "nope.yaml")
    assert r.exit_code == 2 and "file not found" in r.stderr


def test_device_names_and_fallback_validated(work) -> None:
    p = work.write("r.yaml", GOOD)
    assert work.cli("validate", p, "device=cuda:1", "device_fallback=[mps,cpu]").exit_code == 0
    r = work.cli("validate", p, "device_fallback=[gpu]")
    assert r.exit_code == 2 and "'gpu' is not a device" in r.stderr


def test_yaml_is_loaded_safely(work) -> None:
    p = work.write("r.yaml", GOOD + "x: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError) as e:
        resolve(p)
    assert "invalid YAML" in str(e.value)


def test_parse_override_reads_yaml_scalars() -> None:
    assert parse_override("optimizer.lr=1e-3") == (["optimizer", "lr"], 1e-3)
    assert parse_override("model.hidden=[256,256]") == (["model", "hidden"], [256, 256])
    assert parse_override("dataset.download=false") == (["dataset", "download"], False)
    assert parse_override("dataset.root=/data") == (["dataset", "root"], "/data")
