"""`mpsrun parity`: real training on two replicas, the real CLI, a real MLflow store.

No second device exists here, so device B is the CPU too: a deterministic model
must agree exactly, and a model plugin whose copies compute differently must be
caught at the step where they start to differ.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mpsrun.devices.parity import run as parity
from mpsrun.plugins import resolve

from .conftest import RECIPES, digits_recipe

DIGITS = RECIPES / "digits_mlp.yaml"

# Copies of this model compute differently: the second copy to train (device B;
# copy 0 is A, copy 2 the yardstick) adds `bump` to class 0's logit from its
# training step `at` on. Deep copies skip __init__, so the count restarts per
# model built, i.e. per parity run.
SKEWED = """
import torch
from torch import nn

class Skewed(nn.Module):
    trained = 0

    def __init__(self, input_shape, num_classes, at, bump):
        super().__init__()
        self.lin = nn.Linear(64, num_classes)
        self.at, self.bump, self.steps, self.copy = at, bump, 0, None
        Skewed.trained = 0

    def forward(self, x):
        out = self.lin(x.flatten(1))
        if self.training:
            if self.copy is None:
                self.copy = Skewed.trained
                Skewed.trained += 1
            self.steps += 1
            if self.copy == 1 and self.steps >= self.at:
                out = out + self.bump * nn.functional.one_hot(torch.zeros_like(out[:, 0]).long(), out.shape[1])
        return out

def skewed(input_shape: tuple, num_classes: int, at: int = 3, bump: float = 1.0):
    return Skewed(input_shape, num_classes, at, bump)
"""


def _parity_run(work, experiment: str = "digits_mlp"):  # type: ignore[no-untyped-def]
    runs = [r for r in work.runs(experiment) if r.data.tags.get("mpsrun.kind") == "parity"]
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


def test_cpu_vs_cpu_agrees_and_is_recorded(work, tmp_path) -> None:
    r = work.cli("parity", DIGITS, "--devices", "cpu,cpu", "--steps", "5")
    assert r.exit_code == 0, r.output
    assert "verdict: agree" in r.stdout
    for step in range(6):
        assert f"step {step} " in r.stdout
    run = _parity_run(work)
    assert run.info.status == "FINISHED"
    assert run.info.run_name.startswith("parity cpu vs cpu")
    tags = run.data.tags
    assert tags["parity.verdict"] == "agree"
    assert tags["parity.device_a"] == tags["parity.device_b"] == "cpu"
    assert tags["parity.first_divergence"] == "none"
    assert tags["parity.precision"] == "fp32" and tags["parity.rtol"] == "0.001"
    assert tags["parity.yardstick"] == "cpu fp64"
    assert tags["device.type"] == "cpu" and tags["sw.torch"]
    rid = run.info.run_id
    assert [s for s, _ in work.history(rid, "loss_abs_diff")] == [1, 2, 3, 4, 5]
    assert all(v == 0.0 for _, v in work.history(rid, "loss_abs_diff"))
    assert [s for s, _ in work.history(rid, "logits_rel_diff")] == [0, 1, 2, 3, 4, 5]
    assert work.history(rid, "loss_a") == work.history(rid, "loss_b")
    # the yardstick really ran: fp64 differs from fp32 by rounding, never by zero
    assert all(v > 0 for _, v in work.history(rid, "loss_noise_rel"))
    assert run.data.metrics["params_abs_diff"] == 0.0
    arts = {a.path for a in work.client().list_artifacts(rid)}
    assert {"parity_loss.png", "parity.json", "recipe.yaml"} <= arts
    png = work.client().download_artifacts(rid, "parity_loss.png", str(tmp_path))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    report = json.loads(open(work.client().download_artifacts(rid, "parity.json", str(tmp_path))).read())
    assert report["verdict"] == "agree" and len(report["records"]) == 6


def test_replicas_that_compute_differently_diverge_at_their_step(work, fake_dist) -> None:
    fake_dist("skew-models", SKEWED, models={"skewed": "skewed"})
    r = work.cli("parity", digits_recipe(work, "skewed"), "model.at=3", "--devices", "cpu,cpu", "--steps", "5")
    assert r.exit_code == 1, r.output
    assert "verdict: diverge" in r.stdout and "first at step 3: loss" in r.stdout
    run = _parity_run(work, "plugtest")
    assert run.info.status == "FINISHED"  # the check ran fine; its verdict is the news
    assert run.data.tags["parity.verdict"] == "diverge"
    assert run.data.tags["parity.first_divergent_step"] == "3"
    hist = dict(work.history(run.info.run_id, "loss_abs_diff"))
    assert hist[1] == hist[2] == 0.0 and hist[3] > 0.01
    ratio = dict(work.history(run.info.run_id, "loss_tol_ratio"))
    assert ratio[2] <= 1.0 < ratio[3]


def test_tolerance_options_loosen_the_verdict(work, fake_dist) -> None:
    fake_dist("skew-models", SKEWED, models={"skewed": "skewed"})
    recipe = digits_recipe(work, "skewed")
    r = work.cli("parity", recipe, "model.at=2", "--devices", "cpu,cpu", "--steps", "4", "--rtol", "10", "--noise-factor", "0", "-q")
    assert r.exit_code == 0, r.output
    assert "step 1 " not in r.stdout  # --quiet: no line per step
    tags = _parity_run(work, "plugtest").data.tags
    assert tags["parity.rtol"] == "10" and tags["parity.noise_factor"] == "0"
    assert tags["parity.yardstick"] == "none" and tags["parity.verdict"] == "agree"


@pytest.mark.parametrize(
    "args, says",
    [
        (["--devices", "cpu"], "two devices"),
        (["--devices", "cpu,gpu"], "'gpu' is not a device"),
        (["--devices", "cpu,mps"], "device 'mps' is unusable"),  # MPS is really absent on Linux
        (["--devices", "cpu,cpu", "--steps", "0"], "--steps"),
        (["--devices", "cpu,cpu", "--rtol", "-1"], "--rtol"),
        (["epochs=x", "--devices", "cpu,cpu"], "epochs"),
    ],
)
def test_bad_input_exits_2_and_logs_nothing(work, args, says) -> None:
    r = work.cli("parity", DIGITS, *args)
    assert r.exit_code == 2, r.output
    assert says in r.output
    assert not work.runs("digits_mlp")


def test_bf16_uses_bf16_tolerances_and_an_fp32_yardstick(work) -> None:
    r = work.cli("parity", DIGITS, "precision=bf16", "--devices", "cpu,cpu", "--steps", "3", "--experiment", "par16")
    assert r.exit_code == 0, r.output
    run = _parity_run(work, "par16")
    assert "(bf16)" in run.info.run_name
    tags = run.data.tags
    assert tags["parity.precision"] == "bf16" and tags["parity.rtol"] == "0.01"
    assert tags["parity.yardstick"] == "cpu fp32"
    # bf16 against fp32 is far noisier than fp64 against fp32
    assert max(v for _, v in work.history(run.info.run_id, "logits_noise_rel")) > 1e-4


def test_fashion_recipe_with_dropout_compares_on_cpu(work, fashion_root) -> None:
    r = work.cli(
        "parity", RECIPES / "fashion_mlp_mps.yaml", f"dataset.root={fashion_root}", "model.dropout=0.5", "--devices", "cpu,cpu", "--steps", "3"
    )
    assert r.exit_code == 0, r.output
    assert "dropout is off during parity" in r.stdout
    assert _parity_run(work, "fashion_mlp_mps").data.tags["parity.verdict"] == "agree"


# ----------------------------------------------------------------------------- library level


class _Reordered(parity.Replica):
    """Another *correct* device: batch reductions add their terms in another order."""

    def step(self, x, y):  # type: ignore[no-untyped-def]
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(len(y)))
        return super().step(x[perm], y[perm])


class _LostUpdate(parity.Replica):
    """A broken device: the first weight tensor's optimizer update never lands (the MPS addcdiv_ bug's effect)."""

    def step(self, x, y):  # type: ignore[no-untyped-def]
        p = next(self.model.parameters())
        before = p.detach().clone()
        out = super().step(x, y)
        with torch.no_grad():
            p.copy_(before)
        return out


@pytest.mark.parametrize("kind, verdict", [(_Reordered, "agree"), (_LostUpdate, "diverge")])
def test_default_fp32_tolerance_passes_rounding_and_catches_a_lost_update(work, kind, verdict) -> None:
    """The tolerance is neither too tight (rounding-order noise passes) nor too loose."""
    resolved = resolve(DIGITS, ["device=cpu"])
    prep = parity.prepare(resolved, ("cpu", "cpu"), steps=8)
    args = (prep.model, torch.device("cpu"), resolved, "fp32", False, prep.splits.transform)
    res = parity.execute(prep, reps=(parity.Replica(*args), kind(*args)))
    assert res.verdict == verdict, res.summary()
    s = res.summary()
    if kind is _Reordered:
        assert 0 < s["loss"].max_rel < 1e-5  # really different, by rounding only
    else:
        assert res.first_divergence is not None and res.first_divergence[0] == 1


def test_diff_is_normwise_with_atol_and_noise() -> None:
    tol = parity.Tolerance(atol=1e-6, rtol=1e-3, noise_factor=4)
    ref = torch.tensor([1.0, -2.0, 1e-9])
    near_zero_off = ref.clone()
    near_zero_off[2] = 3e-9  # 200% off elementwise, nothing normwise
    assert not parity.diff(near_zero_off, ref, tol).exceeded
    off = ref * 1.01
    assert parity.diff(off, ref, tol).exceeded
    assert not parity.diff(off, ref, tol, noise=0.005).exceeded  # within 4x the measured noise
    assert not parity.diff(torch.tensor(2.0 + 5e-7), torch.tensor(2.0), parity.Tolerance(1e-6, 0.0, 0)).exceeded  # atol
    assert parity.diff(torch.tensor([1.0, math.nan]), torch.tensor([1.0, math.nan]), tol).ratio == 0.0
    assert parity.diff(torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0]), tol).exceeded
    assert parity.diff(torch.zeros(3), torch.zeros(2), tol).exceeded
    # weights: relative to the update from the shared start, not to the weights
    start = torch.ones(4, dtype=torch.float64)
    a, b = start + 1e-3, start + 1.2e-3  # b moved 20% further than a
    assert parity.diff(b, a, tol).rel < 1e-3
    assert parity.diff(b, a, tol, start=start).rel == pytest.approx(0.2)


def test_parity_help(work) -> None:
    r = work.cli("parity", "--help")
    assert r.exit_code == 0
    for opt in ("--devices", "--steps", "--atol", "--rtol", "--noise-factor", "--experiment"):
        assert opt in r.stdout
