"""`mpsrun bench` / `mpsrun compare`, matrices, the torchvision zoo plugin, and honest timers.

Everything runs for real: PyTorch training on the CPU, a real MLflow SQLite store in
a temporary directory, the real CLI. The only stand-ins are for hardware this
machine lacks (tests named `mps_mock` / `cuda_mock`) and a throwaway plugin whose
model fails the way an unsupported operation or an out-of-memory error does.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mpsrun.devices import resolve as devices
from mpsrun.recipe import matrix
from mpsrun.train.loop import engine
from mpsrun.train import runner
from mpsrun.bench.compare import ChildRun, build_rows, columns, compute_speedups, Table
from mpsrun.plugins import resolve
from mpsrun.recipe import RecipeError

from .conftest import RECIPES

GRID = """\
device: cpu
epochs: 2
batch_size: 32
seed: 0
dataset:
  name: digits
model:
  name: mlp
  hidden: [16]
optimizer:
  name: adam
  lr: 0.003
matrix:
  batch_size: [32, 64]
  model.hidden: [[16], [32]]
tracking:
  experiment: grid
"""

NAMESPACES = ("device.", "cpu.", "mps.", "cuda.", "sw.")


def _table_block(text: str, parent_id: str) -> str:
    """The printed table: from its title line to its caption."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if f"bench {parent_id}" in line and ":" in line)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("Steady epoch"))
    return "\n".join(line.rstrip() for line in lines[start : end + 1])


def _parent_and_children(work, experiment: str):  # type: ignore[no-untyped-def]
    runs = work.runs(experiment)
    parents = [r for r in runs if r.data.tags.get("mpsrun.bench") == "parent"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return parent, sorted(children, key=lambda r: int(r.data.tags["bench.cell_index"]))


# ----------------------------------------------------------------------------- acceptance


def test_2x2_matrix_gives_parent_four_children_table_artifacts_and_compare_reprints_it(work) -> None:
    p = work.write("grid.yaml", GRID)
    r = work.cli("bench", p, "--out", work.path / "out")
    assert r.exit_code == 0, r.output
    assert "4 cells x 1 repeats = 4 runs" in r.stdout
    parent, children = _parent_and_children(work, "grid")
    pid = parent.info.run_id
    assert len(work.runs("grid")) == 5
    assert len(children) == 4
    assert [json.loads(c.data.tags["bench.cell"]) for c in children] == [
        {"batch_size": 32, "model.hidden": [16]},
        {"batch_size": 32, "model.hidden": [32]},
        {"batch_size": 64, "model.hidden": [16]},
        {"batch_size": 64, "model.hidden": [32]},
    ]
    for c in children:
        assert c.info.status == "FINISHED"
        assert c.data.tags["mpsrun.bench"] == "child"
        vals = json.loads(c.data.tags["bench.cell"])
        assert c.data.params["batch_size"] == str(vals["batch_size"])  # the cell really ran with its values
        assert c.data.params["model.hidden"] == str(vals["model.hidden"]).replace(",", ", ")
        assert len(work.history(c.info.run_id, "system/epoch_time_s")) == 2
    # Every figure printed comes from a child run in the store.
    for c in children:
        assert f"{c.data.metrics['system/steady_epoch_time_s']:.3f}" in r.stdout
        assert f"{c.data.metrics['val_accuracy']:.4f}" in r.stdout  # the latest: the last epoch's
    # Artifacts on the parent, and the same files under --out.
    arts = {a.path for a in work.client().list_artifacts(pid)}
    assert {"results.csv", "results.md", "results.png", "plan.json", "recipe.yaml"} <= arts
    rows = list(csv.DictReader(open(work.path / "out" / "results.csv")))
    assert [(x["batch_size"], x["model.hidden"], x["status"]) for x in rows] == [
        ("32", "[16]", "ok"), ("32", "[32]", "ok"), ("64", "[16]", "ok"), ("64", "[32]", "ok")
    ]
    by_id = {c.info.run_id: c for c in children}
    for x in rows:
        assert float(x["steady_epoch_time_s_median"]) == by_id[x["run_ids"]].data.metrics["system/steady_epoch_time_s"]
    md = (work.path / "out" / "results.md").read_text()
    assert md.count("\n| ") == 6 and "| batch_size | model.hidden | device |" in md
    png = (work.path / "out" / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # compare, from MLflow alone: by parent id, by experiment, by a child's id: the same table.
    printed = _table_block(r.stdout, pid)
    for target in (pid, "grid", children[2].info.run_id):
        c = work.cli("compare", target)
        assert c.exit_code == 0, c.output
        assert _table_block(c.stdout, pid) == printed
    # Every run, parent included, says what it ran on.
    for run in work.runs("grid"):
        tags = run.data.tags
        assert sum(k.startswith(NAMESPACES) for k in tags) >= 8, run.info.run_id
        assert {"cpu.brand", "sw.torch", "sw.mlflow", "mps.available", "cuda.available"} <= set(tags)


FAILING_PLUGIN = """\
import torch
from torch import nn


class Flaky(nn.Module):
    def __init__(self, mode: str, width: int, num_classes: int) -> None:
        super().__init__()
        self.mode = mode
        self.lin = nn.Linear(width, num_classes)

    def forward(self, x):
        if self.mode == "unsupported":
            raise NotImplementedError("The operator 'aten::fake_op' is not currently implemented for the MPS device")
        if self.mode == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if self.mode == "interrupt":
            raise KeyboardInterrupt
        return self.lin(x.flatten(1))


def flaky(input_shape: tuple, num_classes: int, mode: str = "ok") -> nn.Module:
    return Flaky(mode, int(torch.tensor(input_shape).prod()), num_classes)
"""


def test_failing_cells_are_failed_children_and_the_bench_goes_on(work, fake_dist) -> None:
    fake_dist("flakyplug", FAILING_PLUGIN, models={"flaky": "flaky"})
    p = work.write(
        "flaky.yaml",
        """\
        device: cpu
        epochs: 2
        batch_size: 64
        dataset: {name: digits}
        model: {name: flaky}
        optimizer: {name: sgd, lr: 0.05}
        matrix:
          model.mode: [unsupported, oom, ok]
          device: [cpu, mps]
          exclude:
            - {model.mode: unsupported, device: mps}
            - {model.mode: oom, device: mps}
        tracking: {experiment: flaky}
        """,
    )
    r = work.cli("bench", p)
    assert r.exit_code == 1, r.output  # some cells failed: said in the exit code, after the table
    assert "3 of 4 cells failed" in r.stderr
    parent, children = _parent_and_children(work, "flaky")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["bench.cells_failed"] == "3"
    got = [(json.loads(c.data.tags["bench.cell"]), c.info.status) for c in children]
    assert got == [
        ({"model.mode": "unsupported", "device": "cpu"}, "FAILED"),
        ({"model.mode": "oom", "device": "cpu"}, "FAILED"),
        ({"model.mode": "ok", "device": "cpu"}, "FINISHED"),  # ran after two failures
        ({"model.mode": "ok", "device": "mps"}, "FAILED"),  # MPS really is absent here
    ]
    errors = [c.data.tags.get("mpsrun.error", "") for c in children]
    assert "NotImplementedError" in errors[0] and "aten::fake_op" in errors[0]
    assert "OutOfMemoryError" in errors[1]
    assert errors[2] == ""
    assert "device 'mps' is unusable" in errors[3]
    for c in (children[0], children[1], children[3]):
        assert "error.txt" in {a.path for a in work.client().list_artifacts(c.info.run_id)}
    assert children[3].data.tags["device.actual"] == "none"  # no device is claimed for a cell that never ran
    assert children[2].data.metrics["val_accuracy"] > 0.5
    table = _table_block(r.stdout, parent.info.run_id)
    assert "FAILED: NotImplementedError" in table and "FAILED: OutOfMemoryError" in table
    assert "speed-up vs cpu" in table
    assert re.search(r"\| ok +\|", table.replace("│", "|"))


def test_interrupted_bench_is_killed_and_still_tabled(work, fake_dist) -> None:
    fake_dist("flakyplug", FAILING_PLUGIN, models={"flaky": "flaky"})
    p = work.write(
        "stop.yaml",
        """\
        device: cpu
        epochs: 1
        dataset: {name: digits}
        model: {name: flaky}
        optimizer: {name: sgd, lr: 0.05}
        matrix:
          model.mode: [ok, interrupt, unsupported]
        tracking: {experiment: stop}
        """,
    )
    r = work.cli("bench", p)
    assert r.exit_code == 130
    parent, children = _parent_and_children(work, "stop")
    assert parent.info.status == "KILLED"
    assert [c.info.status for c in children] == ["FINISHED", "KILLED"]  # the third never started
    assert "results.csv" in {a.path for a in work.client().list_artifacts(parent.info.run_id)}
    c = work.cli("compare", "stop")
    assert c.exit_code == 0
    table = _table_block(c.stdout, parent.info.run_id)
    assert "KILLED: interrupted" in table and "not run" in table


def test_bench_and_compare_help_is_true(work) -> None:
    r = work.cli("bench", "--help")
    assert r.exit_code == 0 and "matrix.device=[cpu,cuda]" in r.stdout and "--baseline" in r.stdout
    r = work.cli("compare", "--help")
    assert r.exit_code == 0 and "latest bench" in " ".join(r.stdout.split())


# ----------------------------------------------------------------------------- input errors


def test_matrix_problems_are_located_and_nothing_runs(work) -> None:
    p = work.write(
        "bad.yaml",
        GRID.replace("  batch_size: [32, 64]", "  batch_sise: [32, 64]") + "repeats: 0\n",
    )
    r = work.cli("bench", p)
    assert r.exit_code == 2
    assert "bad.yaml:14:3: matrix.batch_sise: unknown recipe path (did you mean 'batch_size'?)" in r.stderr
    assert "repeats" in r.stderr
    assert not work.runs("grid")
    # a bad value inside an axis is reported at that value's position, once
    p2 = work.write("bad2.yaml", GRID.replace("[32, 64]", "[32, 0]"))
    r = work.cli("bench", p2)
    assert r.exit_code == 2, r.output
    assert "bad2.yaml:14:20: batch_size: Input should be greater than or equal to 1" in r.stderr, r.stderr
    assert r.stderr.count("batch_size") == 1  # two cells hold the value: said once
    assert not work.runs("grid")
    # from the command line, the override is named
    r = work.cli("validate", p, "matrix={device: [cpu, tpu]}", "repeats=1")
    assert r.exit_code == 2
    assert "override 'matrix={device: [cpu, tpu]}': device:" in r.stderr


def test_baseline_must_be_a_device_some_cell_runs_on(work) -> None:
    p = work.write("grid.yaml", GRID)
    r = work.cli("bench", p, "--baseline", "mps")
    assert r.exit_code == 2 and "no cell runs on mps" in r.stderr
    r = work.cli("bench", p, "--baseline", "tpu")
    assert r.exit_code == 2 and "--baseline must be" in r.stderr
    assert not work.runs("grid")


def test_run_refuses_a_matrix_unless_every_axis_is_pinned(work) -> None:
    p = work.write("grid.yaml", GRID)
    r = work.cli("run", p, "-q")
    assert r.exit_code == 2
    assert "matrix of 4 cells" in r.stderr and "mpsrun bench" in r.stderr
    assert "batch_size=32 model.hidden=[16]" in r.stderr  # a runnable example
    assert not work.runs("grid")
    r = work.cli("run", p, "-q", "batch_size=64", "model.hidden=[32]", "epochs=1")
    assert r.exit_code == 0, r.output
    run = work.runs("grid")[0]
    assert run.data.params["batch_size"] == "64" and run.data.params["model.hidden"] == "[32]"


def test_compare_unknown_target_is_bad_input(work) -> None:
    r = work.cli("compare", "nothing-here")
    assert r.exit_code == 2 and "no experiment and no run named 'nothing-here'" in r.stderr
    work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=1", "-q")
    r = work.cli("compare", "digits_mlp")
    assert r.exit_code == 2 and "has no `mpsrun bench` runs" in r.stderr


# ----------------------------------------------------------------------------- matrix rules


def _cells(text: str, tmp_path: Path, *overrides: str) -> list[matrix.Cell]:
    p = tmp_path / "m.yaml"
    p.write_text(text)
    return matrix.expand(resolve(p, list(overrides)))


def test_axis_values_are_replaced_pinned_and_reproducible(tmp_path: Path) -> None:
    labels = lambda cells: [c.label for c in cells]  # noqa: E731
    assert labels(_cells(GRID, tmp_path)) == [
        "batch_size=32 model.hidden=[16]", "batch_size=32 model.hidden=[32]",
        "batch_size=64 model.hidden=[16]", "batch_size=64 model.hidden=[32]",
    ]
    # matrix.AXIS=[...] replaces values, dotted axes included (flattened from the nested override)
    assert labels(_cells(GRID, tmp_path, "matrix.model.hidden=[[8]]", "matrix.batch_size=[16]")) == ["batch_size=16 model.hidden=[8]"]
    # AXIS=value pins the axis
    cells = _cells(GRID, tmp_path, "batch_size=128")
    assert labels(cells) == ["model.hidden=[16]", "model.hidden=[32]"]
    assert all(c.resolved.recipe.batch_size == 128 for c in cells)
    # each cell knows the overrides that rerun it alone with `mpsrun run`
    c = _cells(GRID, tmp_path)[3]
    again = matrix.single(resolve(tmp_path / "m.yaml", c.assignments()))
    assert again.recipe.model_dump(exclude={"matrix", "tracking"}) == c.resolved.recipe.model_dump(exclude={"matrix", "tracking"})
    assert c.resolved.recipe.matrix == {} and c.resolved.recipe.tracking.run_name == c.label


def test_include_and_exclude_follow_github_actions_rules(tmp_path: Path) -> None:
    text = GRID.replace(
        "tracking:",
        "  include:\n"
        "    - {batch_size: 64, epochs: 3}\n"  # matches two cells: adds epochs to them
        "    - {batch_size: 8, device: cpu}\n"  # matches none: a cell of its own
        "  exclude:\n"
        "    - {batch_size: 32, model.hidden: [32]}\n"
        "tracking:",
    )
    cells = _cells(text, tmp_path)
    assert [(c.values, c.extras) for c in cells] == [
        ({"batch_size": 32, "model.hidden": [16]}, {}),
        ({"batch_size": 64, "model.hidden": [16], "epochs": 3}, {"epochs": 3}),
        ({"batch_size": 64, "model.hidden": [32], "epochs": 3}, {"epochs": 3}),
        ({"batch_size": 8, "device": "cpu"}, {"device": "cpu"}),
    ]
    assert [c.resolved.recipe.epochs for c in cells] == [2, 3, 3, 2]
    # pinning an axis keeps only the include/exclude items that agree with the pin
    cells = _cells(text, tmp_path, "batch_size=64")
    assert [(c.values, c.resolved.recipe.epochs) for c in cells] == [
        ({"model.hidden": [16], "epochs": 3}, 3), ({"model.hidden": [32], "epochs": 3}, 3)
    ]
    with pytest.raises(RecipeError) as e:
        _cells(text.replace("exclude:\n    - {batch_size: 32", "exclude:\n    - {epochs: 32"), tmp_path)
    assert "exclude may only name matrix axes" in e.value.render()


def test_speedup_is_the_throughput_ratio_to_the_same_cell_on_the_baseline() -> None:
    axes = ["model.arch", "device"]

    def child(i: int, arch: str, dev: str, sps: float | None, actual: str | None = None, size: int = 1000, rep: int = 0) -> ChildRun:
        ok = sps is not None
        return ChildRun(f"r{i}{rep}", "FINISHED" if ok else "FAILED", i, rep, {"model.arch": arch, "device": dev}, dev,
                        (actual or dev) if ok else None,
                        {"steady_epoch_time_s": size / sps, "steady_train_samples_per_s": sps, "final_val_accuracy": 0.5} if ok else {},
                        size, None if ok else "RuntimeError: boom")

    kids = [
        child(0, "a", "cpu", 100.0, size=200), child(1, "a", "cuda", 900.0),  # a smaller CPU subset: throughput still compares
        child(2, "b", "cpu", 50.0), child(2, "b", "cpu", 70.0, rep=1), child(3, "b", "cuda", None),
        child(4, "c", "cpu", 10.0), child(5, "c", "mps", 30.0, actual="cpu"),  # fell back: shown and counted as cpu
    ]
    rows = build_rows(axes, kids)
    compute_speedups(rows, "cpu")
    assert [r.speedup for r in rows] == [1.0, 9.0, 1.0, None, 1.0, 3.0]
    table = Table("e", "pid", "r.yaml", axes, "cpu", 2, rows)
    headers, body = columns(table)
    col = {h: i for i, h in enumerate(headers)}
    assert body[1][col["speed-up vs cpu"]] == "9.00x"
    assert body[2][col["epoch s (min–max)"]] == "14.3–20.0" and body[2][col["samples/s"]] == "60.0"
    assert body[3][col["status"]] == "FAILED: RuntimeError: boom"
    assert body[5][col["device"]] == "cpu (asked mps)"
    compute_speedups(rows, None)
    assert all(r.speedup is None for r in rows)


# ----------------------------------------------------------------------------- honest timers


def test_engine_reads_the_clock_only_after_synchronising_the_device(monkeypatch) -> None:
    """Each clock read in the epoch loop follows a device synchronise through the device layer."""
    events: list[str] = []
    real_sync = devices.synchronize

    def sync(device: torch.device) -> None:
        events.append(f"sync:{device.type}")
        real_sync(device)

    import time as _time

    monkeypatch.setattr(devices, "synchronize", sync)
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: events.append("clock") or _time.perf_counter()))
    setup = runner.prepare(resolve(RECIPES / "digits_mlp.yaml", ["device=cpu", "epochs=2"]))
    engine.train(setup.model, setup.optimizer, setup.plan, setup.choice.device, 2, setup.options, engine.Listener())
    clocks = [i for i, e in enumerate(events) if e == "clock"]
    assert len(clocks) == 2 * 3  # start, end of training, end of validation; per epoch
    assert all(events[i - 1] == "sync:cpu" for i in clocks)


def test_synchronize_mps_mock_waits_for_the_mac_gpu(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("cuda"))
    devices.synchronize(torch.device("mps"))
    assert calls == ["mps"]
    devices.synchronize(torch.device("cpu"))
    assert calls == ["mps"]


def test_synchronize_cuda_mock_waits_for_that_gpu(monkeypatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps"))
    devices.synchronize(torch.device("cuda:1"))
    assert calls == [torch.device("cuda:1")]


# ----------------------------------------------------------------------------- torchvision zoo


@pytest.fixture(scope="module")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mpsrun.testing.idx import write_idx_dataset

    root = tmp_path_factory.mktemp("mnist")
    write_idx_dataset(root, "MNIST", n_train=256, n_test=64, seed=0)
    return root


def test_shipped_zoo_recipe_is_the_published_setup(work) -> None:
    res = resolve(RECIPES / "vision_zoo_bench.yaml")
    r = res.recipe
    assert r.matrix["model.arch"] == ["vgg16", "alexnet", "resnet18", "mobilenet_v2", "efficientnet_b0"]
    assert r.matrix["batch_size"] == [4, 64] and r.matrix["device"] == ["cpu", "mps"]
    assert (r.dataset.name, r.dataset.kwargs["resize"], r.dataset.kwargs["rgb"], r.dataset.kwargs["subset"]) == ("mnist", 224, True, 1000)
    assert (r.optimizer.name, r.optimizer.kwargs["lr"]) == ("adam", 1e-3)
    assert len(matrix.expand(res)) == 20
    cells = matrix.expand(resolve(RECIPES / "vision_zoo_bench.yaml", ["matrix.device=[cpu,cuda]"]))
    assert {c.resolved.recipe.device for c in cells} == {"cpu", "cuda"}


def test_zoo_bench_trains_torchvision_models_on_the_cpu(work, mnist_root) -> None:
    r = work.cli(
        "bench", RECIPES / "vision_zoo_bench.yaml",
        "matrix.model.arch=[resnet18,mobilenet_v2]", "matrix.batch_size=[16]", "matrix.device=[cpu]",
        f"dataset.root={mnist_root}", "dataset.resize=32", "dataset.subset=32", "dataset.val_subset=16",
    )
    assert r.exit_code == 0, r.output
    parent, children = _parent_and_children(work, "vision_zoo_bench")
    assert [c.data.params["model.arch"] for c in children] == ["resnet18", "mobilenet_v2"]
    assert all(c.info.status == "FINISHED" and c.data.params["data.train_size"] == "32" for c in children)
    assert "speed-up" not in r.stdout  # one device: nothing to compare against


def test_zoo_adapts_head_and_first_conv(monkeypatch, tmp_path) -> None:
    from mpsrun.plugins.builtin.zoo import torchvision_model

    for arch in ("resnet18", "efficientnet_b0", "squeezenet1_1"):
        m = torchvision_model(arch, num_classes=7, input_shape=(1, 40, 40))
        first = next(x for x in m.modules() if isinstance(x, torch.nn.Conv2d))
        assert first.in_channels == 1, arch
        m.train()
        assert m(torch.zeros(2, 1, 40, 40)).shape == (2, 7), arch


def test_zoo_input_too_small_is_bad_input_with_the_fix(work, mnist_root) -> None:
    r = work.cli("run", RECIPES / "vision_zoo_bench.yaml", "device=cpu", "batch_size=4", "model.arch=vgg16",
                 f"dataset.root={mnist_root}", "dataset.resize=null", "dataset.subset=16")
    assert r.exit_code == 2
    assert "cannot take inputs of shape (3, 28, 28)" in r.stderr and "dataset.resize: 224" in r.stderr
    assert not work.runs("vision_zoo_bench")


def test_zoo_arch_checked_at_validation_with_did_you_mean(work) -> None:
    r = work.cli("validate", RECIPES / "vision_zoo_bench.yaml", "matrix.model.arch=[resnet81]")
    assert r.exit_code == 2
    assert "override 'matrix.model.arch=[resnet81]': model.arch: unknown torchvision classification model 'resnet81'" in r.stderr
    assert "did you mean 'resnet18'" in r.stderr


def test_zoo_weights_only_from_the_local_cache(work, mnist_root, monkeypatch, tmp_path) -> None:
    from torchvision.models import SqueezeNet1_1_Weights, get_model

    from mpsrun.plugins.builtin.zoo import cached_weights_path, torchvision_model

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    args = ["device=cpu", "batch_size=16", "model.arch=squeezenet1_1", "model.weights=IMAGENET1K_V1",
            f"dataset.root={mnist_root}", "dataset.resize=64", "dataset.subset=16", "dataset.val_subset=16", "epochs=1", "-q"]
    r = work.cli("run", RECIPES / "vision_zoo_bench.yaml", *args)
    assert r.exit_code == 2
    assert "not in the local cache" in r.stderr and "does not download weights" in r.stderr
    assert not work.runs("vision_zoo_bench")
    r = work.cli("validate", RECIPES / "vision_zoo_bench.yaml", "model.weights=IMAGENET")
    assert r.exit_code == 0  # names are checked against the arch when the model is built:
    with pytest.raises(Exception, match="did you mean 'IMAGENET1K_V1'"):
        torchvision_model("squeezenet1_1", 10, (3, 64, 64), weights="IMAGENET")
    # A file in the cache (here: weights we made, in torchvision's format) is used, offline.
    w = SqueezeNet1_1_Weights.IMAGENET1K_V1
    path = Path(cached_weights_path(w))
    path.parent.mkdir(parents=True)
    torch.manual_seed(1)
    state = get_model("squeezenet1_1").state_dict()
    torch.save(state, path)
    m = torchvision_model("squeezenet1_1", 10, (1, 64, 64), weights="IMAGENET1K_V1")
    key = "features.3.squeeze.weight"
    assert torch.equal(m.state_dict()[key], state[key])  # the cached weights were loaded
    assert torch.allclose(m.features[0].weight, state["features.0.weight"].sum(dim=1, keepdim=True))  # RGB kernels summed
    assert m.classifier[1].out_channels == 10
    r = work.cli("run", RECIPES / "vision_zoo_bench.yaml", *args)
    assert r.exit_code == 0, r.output
    assert work.runs("vision_zoo_bench")[0].data.params["model.weights"] == "IMAGENET1K_V1"
