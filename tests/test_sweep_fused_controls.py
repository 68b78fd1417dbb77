"""Fused sweeps with early stopping and gradient accumulation: each member stops, accumulates and steps its schedule
as its solo `mpsrun run` does, number for number on the CPU (sweep/fused/controls.py, engine.py).

Real digits data, real PyTorch, a real MLflow store for the CLI sweep.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.conftest import Workdir
from tests.test_sweep_fused import BASE, PLACE, _fused_vs_solo, _Trial

STOPPING = """\
device: cpu
epochs: 6
batch_size: 32
seed: 0
dataset:
  name: digits
model:
  name: mlp
  hidden: [16]
optimizer:
  name: sgd
  lr: 0.05
  momentum: 0.9
early_stopping:
  monitor: val_loss
  patience: 1
tracking:
  experiment: fused_es
"""


class _Tags:
    """A solo run's `log` for its callbacks: the tags they set, kept."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)


def _group(tmp_path: Path, text: str, variants: list[dict[str, Any]],
           on_epoch: Callable[[Any, int, dict[str, float]], Any] = lambda m, e, metrics: None) -> tuple[list, list]:
    """The variants as one fused group on the CPU: (members, their recipes)."""
    from mpsrun.plugins import resolve
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused import engine, members

    path = tmp_path / "r.yaml"
    path.write_text(text)
    base = resolve(path)
    recs = [trial_recipe(base, {**v, **PLACE}) for v in variants]
    mems = [members.Member(_Trial(i), v, r, {}) for i, (v, r) in enumerate(zip(variants, recs))]
    engine.Group(members.build(mems, {})).run(on_epoch)
    return mems, recs


def _solo(r: Any) -> tuple[Any, dict[str, str]]:
    """The recipe trained alone by `mpsrun run`'s engine with its own callbacks: (its result, the tags they set)."""
    from mpsrun.train import runner
    from mpsrun.train.controls.callbacks import Callbacks, RunState
    from mpsrun.train.loop.engine import Listener, train

    s = runner.prepare(r)
    log = _Tags()
    state = RunState(s.model, s.optimizer, s.choice.device, r.recipe.epochs, log=log)  # type: ignore[arg-type]
    res = train(s.model, s.optimizer, s.plan, s.choice.device, r.recipe.epochs, s.options, Listener(), callbacks=Callbacks(*s.callbacks),
                state=state, objective=s.objective)
    return res, log.tags


VARIANTS = [{"early_stopping.min_delta": 0.2},  # stops after epoch 3
            {"early_stopping.min_delta": 0.05},  # after epoch 5
            {"early_stopping.patience": 2, "early_stopping.min_delta": 0.05, "seed": 3},  # never: improves often enough
            {"early_stopping.patience": 6, "optimizer.lr": 0.1},  # never
            {"early_stopping.monitor": "val_accuracy", "early_stopping.mode": "max", "optimizer.lr": 0.2}]  # its own monitor


def test_members_stop_early_each_at_its_solo_run_s_epoch_with_its_numbers_and_tags(tmp_path: Path) -> None:
    """Own patience, min_delta, monitor and mode: each member leaves the group the epoch its run stops, with that run's
    per-epoch losses (exactly, on the CPU), its stop reason and its `mpsrun.stopped_early` tags; the others train on."""
    mems, recs = _group(tmp_path, STOPPING, VARIANTS)
    lengths = []
    for m, r in zip(mems, recs):
        res, tags = _solo(r)
        lengths.append(len(res.epochs))
        assert len(m.history) == len(res.epochs), (m.values, len(m.history), len(res.epochs))
        for e, em in enumerate(res.epochs):
            for k in ("train_loss", "val_loss", "val_accuracy", "lr"):
                assert em.metrics()[k] == m.history[e][k], (m.values, e, k, em.metrics()[k], m.history[e][k])
        assert m.stop_reason == res.stop_reason and m.end_tags == tags, (m.values, m.stop_reason, res.stop_reason, m.end_tags, tags)
        assert m.state == "COMPLETE"
    assert lengths[:4] == [3, 5, 6, 6], lengths  # different epochs, and some never stop: what the test is about
    assert mems[0].end_tags["mpsrun.stopped_early"] == "2" and "mpsrun.stopped_early" not in mems[3].end_tags


def test_a_member_pruned_the_epoch_it_stops_early_is_pruned_as_its_trial_would_be(tmp_path: Path) -> None:
    """Early stopping runs before the pruner's report (a trial's order of callbacks): both at one epoch, the trial is
    PRUNED and its run carries the early stop's tags too, as an unfused trial's does."""
    seen: list[tuple[int, int, bool]] = []

    def prune_at_2(m: Any, e: int, metrics: dict[str, float]) -> Any:
        seen.append((m.number, e, m.stop_reason is not None))  # the member's early stopping has spoken already
        return ("PRUNED", "pruned by the test") if m.number == 0 and e == 2 else None

    mems, _ = _group(tmp_path, STOPPING, VARIANTS[:2], prune_at_2)
    assert (0, 2, True) in seen
    assert mems[0].state == "PRUNED" and mems[0].end_tags["mpsrun.stopped_early"] == "2" and len(mems[0].history) == 3
    assert mems[1].state == "COMPLETE" and len(mems[1].history) == 5


def test_an_early_stopping_monitor_the_run_never_logs_is_refused_in_the_run_s_words(tmp_path: Path) -> None:
    from mpsrun.plugins import resolve
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused import members
    from mpsrun.train import runner

    path = tmp_path / "bad.yaml"
    path.write_text(STOPPING.replace("monitor: val_loss", "monitor: val_r2"))
    r = trial_recipe(resolve(path), PLACE)
    with pytest.raises(runner.InputError) as solo:
        runner.prepare(r)
    with pytest.raises(members.Unfusable) as fused:
        members.build([members.Member(_Trial(i), {}, r, {}) for i in range(2)], {})
    assert str(fused.value) == str(solo.value) and "early_stopping.monitor: 'val_r2' is not a metric of this run" in str(fused.value)


ACCUMULATED = BASE.replace("epochs: 2", "epochs: 3").replace("seed: 0\n", "seed: 0\naccumulate: 2\n") + """\
scheduler:
  name: CosineAnnealingLR
  T_max: 60
  interval: step
  warmup_epochs: 1
  warmup_start_factor: 0.2
grad_clip:
  max_norm: 0.5
"""


def test_accumulating_members_with_per_step_schedules_equal_their_solo_runs_on_the_cpu(tmp_path: Path) -> None:
    """accumulate: 2 over digits' 45 batches a epoch: 22 pairs and a lone short batch (weight 1), 23 optimizer steps
    an epoch, which the per-step schedules (warm-up of one epoch: 23 steps) count; the clip on each group's gradient.
    accumulate: 3: 15 groups, the last of 32 + 32 + 29 samples (weighted 32/93, 32/93, 29/93). Each member's losses,
    accuracies, rates and grad_norm are its run's, exactly."""
    variants = [{"optimizer.lr": 0.2, "optimizer.momentum": 0.9}, {"optimizer.lr": 0.1, "scheduler.T_max": 30, "grad_clip.max_norm": 5.0, "seed": 3}]
    pairs = _fused_vs_solo(tmp_path, "sgd", variants, base_text=ACCUMULATED)
    assert all(a == b for a, b in pairs), pairs
    ragged = ACCUMULATED.replace("accumulate: 2", "accumulate: 3")
    adam = [{"optimizer.lr": 3e-3}, {"optimizer.lr": 1e-2, "seed": 2, "scheduler.warmup_epochs": 0}]
    pairs = _fused_vs_solo(tmp_path, "adam", adam, base_text=ragged)
    assert all(a == b for a, b in pairs), pairs


def test_accumulate_and_early_stopping_fuse_and_a_cuda_group_that_accumulates_says_it_trains_eager(tmp_path: Path) -> None:
    """Neither keeps a trial unfused any more; `accumulate` is the group's (not a value members may differ in); a CUDA
    group that accumulates runs eager and says why, as a solo run keeps its graphs off for it."""
    import torch

    from mpsrun.plugins import resolve
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused import graphed, group

    path = tmp_path / "both.yaml"
    path.write_text(STOPPING.replace("seed: 0\n", "seed: 0\naccumulate: 4\n"))
    base = resolve(path)
    a, b = (trial_recipe(base, {**v, **PLACE}) for v in ({"early_stopping.patience": 2}, {"early_stopping.min_delta": 0.1}))
    assert group.recipe_why_not(a) is None and group.shape_key(a) == group.shape_key(b)
    other = trial_recipe(base, {"accumulate": 2, **PLACE})
    assert group.differing(a, other) == ["accumulate"]
    fake = types.SimpleNamespace(device=torch.device("cuda"), members=[types.SimpleNamespace(resolved=a)], schedules=None, accumulate=4)
    on, note = graphed.wanted(fake)  # type: ignore[arg-type]
    assert not on and note.startswith("graphs: accumulate: 4 steps the optimizer every 4 micro-batches")


ES_SWEEP = STOPPING.replace("fused_es", "fused_es_cli") + """\
sweep:
  metric: val_loss
  sampler: grid
  pruner: none
  trials: 3
  params:
    early_stopping.min_delta: [0.2, 0.05, 0.0]
    early_stopping.patience: [1]
"""


def test_a_sweep_with_early_stopping_fuses_and_a_member_that_stops_is_tagged_as_its_run(work: Workdir) -> None:
    """Through the real CLI: the trials fuse (no "ran unfused" note); a member that stops early is FINISHED, its trial
    COMPLETE, with its run's `mpsrun.stopped_early` tags and its run's epochs (exactly: one thread each)."""
    import torch

    path = work.write("es.yaml", ES_SWEEP)
    r = work.cli("sweep", str(path), "-q")
    assert r.exit_code == 0, r.output
    runs = work.runs("fused_es_cli")
    parent = [k for k in runs if k.data.tags.get("mpsrun.sweep") == "parent"][0]
    kids = [k for k in runs if k.data.tags.get("mpsrun.sweep") == "trial"]
    notes = parent.data.tags.get("mpsrun.notes", "")
    assert "ran unfused" not in notes, notes
    assert len(kids) == 3 and len({k.data.tags.get("mpsrun.sweep.group") for k in kids}) == 1, [k.data.tags for k in kids]
    assert all(k.info.status == "FINISHED" and k.data.tags["mpsrun.sweep.state"] == "COMPLETE" for k in kids)
    import csv

    table = Path(work.client().download_artifacts(parent.info.run_id, "trials.csv", str(work.path)))
    told = {row["run_id"]: row for row in csv.DictReader(table.open())}  # what the study was told, trial by trial
    quiet = ["tracking.log_model=false", "tracking.figures=false", "tracking.system_metrics=false", "checkpoint.every=0"]
    threads = torch.get_num_threads()
    stopped = 0
    for kid in kids:
        torch.set_num_threads(1)  # as the fused CPU group trains (work.torch_threads)
        try:
            solo = work.cli("run", str(path), "-q", f"early_stopping.min_delta={kid.data.params['early_stopping.min_delta']}", *quiet)
        finally:
            torch.set_num_threads(threads)
        assert solo.exit_code == 0, solo.output
        alone = [x for x in work.runs("fused_es_cli") if "mpsrun.sweep" not in x.data.tags][-1]
        for tag in ("mpsrun.stopped_early", "mpsrun.stopped_early.reason"):
            assert kid.data.tags.get(tag) == alone.data.tags.get(tag), (tag, kid.data.tags.get(tag), alone.data.tags.get(tag))
        stopped += "mpsrun.stopped_early" in kid.data.tags
        for metric in ("train_loss", "val_loss"):
            assert [v for _, v in work.history(alone.info.run_id, metric)] == [v for _, v in work.history(kid.info.run_id, metric)], metric
        last = work.history(alone.info.run_id, "val_loss")[-1][1]
        assert told[kid.info.run_id]["state"] == "COMPLETE" and float(told[kid.info.run_id]["val_loss"]) == last  # its last epoch's value
    assert stopped >= 1


DEVICE = "cuda"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device: the fused CUDA group (graphs chosen, then eager) against solo CUDA runs")
def test_accumulating_stopping_members_on_cuda_follow_their_solo_cuda_runs(tmp_path: Path) -> None:
    """On CUDA: the group `graphed.group_for` picks for accumulate + a per-step schedule + the clip + early stopping is
    eager (said), and each member's epochs, stop and per-epoch losses follow its own solo CUDA run (float32 sums in
    other orders: within 1e-3, as the plain CUDA members' test)."""
    from mpsrun.plugins import resolve
    from mpsrun.recipe.sweep import trial_recipe
    from mpsrun.sweep.fused import graphed, members

    text = ACCUMULATED.format(device=DEVICE, optimizer="sgd").replace("epochs: 3", "epochs: 5") + "early_stopping:\n  patience: 1\n  min_delta: 0.1\n"
    path = tmp_path / "cuda.yaml"
    path.write_text(text)
    base = resolve(path)
    variants = [{"optimizer.lr": 0.2, "optimizer.momentum": 0.9}, {"optimizer.lr": 0.1, "grad_clip.max_norm": 5.0, "seed": 3, "early_stopping.patience": 5}]
    recs = [trial_recipe(base, {**v, **PLACE}) for v in variants]
    mems = [members.Member(_Trial(i), v, r, {}) for i, (v, r) in enumerate(zip(variants, recs))]
    said: list[str] = []
    g, note = graphed.group_for(members.build(mems, {}), said.append)
    assert not isinstance(g, graphed.GraphedGroup) and note == said[0] == graphed.PER_STEP, (type(g), note, said)
    g.run(lambda m, e, metrics: None)
    lengths = []
    for m, r in zip(mems, recs):
        res, tags = _solo(r)
        lengths.append(len(res.epochs))
        stopped = {k: v for k, v in tags.items() if k.startswith("mpsrun.stopped_early")}  # a CUDA run's log has its data tags too
        assert len(m.history) == len(res.epochs) and m.end_tags == stopped, (m.values, len(m.history), len(res.epochs), m.end_tags, stopped)
        for e, em in enumerate(res.epochs):
            for k in ("train_loss", "val_loss"):
                a, b = em.metrics()[k], m.history[e][k]
                assert abs(a - b) <= 1e-3 * abs(a), (m.values, e, k, a, b)
            assert em.metrics()["lr"] == pytest.approx(m.history[e]["lr"], rel=1e-6)
    assert lengths[0] < 5 and lengths[1] == 5, lengths  # one stopped early, one trained every epoch
