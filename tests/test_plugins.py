"""Plugin discovery through real entry points of (throwaway) installed distributions."""

from __future__ import annotations

import json
import sys

from mpsrun.plugins import registry as plugins

from .conftest import RECIPES, digits_recipe

GOOD_MODEL = """
from torch import nn

def tiny(input_shape: tuple, num_classes: int, width: int = 16):
    '''A tiny model for tests.'''
    import math
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(), nn.Linear(width, num_classes))
"""


def test_listing_names_imports_no_plugin(fake_dist) -> None:
    fake_dist("lazy-lab", GOOD_MODEL, models={"tiny": "tiny"})
    assert "tiny" in plugins.names("model")
    assert "lazy_lab_mod" not in sys.modules


def test_third_party_model_trains_from_a_recipe(work, fake_dist) -> None:
    fake_dist("my-lab", GOOD_MODEL, models={"tiny": "tiny"})
    r = work.cli("run", digits_recipe(work, "tiny"), "model.width=8", "epochs=1", "-q")
    assert r.exit_code == 0, r.output
    assert work.runs("plugtest")[0].data.params["model.width"] == "8"


def test_broken_plugin_is_named_and_breaks_nothing_else(work, fake_dist) -> None:
    fake_dist("broken-lab", "raise ImportError('no module named unicorn')\n", models={"bad": "nothing"})
    r = work.cli("plugins")
    assert r.exit_code == 0
    assert "broken-lab" in r.stdout and "mlp" in r.stdout
    assert work.cli("--help").exit_code == 0
    r = work.cli("validate", digits_recipe(work, "bad"))
    assert r.exit_code == 2
    assert "broken_lab_mod:nothing" in r.stderr and "broken-lab" in r.stderr and "unicorn" in r.stderr
    assert work.cli("validate", RECIPES / "digits_mlp.yaml").exit_code == 0


def test_plugins_json_names_distributions(work) -> None:
    r = work.cli("plugins", "--json")
    assert r.exit_code == 0
    rows = json.loads(r.stdout)
    byname = {(x["kind"], x["name"]): x for x in rows}
    assert byname[("model", "mlp")]["distribution"] == "mpsrun"
    assert "hidden" in byname[("model", "mlp")]["signature"]
    assert {("dataset", "digits"), ("dataset", "fashion_mnist"), ("dataset", "mnist")} <= set(byname)


def test_plugins_show(work) -> None:
    r = work.cli("plugins", "show", "mlp")
    assert r.exit_code == 0 and "hidden" in r.stdout and "perceptron" in r.stdout
    r = work.cli("plugins", "show", "mpl")
    assert r.exit_code == 2 and "did you mean 'mlp'" in r.stderr


def test_name_clash_needs_distribution_prefix(work, fake_dist) -> None:
    fake_dist("lab-a", GOOD_MODEL, models={"tiny": "tiny"})
    fake_dist("lab-b", GOOD_MODEL, models={"tiny": "tiny"})
    p = digits_recipe(work, "tiny")
    r = work.cli("validate", p)
    assert r.exit_code == 2
    assert "lab-a" in r.stderr and "lab-b" in r.stderr
    assert work.cli("validate", p, "model.name=lab-b:tiny").exit_code == 0
