"""Start-up: what each command imports, the numpy readers, the source-read signatures, and
MLflow set-up in the background (helper process, thread) keeping every record of a run.

No timings here (those are benchmarks/wall.py's); each check below fails if the
behaviour it guards regresses: an import creeping back, a reader or split drifting
from the library it replaces, a record lost on the way through the helper.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from mpsrun.plugins import registry, signatures
from mpsrun.plugins.builtin import readers
from mpsrun.testing.idx import write_idx_dataset
from tests.conftest import RECIPES, run_subprocess

HEAVY = ("torch", "mlflow", "torchvision", "sklearn", "pandas", "matplotlib")

# Runs the real CLI in a fresh interpreter and reports which heavy modules it imported: at exit
# (`mpsrun run` ends without Python's finalisation, but runs the atexit handlers first).
PROBE = """
import atexit, json, sys
sys.argv = ["mpsrun", *json.loads(sys.argv[1])]
def report():
    sys.stdout.flush()
    print("\\nPROBE " + json.dumps({"heavy": [m for m in %r if m in sys.modules]}), file=sys.stderr, flush=True)
atexit.register(report)
from mpsrun.cli import main
main()
""" % (HEAVY,)


def probe(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[dict, str]:
    e = {**os.environ, **(env or {})}
    e.pop("MLFLOW_TRACKING_URI", None)
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], cwd=cwd, capture_output=True, text=True, env=e, timeout=600)
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("PROBE ")]
    assert line, p.stdout + p.stderr
    return {"code": p.returncode, **json.loads(line[-1][6:])}, p.stdout + p.stderr


# ----------------------------------------------------------------------------- imports


@pytest.mark.parametrize(
    "args",
    [["--help"], ["schema"], ["plugins"], ["plugins", "--json"], ["validate", str(RECIPES / "digits_mlp.yaml")], ["validate", str(RECIPES / "fashion_mlp_mps.yaml"), "optimizer.name=adamw", "optimizer.betas=[0.9,0.99]"]],
    ids=["help", "schema", "plugins", "plugins-json", "validate-digits", "validate-fashion-adamw"],
)
def test_light_commands_import_no_torch_mlflow_sklearn(args: list[str], tmp_path: Path) -> None:
    out, text = probe(args, tmp_path)
    assert out["code"] == 0, text
    # `plugins` lists the built-in callback plugins too, which are classes: their stand-ins are not
    # read from source yet, so listing imports torch (not mlflow, torchvision or scikit-learn).
    allowed = {"torch"} if args[0] == "plugins" else set()
    assert set(out["heavy"]) <= allowed, text


def test_validate_still_catches_bad_optimizer_and_plugin_arguments_without_torch(tmp_path: Path) -> None:
    out, text = probe(["validate", str(RECIPES / "digits_mlp.yaml"), "optimizer.lr=fast", "optimizer.betas=[1]", "model.hiden=[3]"], tmp_path)
    assert out["code"] == 2 and out["heavy"] == [], text
    assert "optimizer.lr" in text and "optimizer.betas" in text
    assert "model.hiden" in text and "did you mean 'hidden'" in text
    # an optimizer name not found in torch's source is left to torch itself to reject
    out, text = probe(["validate", str(RECIPES / "digits_mlp.yaml"), "optimizer.name=adamm"], tmp_path)
    assert out["code"] == 2 and "unknown optimizer 'adamm' (did you mean 'adam'" in text, text


def test_lazy_public_names_still_import() -> None:
    code = "import sys, mpsrun; assert 'torch' not in sys.modules; from mpsrun import DataSplits, ImageTransform; print(DataSplits.__module__, ImageTransform.__name__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["mpsrun.plugins.contract", "ImageTransform"]


# ----------------------------------------------------------------------------- readers


@pytest.fixture(scope="module")
def idx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("idx")
    write_idx_dataset(root, "FashionMNIST", n_train=300, n_test=70, seed=3)
    write_idx_dataset(root, "MNIST", n_train=200, n_test=50, seed=4)
    return root


@pytest.mark.parametrize("name", ["FashionMNIST", "MNIST"])
@pytest.mark.parametrize("train", [True, False])
def test_numpy_idx_reader_equals_torchvision(idx_root: Path, name: str, train: bool) -> None:
    from torchvision import datasets

    ds = getattr(datasets, name)(str(idx_root), train=train, download=False)
    raw = idx_root / name / "raw"
    prefix = "train" if train else "t10k"
    for stem, expected in ((f"{prefix}-images-idx3-ubyte", ds.data), (f"{prefix}-labels-idx1-ubyte", ds.targets)):
        for path in (raw / stem, raw / f"{stem}.gz"):  # the extracted file and the download's .gz
            got = readers.read_idx(path)
            assert got.shape == tuple(expected.shape)
            assert torch.equal(torch.from_numpy(got).to(expected.dtype), expected)
            assert got.dtype == np.uint8


def test_fashion_plugin_gives_torchvision_tensors_from_gz_only_files(tmp_path: Path, idx_root: Path) -> None:
    from torchvision import datasets

    from mpsrun.plugins.builtin.datasets import fashion_mnist

    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for f in (idx_root / "FashionMNIST" / "raw").glob("*.gz"):
        (raw / f.name).write_bytes(f.read_bytes())  # only the .gz: torchvision itself would refuse these
    splits = fashion_mnist(root=str(tmp_path), download=False, val_on_test=True)  # train: every training image
    ref = datasets.FashionMNIST(str(idx_root), train=True, download=False)
    x, y = splits.train.tensors  # type: ignore[attr-defined]
    assert torch.equal(x, ref.data.unsqueeze(1)) and torch.equal(y, ref.targets)
    assert x.dtype == torch.uint8 and y.dtype == torch.int64


def test_read_idx_rejects_a_bad_file(tmp_path: Path) -> None:
    p = tmp_path / "x-idx3-ubyte"
    p.write_bytes(b"\x00\x00\x08\x03\x00\x00\x00\x02\x00\x00\x00\x02\x00\x00\x00\x02abc")  # 3 bytes of 8
    with pytest.raises(readers.IdxFormatError, match="header says shape"):
        readers.read_idx(p)
    p.write_bytes(b"hello")
    with pytest.raises(readers.IdxFormatError, match="not an IDX file"):
        readers.read_idx(p)


def test_digits_reader_and_split_equal_scikit_learn() -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images, target = readers.read_digits()
    assert images.dtype == bunch.images.dtype and target.dtype == bunch.target.dtype
    assert np.array_equal(images, bunch.images) and np.array_equal(target, bunch.target)
    idx = list(range(len(target)))
    for seed in (0, 1, 42, 2**31 - 1):
        for frac in (0.2, 0.1, 0.37):
            tr, va = train_test_split(idx, test_size=frac, random_state=seed, stratify=bunch.target)
            a, b = readers.stratified_split(target, frac, seed)
            assert list(a) == list(tr) and list(b) == list(va), (seed, frac)


def test_digits_plugin_unchanged_from_the_scikit_learn_path() -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mpsrun.plugins.builtin.datasets import digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.uint8).unsqueeze(1)
    y = torch.tensor(bunch.target, dtype=torch.long)
    tr, va = train_test_split(list(range(len(y))), test_size=0.25, random_state=5, stratify=bunch.target)
    s = digits(val_fraction=0.25, seed=5)
    for ds, idx in ((s.train, tr), (s.val, va)):
        got_x, got_y = ds.tensors  # type: ignore[attr-defined]
        assert torch.equal(got_x, x[torch.tensor(idx)]) and torch.equal(got_y, y[torch.tensor(idx)])


# ----------------------------------------------------------------------------- source-read signatures

PROBES = [0, 1, 0.5, -1, True, None, "x", "1e-3", [1, 2], [0.9, 0.99], [256, 128], {"a": 1}]


def _verdicts(fn: typing.Callable, skip: tuple[str, ...]) -> list:
    out = []
    for p in inspect.signature(fn).parameters:
        for v in PROBES:
            checked, errs = registry.validate_kwargs(fn, {p: v}, skip)
            out.append((p, repr(v), sorted(k for k, _ in errs), repr(checked.get(p)) if not errs else None))
    return out


def _builtin_refs() -> list[registry.PluginRef]:
    return [r for k in ("model", "dataset") for r in registry.discover(k) if r.distribution == "mpsrun"]


@pytest.mark.parametrize("ref", _builtin_refs(), ids=lambda r: f"{r.kind}-{r.name}")
def test_builtin_stand_in_matches_the_real_plugin(ref: registry.PluginRef) -> None:
    module = ref.value.partition(":")[0]
    saved = sys.modules.pop(module, None)  # read from source even though the test imported it
    try:
        listing = signatures.builtin_plugin(ref.value, ref.distribution, listing=True)
        checking = signatures.builtin_plugin(ref.value, ref.distribution)
    finally:
        if saved is not None:
            sys.modules[module] = saved
    real = ref.load()
    assert listing is not None, "every built-in can be listed without importing it"
    params_only = inspect.signature(real).replace(return_annotation=inspect.Signature.empty)  # never read by the checks
    assert str(inspect.signature(listing)) == str(params_only)
    assert inspect.getdoc(listing) == inspect.getdoc(real)
    if ref.name == "torchvision":
        assert checking is None  # its `arch` hint needs torchvision to check: imported, not guessed
        return
    assert checking is not None
    assert typing.get_type_hints(checking) == {k: v for k, v in typing.get_type_hints(real).items() if k != "return"}
    assert _verdicts(checking, registry.FILLED[ref.kind]) == _verdicts(real, registry.FILLED[ref.kind])


def _shape(fn: typing.Callable) -> list[tuple]:
    """Each parameter's name, kind, default and hint (the stand-in's Tensor spelled as torch's; `params` unread)."""
    rows = []
    for p in inspect.signature(fn).parameters.values():
        ann = "-" if p.name == "params" else inspect.formatannotation(p.annotation).replace("mpsrun.plugins.signatures.Tensor", "torch.Tensor")
        rows.append((p.name, p.kind, p.default, ann))
    return rows


def test_optimizer_stand_ins_match_torch_optim() -> None:
    signatures._optimizers.cache_clear()
    static = signatures._optimizers()
    assert static is not None
    real = registry.optimizers()
    assert sorted(static) == sorted(real)
    for name, cls in real.items():
        fn = static[name]
        assert _shape(fn) == _shape(cls), name
        assert _verdicts(fn, ("params",)) == _verdicts(cls, ("params",)), name


def test_third_party_plugins_are_always_imported() -> None:
    assert signatures.builtin_plugin("mpsrun.plugins.builtin.models:mlp", "someone-else") is None
    assert signatures.builtin_plugin("other_pkg.models:mlp", "mpsrun") is None


# ----------------------------------------------------------------------------- MLflow in the background

RECIPE = """\
device: cpu
epochs: 2
batch_size: 64
seed: 0
dataset: {name: digits}
model: {name: mlp, hidden: [16]}
optimizer: {name: sgd, lr: 0.05}
tracking: {experiment: startup}
"""
# Values that differ between any two runs: argv, run name, the new tag, process and clock facts, ids,
# and the description (it quotes the epoch time).
VARIES = {"mpsrun.command", "mpsrun.owner", "mlflow.runName", "mpsrun.mlflow_helper", "mpsrun.pid", "mpsrun.pid_start", "mpsrun.heartbeat",
          "mpsrun.model_uri", "mpsrun.model_id", "mlflow.note.content", "mlflow.loggedModels",
          "data.path_reason"}  # the room for resident data: a measure of free memory at the time
ADDED_METRICS: set[str] = set()  # mpsrun's bookkeeping (mlflow_setup_wait_s among it) is in mpsrun_timings.json
ADDED_TAGS = {"mpsrun.mlflow_helper", "mpsrun.model_export", "mpsrun.figures"}  # how the model was exported, the figures drawn


def _record(work, run) -> dict:  # type: ignore[no-untyped-def]
    c = work.client()
    metrics = {k: sorted(m.step for m in c.get_metric_history(run.info.run_id, k)) for k in run.data.metrics}
    return {
        "status": run.info.status,
        "params": run.data.params,
        "metrics": metrics,
        "tags": {k: v for k, v in run.data.tags.items()},
        "artifacts": sorted(a.path for a in c.list_artifacts(run.info.run_id)),
    }


def _model_files(work, run) -> dict:  # type: ignore[no-untyped-def]
    """The logged model's MLmodel (less what differs between any two models) and its files' names."""
    import mlflow
    from mlflow.models import Model

    mlflow.set_tracking_uri(work.uri)
    local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model", dst_path=str(work.path / run.info.run_id)))
    m = Model.load(str(local)).to_dict()
    for k in ("run_id", "utc_time_created", "model_uuid", "model_id", "artifact_path", "model_size_bytes"):
        m.pop(k, None)
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    return {"MLmodel": m, "files": files, "requirements": (local / "requirements.txt").read_text()}


@pytest.fixture
def baseline(work):  # type: ignore[no-untyped-def]
    """The run as the in-process Tracker records it (the path every run took before this change)."""
    from mpsrun.plugins import resolve
    from mpsrun.train import runner

    p = work.write("s.yaml", RECIPE)
    runner.run(resolve(p))
    (run,) = work.runs("startup")
    return p, _record(work, run)


@pytest.mark.parametrize("mode", ["auto", "thread"])
def test_background_tracker_keeps_every_record(work, baseline, mode: str) -> None:  # type: ignore[no-untyped-def]
    recipe, before = baseline
    if mode in ("process", "auto"):  # the real console path in a fresh interpreter
        # the model exported ahead by the exporter process (track/helper/exporter.py; on by default from 4 cores)
        out, text = probe(["run", str(recipe), "-q"], work.path, env={"MPSRUN_MLFLOW_HELPER": mode, "MPSRUN_HELPER_TRACE": str(work.path / "helper_trace.txt"),
                                                                       "MPSRUN_EXPORT_AHEAD": "1"})
        assert out["code"] == 0, text
        # the training process never imports MLflow, matplotlib or scikit-learn: the helper does the MLflow work
        assert set(out["heavy"]) == {"torch"}, text
    else:
        os.environ["MPSRUN_MLFLOW_HELPER"], os.environ["MPSRUN_EXPORT_AHEAD"] = mode, "0"
        try:
            r = work.cli("run", recipe, "-q")
        finally:
            del os.environ["MPSRUN_MLFLOW_HELPER"], os.environ["MPSRUN_EXPORT_AHEAD"]
        assert r.exit_code == 0, r.output
    runs = work.runs("startup")
    assert len(runs) == 2
    after = _record(work, runs[1])
    assert after["status"] == before["status"] == "FINISHED"
    own = lambda d: {k: v for k, v in d.items() if not k.startswith("mpsrun.owner.")}  # noqa: E731  (who ran it: host, pid, time)
    assert own(after["params"]) == own(before["params"])
    assert after["artifacts"] == before["artifacts"] and "recipe.yaml" in after["artifacts"]
    assert set(after["metrics"]) - set(before["metrics"]) == ADDED_METRICS
    assert set(before["metrics"]) <= set(after["metrics"])
    sampled = lambda k: k.startswith("system/")  # noqa: E731  (sampled every few seconds: their count follows the run's length)
    assert {k: v for k, v in after["metrics"].items() if k in before["metrics"] and not sampled(k)} == {k: v for k, v in before["metrics"].items() if not sampled(k)}
    assert set(after["tags"]) - set(before["tags"]) == ADDED_TAGS and set(before["tags"]) <= set(after["tags"])
    differ = sorted(k for k in before["tags"] if k not in VARIES and after["tags"][k] != before["tags"][k])
    assert differ == [], [(k, before["tags"][k], after["tags"][k]) for k in differ]
    assert after["tags"]["mpsrun.mlflow_helper"] == {"auto": "process (auto)", "process": "process (MPSRUN_MLFLOW_HELPER=process)", "thread": "thread (MPSRUN_MLFLOW_HELPER=thread)"}[mode]
    if mode == "auto":  # the model: exported ahead by the exporter, written by the helper without torch
        assert _model_files(work, runs[1]) == _model_files(work, runs[0])
        text = (work.path / "helper_trace.txt").read_text()
        assert "torch imported: False" in text, text
        assert after["tags"]["mpsrun.model_export"].startswith("ahead: exported while training"), after["tags"]["mpsrun.model_export"]
        assert after["tags"]["mpsrun.figures"] == "drawn by a drawer process beside the MLflow helper (the learning curves by the helper)"
        # the trained weights, not the untrained ones the export began with: the same answers as the in-process export
        import mlflow

        mlflow.set_tracking_uri(work.uri)
        ahead, here = (mlflow.pytorch.load_model(f"runs:/{r.info.run_id}/model") for r in (runs[1], runs[0]))
        x = torch.randint(0, 17, (9, 1, 8, 8), dtype=torch.uint8)
        assert torch.equal(ahead(x), here(x))
        # the end figures, drawn by the drawer and logged by the helper: the same files as drawn in process
        c = work.client()
        assert [[(a.path, a.file_size > 1000) for a in c.list_artifacts(r.info.run_id, d)] for r in (runs[1], runs[0]) for d in ("figures", "tables")] == \
            [[("figures/confusion_matrix.png", True), ("figures/learning_curves.png", True), ("figures/per_class_accuracy.png", True)],
             [("tables/per_class_accuracy.json", False)]] * 2
    else:
        assert after["tags"]["mpsrun.model_export"] == "at the end of the run (MPSRUN_EXPORT_AHEAD=0)"
        assert after["tags"]["mpsrun.figures"] == "drawn by the MLflow helper (MPSRUN_EXPORT_AHEAD=0)"
    # the same training: the data, split and weights did not change with the readers
    assert after["metrics"]["val_accuracy"] == before["metrics"]["val_accuracy"]
    c = work.client()
    acc = [c.get_metric_history(r.info.run_id, "val_accuracy")[-1].value for r in runs]
    assert acc[0] == acc[1]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_mlflow_setup_failure_is_reported_not_swallowed(work, mode: str) -> None:  # type: ignore[no-untyped-def]
    recipe = work.write("s.yaml", RECIPE)
    r = run_subprocess(sys.executable, "-m", "mpsrun", "run", str(recipe), "--tracking-uri", "bogus-scheme://nowhere", cwd=work.path, env={"MPSRUN_MLFLOW_HELPER": mode})
    assert r.exit_code == 2, r.output
    assert "MLflow set-up failed for bogus-scheme://nowhere" in r.stderr
    assert "bogus-scheme" in r.stderr.split("MLflow set-up failed", 1)[1]
    assert "Traceback" not in r.output


def test_unknown_helper_mode_is_bad_input(work) -> None:  # type: ignore[no-untyped-def]
    recipe = work.write("s.yaml", RECIPE)
    os.environ["MPSRUN_MLFLOW_HELPER"] = "fork"
    try:
        r = work.cli("run", recipe, "-q")
    finally:
        del os.environ["MPSRUN_MLFLOW_HELPER"]
    assert r.exit_code == 2 and "MPSRUN_MLFLOW_HELPER='fork' is not one of" in r.stderr
    assert work.runs("startup") == []


def test_bad_input_while_preparing_leaves_no_run_in_process_mode(work) -> None:  # type: ignore[no-untyped-def]
    recipe = work.write("s.yaml", RECIPE.replace("dataset: {name: digits}", "dataset: {name: fashion_mnist, root: nowhere, download: false}"))
    os.environ["MPSRUN_MLFLOW_HELPER"] = "process"
    try:
        r = work.cli("run", recipe, "-q")
    finally:
        del os.environ["MPSRUN_MLFLOW_HELPER"]
    assert r.exit_code == 2 and "FashionMNIST files not found" in r.stderr
    assert work.runs("startup") == []


def test_helper_that_dies_mid_run_loses_no_metric_and_the_run_goes_on(work) -> None:  # type: ignore[no-untyped-def]
    """The helper is killed between epochs: the store is opened in this process, the same run goes
    on, every metric handed over before is written (once), and the tag says what happened."""
    from mpsrun.track.helper import background

    t = background.start(work.uri, "dies", mode="process")
    info = t.start("r", {"x": "1"})
    t.log_metrics({"loss": 1.0}, step=0)
    t.log_metrics({"loss": 0.5}, step=1)
    assert t._remote is not None
    t._remote.proc.kill()
    t._remote.proc.wait()
    t.log_metrics({"loss": 0.25}, step=2)  # finds the helper gone: takes over
    t.set_tags({"after": "yes"})
    t.finish("FINISHED")
    c = work.client()
    run = c.get_run(info.run_id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in c.get_metric_history(info.run_id, "loss")] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert run.data.tags["after"] == "yes" and run.data.tags["x"] == "1"
    assert "helper died" in run.data.tags["mpsrun.mlflow_helper"]


def test_posted_calls_never_fill_the_pipe_and_a_failed_one_is_raised(work) -> None:  # type: ignore[no-untyped-def]
    """Metrics and tags are posted without waiting; over a pipe's worth of them neither blocks nor is lost,
    and a posted call the helper refused is raised by the next call that waits."""
    from mpsrun.track.helper import background

    t = background.start(work.uri, "posted", mode="process")
    info = t.start("r", {})
    for i in range(1500):  # ~3x MAX_POSTED... and more answers than fit in a pipe unread
        t.log_metrics({"m": float(i)}, step=i)
    t.flush()
    t.set_tags({"k": "x" * 10})
    t.log_params({"p": 1})
    t.log_params({"p": 2})  # MLflow refuses to change a param: raised by the next call that waits
    with pytest.raises(Exception, match="p"):
        t.flush()
    t.finish("FINISHED")
    c = work.client()
    assert len(c.get_metric_history(info.run_id, "m")) == 1500
    assert c.get_run(info.run_id).data.tags["k"] == "x" * 10
