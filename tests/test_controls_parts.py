"""The parts behind the training controls, checked against references: metrics against
scikit-learn, clipping against its definition, exact accumulation's weights, the graph-safe
SGD against torch's SGD, and callback and loss plugins installed as real distributions.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import Workdir, _clear_plugin_cache


def test_regression_metrics_match_scikit_learn_in_target_units() -> None:
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    from mpsrun.train.loop.metrics import MetricSet

    g = torch.Generator().manual_seed(0)
    y = torch.randn(500, generator=g)
    out = (y + 0.3 * torch.randn(500, generator=g)).unsqueeze(1)  # (N, 1) against (N,)
    mean, std = 70.0, 12.5  # the dataset standardised its target with these
    ms = MetricSet("regression", torch.device("cpu"), ["mse"], target_mean=mean, target_std=std)
    for i in range(0, 500, 64):  # batch by batch, as the step does
        ms.update(out[i : i + 64], y[i : i + 64])
    got = ms.compute(500)
    yt, pt = (y * std + mean).numpy(), (out.squeeze(1) * std + mean).numpy()
    assert got["val_mae"] == pytest.approx(mean_absolute_error(yt, pt), rel=1e-5)
    assert got["val_mse"] == pytest.approx(mean_squared_error(yt, pt), rel=1e-5)
    assert got["val_rmse"] == pytest.approx(mean_squared_error(yt, pt) ** 0.5, rel=1e-5)
    assert got["val_r2"] == pytest.approx(r2_score(yt, pt), rel=1e-4)
    assert "val_accuracy" not in got


def test_classification_metrics_and_top5() -> None:
    from mpsrun.train.loop.metrics import MetricSet

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 20, generator=g)
    y = torch.randint(0, 20, (300,), generator=g)
    ms = MetricSet("classification", torch.device("cpu"), num_classes=20)
    ms.update(logits, y)
    got = ms.compute(300)
    assert got["val_accuracy"] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    top5 = (logits.topk(5, 1).indices == y[:, None]).any(1).float().mean().item()
    assert got["val_top5_accuracy"] == pytest.approx(top5)
    assert "val_top5_accuracy" not in MetricSet("classification", torch.device("cpu"), num_classes=10).names


def test_clip_scales_to_max_norm_and_keeps_the_largest_pre_clip_norm() -> None:
    from mpsrun.train.loop.objective import Objective

    model = torch.nn.Linear(4, 3)
    obj = Objective.default(torch.device("cpu"))
    obj.max_norm, obj.grad_norm = 0.5, torch.zeros(())
    norms = []
    for scale in (10.0, 3.0):
        for p in model.parameters():
            p.grad = torch.full_like(p, scale)
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        obj.clip(model)
        after = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        assert after == pytest.approx(0.5, rel=1e-4)
    assert obj.epoch_metrics() == {"grad_norm": pytest.approx(max(norms), rel=1e-5)}
    assert obj.grad_norm.item() == 0.0  # reset for the next epoch


def test_micro_batch_weights_make_each_group_a_mean_over_its_samples() -> None:
    from mpsrun.train.loop.objective import micro_batches

    plan = list(micro_batches(n=1437, batch_size=16, accumulate=4))
    assert len(plan) == 90
    groups, cur = [], []
    for w, first, last in plan:
        if first:
            cur = []
        cur.append(w)
        if last:
            groups.append(cur)
    assert len(groups) == 23 and all(sum(g) == pytest.approx(1.0) for g in groups)
    assert groups[-1] == pytest.approx([16 / 29, 13 / 29])  # the short last group: 29 samples
    assert list(micro_batches(100, 32, 1)) == [(1.0, True, True)] * 4


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, {"momentum": 0.5, "dampening": 0.1, "maximize": True}])
def test_tensor_lr_sgd_matches_torch_sgd(kw: dict) -> None:
    """Under CUDA graphs SGD runs as TensorLRSGD with a device-tensor rate; it must be torch's SGD."""
    from torch.optim.lr_scheduler import CosineAnnealingLR

    from mpsrun.train.controls.schedulers import tensor_lr

    torch.manual_seed(0)
    a = torch.nn.Linear(6, 4)
    b = torch.nn.Linear(6, 4)
    b.load_state_dict(a.state_dict())
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1, **kw), torch.optim.SGD(b.parameters(), lr=0.1, **kw)
    tensor_lr(ob, torch.device("cpu"))
    assert torch.is_tensor(ob.param_groups[0]["lr"]) and type(ob).__name__ == "TensorLRSGD"
    sa, sb = CosineAnnealingLR(oa, T_max=5), CosineAnnealingLR(ob, T_max=5)
    for step in range(6):
        x = torch.randn(8, 6)
        for m, o, s in ((a, oa, sa), (b, ob, sb)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            s.step()
    assert float(ob.param_groups[0]["lr"]) == pytest.approx(oa.param_groups[0]["lr"])
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_names_resolve_as_users_spell_them() -> None:
    from mpsrun.plugins.components import loss_factory, scheduler_class, snake

    assert [snake(n) for n in ("BCEWithLogits", "SmoothL1", "MSE", "KLDiv", "CrossEntropy")] == ["bce_with_logits", "smooth_l1", "mse", "kl_div", "cross_entropy"]
    assert loss_factory("huber") is torch.nn.HuberLoss and loss_factory("nll") is torch.nn.NLLLoss
    for spelling in ("CosineAnnealingLR", "cosineannealinglr", "cosine_annealing_lr"):
        assert scheduler_class(spelling) is torch.optim.lr_scheduler.CosineAnnealingLR


PLUGIN = '''
import torch
from mpsrun.train.controls.callbacks import Callback


class Halver(Callback):
    """Logs twice the epoch as `halver_metric`, writes a note, and stops after `stop_after` epochs."""

    def __init__(self, stop_after: int = 2) -> None:
        self.stop_after = stop_after
        self.seen = 0

    def on_epoch_end(self, run, epoch, metrics):
        self.seen += 1
        run.log.log_metrics({"halver_metric": 2.0 * epoch, "halver_val_loss": metrics["val_loss"]}, step=epoch)
        if self.seen >= self.stop_after:
            run.log.log_text(f"stopped after {self.seen}", "halver.txt")
            run.request_stop(f"halver: {self.seen} epochs are enough")

    def state_dict(self):
        return {"seen": self.seen}


class HalfCE(torch.nn.Module):
    """Half the cross-entropy: a plugin loss."""

    def __init__(self, factor: float = 0.5) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, out, y):
        return self.factor * torch.nn.functional.cross_entropy(out, y)
'''


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A throwaway installed distribution with a callback and a loss entry point."""
    site = tmp_path / "site_cb"
    site.mkdir()
    (site / "cbplug_mod.py").write_text(PLUGIN)
    info = site / "cbplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cbplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mpsrun.callbacks]\nhalver = cbplug_mod:Halver\n\n[mpsrun.losses]\nhalf_ce = cbplug_mod:HalfCE\n")
    monkeypatch.syspath_prepend(str(site))
    _clear_plugin_cache()
    yield site
    sys.modules.pop("cbplug_mod", None)
    _clear_plugin_cache()


RECIPE = """\
device: cpu
epochs: 5
batch_size: 64
dataset: {name: digits}
model: {name: mlp, hidden: [16]}
optimizer: {name: sgd, lr: 0.1}
tracking: {experiment: cb}
"""


def test_callback_plugin_logs_its_metric_and_artifact_and_stops_the_run(work: Workdir, plugin_dist: Path) -> None:
    p = work.write("cb.yaml", RECIPE + "callbacks: [{name: halver, stop_after: 2}]\nloss: {name: half_ce, factor: 0.5}\n")
    r = work.cli("run", p, "-q")
    assert r.exit_code == 0, r.output
    run = work.runs("cb")[-1]
    assert run.info.status == "FINISHED"
    assert work.history(run.info.run_id, "halver_metric") == [(0, 0.0), (1, 2.0)]
    assert len(work.history(run.info.run_id, "val_loss")) == 2  # stopped after two of five epochs
    assert "halver: 2 epochs are enough" in r.stdout
    assert "halver.txt" in [a.path for a in work.client().list_artifacts(run.info.run_id)]
    assert run.data.params["loss.name"] == "half_ce"


def test_callback_plugin_arguments_are_checked_with_did_you_mean(work: Workdir, plugin_dist: Path) -> None:
    r = work.cli("run", work.write("cb.yaml", RECIPE + "callbacks: [{name: halver, stop_aftr: 2}]\n"), "-q")
    assert r.exit_code == 2
    assert "callbacks.0.stop_aftr" in r.stderr and "did you mean 'stop_after'" in r.stderr
