"""Parity must not agree with a wrong answer: the yardstick's noise is capped.

The yardstick (a higher-precision CPU replica) is itself a copy of the model. A model
whose later copies compute 5% differently used to make the yardstick 5% off too, so
the measured "noise" was 5% and the allowance grew to fit: `--devices cpu,cpu`
said agree. Now noise widens the tolerance only up to what the precision explains,
and a yardstick that disagrees with A beyond that is a divergence naming the step.
"""

from __future__ import annotations

import math

import torch

from mpsrun.devices.parity import tolerance as tolmod

# Every deep copy after the first computes 5% more: parity's copies are A (first),
# then B and the yardstick. Deep copies skip __init__ and go through __setstate__.
LATER_COPIES = """
from torch import nn

class Drifting(nn.Module):
    copies = 0

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.lin = nn.Linear(64, num_classes)
        self.scale = 1.0
        Drifting.copies = 0

    def __setstate__(self, state):
        super().__setstate__(state)
        Drifting.copies += 1
        self.scale = 1.0 if Drifting.copies == 1 else 1.05

    def forward(self, x):
        return self.lin(x.flatten(1)) * self.scale

def drifting(input_shape: tuple, num_classes: int):
    return Drifting(input_shape, num_classes)
"""

RECIPE = """\
device: cpu
epochs: 1
batch_size: 32
seed: 0
dataset: {name: digits}
model: {name: drifting}
optimizer: {name: sgd, lr: 0.05}
tracking: {experiment: cap}
"""


def test_later_copies_5pct_off_diverge_naming_the_step(work, fake_dist) -> None:  # type: ignore[no-untyped-def]
    fake_dist("drift-models", LATER_COPIES, models={"drifting": "drifting"})
    recipe = work.write("drift.yaml", RECIPE)
    r = work.cli("parity", recipe, "--devices", "cpu,cpu", "--steps", "3")
    assert r.exit_code == 1, r.output
    assert "verdict: diverge" in r.output
    assert "step 0" in r.output and "A suspect" in r.output, r.output
    run = [x for x in work.runs("cap") if x.data.tags.get("mpsrun.kind") == "parity"][0]
    assert run.data.tags["parity.verdict"] == "diverge"
    assert run.data.tags["parity.first_divergent_step"] == "0"
    assert run.data.tags["parity.a_suspect"] == "true"
    # without the cap (the old rule) the same run would have agreed: noise 5% allows 20%
    assert run.data.metrics["max_logits_rel_diff"] < 4 * 0.05


def test_same_model_still_agrees_with_the_cap(work) -> None:  # type: ignore[no-untyped-def]
    from .conftest import RECIPES

    r = work.cli("parity", RECIPES / "digits_mlp.yaml", "--devices", "cpu,cpu", "--steps", "5", "-q")
    assert r.exit_code == 0, r.output
    run = [x for x in work.runs("digits_mlp") if x.data.tags.get("mpsrun.kind") == "parity"][0]
    assert run.data.tags["parity.a_suspect"] == "false"


def test_cap_limits_the_allowance_and_flags_a() -> None:
    tol = tolmod.Tolerance(1e-6, 1e-3, 4, dict(tolmod.NOISE_CAPS["fp32"]))
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]) * 1.002
    ok = tolmod.diff(b, a, tol, noise=1e-5, quantity="loss")  # ordinary fp32 noise: the floor decides
    assert ok.exceeded and not ok.suspect  # 2e-3 > rtol 1e-3
    d = tolmod.diff(a, a, tol, noise=0.05, quantity="loss")  # B equals A, but the yardstick is 5% off A
    assert d.suspect and d.exceeded and math.isclose(d.ratio, 0.05 / 1e-4)
    assert d.allowed == max(1e-3, 4 * 1e-4)
    uncapped = tolmod.diff(b, a, tolmod.Tolerance(1e-6, 1e-3, 4), noise=0.05, quantity="loss")
    assert not uncapped.exceeded  # the old rule: the allowance grows with the noise
