"""Regression through the commands that come after training (issue 13's gaps): `mpsrun eval`
and `mpsrun parity` on a regression run report its own metrics in the target's units, never an
accuracy; and the `synthetic` dataset with uint8 samples of any rank.

Real training on the churn CSV and synthetic tensors, the real CLI, a real MLflow SQLite store.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mpsrun.devices.parity import run as parity
from mpsrun.plugins import resolve
from mpsrun.plugins.contract import ImageTransform
from tests.conftest import RECIPES, Workdir

TABULAR = RECIPES / "tabular_regression.yaml"


def _at(work: Workdir, run_id: str, key: str, step: int) -> float:
    return next(v for s, v in work.history(run_id, key) if s == step)


def test_eval_of_a_regression_run_reports_its_val_metrics_in_target_units_and_no_accuracy(work: Workdir) -> None:
    r = work.cli("run", TABULAR, "device=cpu", "epochs=3", "-q")
    assert r.exit_code == 0, r.output
    (run,) = work.runs("tabular_regression")
    # the run's description says the regression result; no final_* copies are logged (the latest val_r2 is the last epoch's)
    assert not [k for k in run.data.metrics if k.startswith("final_")]
    assert f"validation R^2 {run.data.metrics['val_r2']:.4f}" in run.data.tags["mlflow.note.content"]
    r = work.cli("eval", run.info.run_id)
    assert r.exit_code == 0, r.output
    assert "accuracy" not in r.output
    assert "eval_r2" in r.stdout and "eval_mae" in r.stdout and "eval_rmse" in r.stdout
    ev = next(x for x in work.runs("tabular_regression") if x.info.run_id != run.info.run_id)
    m = ev.data.metrics
    assert not {k for k in m if "accuracy" in k}, sorted(m)
    # the logged model is the best epoch's: evaluated on the same split, it gives that epoch's figures
    best = int(run.data.tags["mpsrun.best.epoch"])
    rid = run.info.run_id
    assert m["eval_loss"] == pytest.approx(_at(work, rid, "val_loss", best), rel=1e-5)
    for k in ("mae", "rmse", "r2"):
        assert m[f"eval_{k}"] == pytest.approx(_at(work, rid, f"val_{k}", best), rel=1e-5), k
    assert 3.0 < m["eval_mae"] < 12.0  # the charge's units (standardised errors would be ~0.3)
    assert "predicted_vs_true.png" in {a.path.split("/")[-1] for a in work.client().list_artifacts(ev.info.run_id, "figures")}
    # resume trains on and ends with the regression headline (it once raised KeyError: final_val_accuracy)
    r = work.cli("resume", rid, "epochs=4", "-q")
    assert r.exit_code == 0, r.output
    assert "val_r2" in r.stdout and "val_acc" not in r.stdout
    assert [s for s, _ in work.history(rid, "val_r2")] == [0, 1, 2, 3]


class _LostUpdate(parity.Replica):
    """A broken device: the first weight tensor's optimizer update never lands."""

    def step(self, x, y):  # type: ignore[no-untyped-def]
        p = next(self.model.parameters())
        before = p.detach().clone()
        out = super().step(x, y)
        with torch.no_grad():
            p.copy_(before)
        return out


def test_parity_of_a_regression_recipe_trains_with_its_mse_and_compares_predictions(work: Workdir) -> None:
    r = work.cli("parity", TABULAR, "device=cpu", "--devices", "cpu,cpu", "--steps", "3")
    assert r.exit_code == 0, r.output
    assert "verdict: agree" in r.stdout and "outputs" in r.stdout and "logits" not in r.stdout
    (run,) = [x for x in work.runs("tabular_regression") if x.data.tags.get("mpsrun.kind") == "parity"]
    assert run.data.tags["parity.task"] == "regression"
    assert "probe_argmax_agreement" not in run.data.metrics
    # the loss is the recipe's mse on the standardised charge, as training computes it
    resolved = resolve(TABULAR, ["device=cpu"])
    prep = parity.prepare(resolved, ("cpu", "cpu"), steps=1)
    x, y = next(parity.batches(prep.splits.train, resolved.recipe.batch_size, resolved.recipe.seed, 1))
    model = prep.model.train()
    with torch.no_grad():
        want = F.mse_loss(model(x).reshape(y.shape), y.float()).item()
    res = parity.execute(prep)
    assert res.records[1].loss[0] == pytest.approx(want, rel=1e-6)
    assert res.verdict == "agree" and res.records[1].argmax_agreement is None
    # and a device whose update never lands is caught
    args = (prep.model, torch.device("cpu"), resolved, "fp32", False, prep.splits.transform, torch.float32, "regression")
    prep = parity.prepare(resolved, ("cpu", "cpu"), steps=4)
    bad = parity.execute(prep, reps=(parity.Replica(*args), _LostUpdate(*args)))
    assert bad.verdict == "diverge" and bad.first_divergence is not None and bad.first_divergence[0] <= 2, bad.summary()


def test_image_transform_scales_batches_of_any_rank_keeping_the_batch_axis() -> None:
    t = ImageTransform()
    x = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    assert t(x).shape == (2, 8) and torch.allclose(t(x), x.float() / 255)
    assert t.output_shape((8,)) == (8,)
    img = torch.full((3, 1, 4, 4), 255, dtype=torch.uint8)
    norm = ImageTransform(mean=(0.5,), std=(0.25,))
    assert norm(img).shape == (3, 1, 4, 4) and torch.allclose(norm(img), torch.full((3, 1, 4, 4), 2.0))
    with pytest.raises(ValueError, match="image"):
        ImageTransform(resize=8)(x)


SYN = """\
device: cpu
epochs: 3
batch_size: 64
model: {{name: mlp, hidden: [64]}}
optimizer: {{name: adam, lr: 0.01}}
dataset: {{name: synthetic, shape: {shape}, dtype: uint8, task: {task}, num_outputs: {k}, train_size: 2000, val_size: 400}}
tracking: {{experiment: syn}}
"""


@pytest.mark.parametrize("shape, task, k", [("[8]", "regression", 1), ("[8]", "classification", 1), ("[2, 6]", "regression", 3)])
def test_synthetic_uint8_samples_of_any_rank_train(work: Workdir, shape: str, task: str, k: int) -> None:
    """uint8 once broke every non-image shape: the scaling lost the batch axis ((N, 8) -> (1, 1, N, 8))."""
    r = work.cli("run", work.write("s.yaml", SYN.format(shape=shape, task=task, k=k)), "-q")
    assert r.exit_code == 0, r.output
    m = work.runs("syn")[-1].data.metrics
    if task == "regression":  # a fixed linear function of the inputs plus noise: R^2 near 0.9 is learnable
        assert m["val_r2"] > 0.6 and not math.isnan(m["val_mae"]) and "val_accuracy" not in m
    else:
        assert "val_accuracy" in m and "val_r2" not in m


def _doc_block(after: str, lang: str) -> str:
    """The first ```lang block after the heading `after` in docs/plugins.md."""
    text = (RECIPES.parent / "docs" / "plugins.md").read_text()
    rest = text[text.index(after):]
    start = rest.index(f"```{lang}\n") + len(lang) + 4
    return rest[start : rest.index("```", start)]


def test_docs_callback_example_runs_as_written(work: Workdir, fake_dist) -> None:  # type: ignore[no-untyped-def]
    """docs/plugins.md's StopAtAccuracy, registered under the name its snippet gives, stops a real run."""
    source = _doc_block("### Callbacks", "python")
    name, target = _doc_block("### Callbacks", "toml").split("\n")[1].split(" = ")
    fake_dist("my-lab", source, callbacks={name: target.strip('"').split(":")[1]})
    recipe = (
        "device: cpu\nepochs: 6\nbatch_size: 32\nseed: 0\ndataset: {name: digits}\nmodel: {name: mlp, hidden: [32]}\n"
        "optimizer: {name: sgd, lr: 0.1}\ntracking: {experiment: cb}\n"
        + _doc_block("### Callbacks", "yaml").split("#")[0].replace("0.9", "0.5")
    )
    r = work.cli("run", work.write("cb.yaml", recipe), "-q")
    assert r.exit_code == 0, r.output
    (run,) = work.runs("cb")
    assert run.info.status == "FINISHED"
    assert "stopped: val_accuracy reached 0.5" in r.stdout
    gaps = work.history(run.info.run_id, "gap_to_target")
    assert len(gaps) < 6 and gaps[-1][1] <= 0  # stopped at the first epoch at or over the target
    assert "target.txt" in {a.path for a in work.client().list_artifacts(run.info.run_id)}


@pytest.mark.parametrize(
    "args, says",
    [
        ((TABULAR, "loss.name=cross_entropy"), "'cross_entropy' is a classification loss, but this dataset's task is regression"),
        ((RECIPES / "digits_mlp.yaml", "loss.name=mse"), "'mse' is a regression loss, but this dataset's task is classification"),
    ],
)
def test_a_loss_of_the_other_task_is_bad_input_not_a_meaningless_run(work: Workdir, args: tuple, says: str) -> None:
    """cross_entropy on float targets once trained to a falling loss and an R^2 of -749, exit 0."""
    r = work.cli("run", *args, "device=cpu", "epochs=1", "-q")
    assert r.exit_code == 2, r.output
    assert says in " ".join(r.output.split())
    assert not work.runs("tabular_regression") and not work.runs("digits_mlp")


def test_bench_of_a_regression_recipe_tables_val_r2(work: Workdir) -> None:
    """A regression cell once crashed the bench (KeyError: final_val_accuracy) after its run finished."""
    import csv

    r = work.cli("bench", TABULAR, "device=cpu", "epochs=1", "matrix={batch_size: [32, 64]}", "--out", work.path / "out")
    assert r.exit_code == 0, r.output
    children = [c for c in work.runs("tabular_regression") if c.data.tags.get("mpsrun.bench") == "child"]
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert "val r2" in r.stdout and "val acc" not in r.stdout
    for c in children:  # every figure printed is a child's, from the store
        assert f"{c.data.metrics['val_r2']:.4f}" in r.stdout
    rows = list(csv.DictReader(open(work.path / "out" / "results.csv")))
    assert [float(x["val_r2_median"]) > 0.5 for x in rows] == [True, True]
    r = work.cli("compare", "tabular_regression")
    assert r.exit_code == 0 and "val r2" in r.stdout, r.output
