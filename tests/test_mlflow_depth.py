"""What a digits run leaves in MLflow, checked as a new user would: one real run, shared by the module.

The run (real training, real SQLite store, the real CLI, `tracking.register:
digits-mlp`) is made once: logging a model costs seconds. The model is then loaded
in a fresh Python process that never imports mpsrun, as someone downstream would.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .conftest import RECIPES, Workdir

REGISTERED = "digits-mlp"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, template_db: Path) -> tuple[Workdir, Any]:
    path = tmp_path_factory.mktemp("depth")
    (path / "mlruns").mkdir()
    shutil.copy(template_db, path / "mlruns" / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        work = Workdir(path)
        r = work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=3", "device=cpu", f"tracking.register={REGISTERED}", "-q", helper=None)
        assert r.exit_code == 0, r.output
        assert f"models:/{REGISTERED}/1" in r.stdout
        (run,) = work.runs("digits_mlp")
        yield work, run


FRESH = textwrap.dedent(
    """
    import json, sys
    import mlflow, numpy as np, torch
    from mlflow.models import Model
    mlflow.set_tracking_uri(sys.argv[1])
    out = {}
    for uri in (f"runs:/{sys.argv[2]}/model", sys.argv[3]):
        local = mlflow.artifacts.download_artifacts(uri)
        example = Model.load(local).load_input_example(local)
        module = mlflow.pytorch.load_model(uri)
        logits = module(torch.from_numpy(example)).detach().numpy()
        served = mlflow.pyfunc.load_model(uri).predict(example)  # a classifier: named columns
        scores = served[[f"score_{i}" for i in range(10)]].to_numpy()
        out[uri] = {"example": list(example.shape), "dtype": str(example.dtype), "logits": list(logits.shape),
                    "pyfunc": list(served.shape), "columns": list(served.columns[:3]),
                    "same": bool(np.allclose(logits, scores, atol=1e-5)),
                    "argmax": served["class_index"].tolist() == logits.argmax(1).tolist() == [int(c) for c in served["class"]],
                    "classes": sorted(set(int(i) for i in logits.argmax(1)))}
    out["mpsrun_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "mpsrun")
    print(json.dumps(out))
    """
)


def test_logged_model_loads_and_predicts_in_a_fresh_process_without_mpsrun(trained) -> None:
    work, run = trained
    uri = f"models:/{REGISTERED}/1"
    p = subprocess.run(
        [sys.executable, "-c", FRESH, work.uri, run.info.run_id, uri],
        cwd=work.path, capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["mpsrun_imported"] == []
    for key in (f"runs:/{run.info.run_id}/model", uri):
        got = out[key]
        assert got["example"] == [5, 1, 8, 8] and got["dtype"] == "uint8"  # raw validation samples
        assert got["logits"] == [5, 10] and got["pyfunc"] == [5, 13]  # 10 classes: class, class_index, probability, 10 scores
        assert got["columns"] == ["class", "class_index", "probability"] and got["argmax"], got
        assert got["same"], got
        assert all(0 <= c < 10 for c in got["classes"])


def test_model_has_signature_requirements_data_info_and_a_registry_version(trained) -> None:
    import mlflow
    from mlflow.models import get_model_info

    work, run = trained
    mlflow.set_tracking_uri(work.uri)
    info = get_model_info(f"runs:/{run.info.run_id}/model")
    sig = info.signature.to_dict()
    assert "uint8" in sig["inputs"] and "[-1, 1, 8, 8]" in sig["inputs"]
    assert [c["name"] for c in json.loads(sig["outputs"])] == ["class", "class_index", "probability", *[f"score_{i}" for i in range(10)]]
    assert info.metadata["num_classes"] == 10 and info.metadata["serialization"] == "pt2"
    assert "data_info" in info.metadata
    local = Path(mlflow.artifacts.download_artifacts(f"runs:/{run.info.run_id}/model", dst_path=str(work.path / "dl")))
    reqs = (local / "requirements.txt").read_text()
    assert "mpsrun==" in reqs and "torch==" in reqs and "mlflow==" in reqs  # the plugins' distribution too
    assert (local / "extra_files" / "data_info.json").exists()
    versions = work.client().search_model_versions(f"name='{REGISTERED}'")
    assert [v.run_id for v in versions] == [run.info.run_id]
    assert run.data.tags["mpsrun.registered_model"] == f"models:/{REGISTERED}/1"
    # the LoggedModel is linked to the run, with the final epoch's metrics
    (output,) = run.outputs.model_outputs
    model = work.client().get_logged_model(output.model_id)
    assert model.source_run_id == run.info.run_id
    assert {m.key for m in model.metrics} >= {"val_accuracy", "val_loss", "train_loss"}
    # no bare state_dict beside it any more (see track/records/model_log.py for why)
    assert "model.pt" not in {a.path for a in work.client().list_artifacts(run.info.run_id)}


def test_experiment_kind_standard_tags_run_name_and_description(trained) -> None:
    work, run = trained
    exp = work.client().get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    tags = run.data.tags
    assert tags["mlflow.user"]
    assert tags["mlflow.source.name"] == str((RECIPES / "digits_mlp.yaml").resolve())
    assert tags["mlflow.source.type"] == "LOCAL"
    assert re.fullmatch(r"[0-9a-f]{40}", tags["mlflow.source.git.commit"])  # the recipe sits in this checkout
    assert re.fullmatch(r"mlp-digits-cpu-[0-9a-f]{4}", run.info.run_name), run.info.run_name
    assert "validation accuracy" in tags["mlflow.note.content"] and "digits" in tags["mlflow.note.content"]


def test_dataset_inputs_with_context_digest_and_schema(trained) -> None:
    work, run = trained
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"training", "validation"}
    for ds in inputs.values():
        assert ds.name == "digits" and ds.digest
        assert "uint8" in ds.schema and "int64" in ds.schema
        assert "digits" in ds.source  # the plugin that made it
    assert json.loads(inputs["training"].profile)["features_shape"] == [1437, 1, 8, 8]
    assert json.loads(inputs["validation"].profile)["features_shape"] == [360, 1, 8, 8]


@pytest.mark.parametrize("shape", [(1437, 1, 8, 8), (3000, 28, 28), (50, 10)])
def test_a_head_sent_to_the_helper_gives_the_dataset_input_of_the_whole_array(shape: tuple[int, ...]) -> None:
    """The training process sends the helper the first values of a large split (`datasets.Head`), not
    the split: MLflow's digest, profile and schema must be those of the whole array."""
    import mlflow.data
    import numpy as np
    import torch

    from mpsrun.track.records.datasets import Head

    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, shape, dtype=np.uint8)
    y = rng.integers(0, 10, shape[0])
    whole = mlflow.data.from_numpy(x, targets=y, name="d")
    for sent in (Head.of(x), Head.of(torch.from_numpy(x))):
        assert isinstance(sent, Head) == (x.size > 40_000)
        stand_in = sent.expand() if isinstance(sent, Head) else sent
        ds = mlflow.data.from_numpy(stand_in, targets=y, name="d")
        assert (ds.digest, ds.profile, ds.schema) == (whole.digest, whole.profile, whole.schema)
    changed = x.copy()
    changed.reshape(-1)[5] ^= 1  # a change within the hashed values: another digest
    sent = Head.of(changed)
    assert mlflow.data.from_numpy(sent.expand() if isinstance(sent, Head) else sent, targets=y, name="d").digest != whole.digest


def test_system_metrics_apart_and_bookkeeping_in_one_artifact(trained) -> None:
    work, run = trained
    keys = set(run.data.metrics)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= keys
    # mpsrun's bookkeeping is one JSON artifact, not metrics (the UI's first charts are the user's)
    assert not {k for k in keys if k.startswith("mpsrun/")} and not {"mlflow_log_time_s", "mlflow_handoff_time_s", "best_epoch"} & keys
    timings = json.loads((Path(work.client().download_artifacts(run.info.run_id, "mpsrun_timings.json", str(work.path))).read_text()))
    assert {"mlflow_log_time_s", "mlflow_handoff_time_s", "log_model_time_s", "figures_time_s", "checkpoint_total_time_s"} <= set(timings)
    assert timings["best"]["monitor"] == "val_loss" and run.data.tags["mpsrun.best.monitor"] == "val_loss"
    # the user's training metrics unprefixed (the Model metrics tab), mpsrun's measurements under system/
    # (the System metrics tab), no final_* copies of the last epoch (track/records/names.py)
    assert {"train_loss", "val_loss", "val_accuracy", "system/epoch_time_s", "system/steady_epoch_time_s"} <= keys
    assert {k for k in keys if "/" not in k} == {"train_loss", "val_loss", "val_accuracy", "lr"}, sorted(keys)


def test_figures_and_per_class_table_are_artifacts(trained) -> None:
    work, run = trained
    c = work.client()
    figs = {a.path for a in c.list_artifacts(run.info.run_id, "figures")}
    assert figs == {"figures/learning_curves.png", "figures/confusion_matrix.png", "figures/per_class_accuracy.png"}
    local = Path(c.download_artifacts(run.info.run_id, "figures", str(work.path / "figs")))
    for f in local.iterdir():
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000
    table = json.loads(Path(c.download_artifacts(run.info.run_id, "tables/per_class_accuracy.json", str(work.path))).read_text())
    assert table["columns"] == ["class", "support", "correct", "accuracy"] and len(table["data"]) == 10
    assert sum(row[1] for row in table["data"]) == 360


def test_eval_logs_a_run_linked_to_the_model(trained) -> None:
    work, run = trained
    r = work.cli("eval", run.info.run_id, helper=None)
    assert r.exit_code == 0, r.output
    assert "eval_accuracy" in r.stdout
    (ev,) = [x for x in work.runs("digits_mlp") if x.data.tags.get("mpsrun.eval.source_run") == run.info.run_id]
    assert ev.info.status == "FINISHED"
    assert ev.info.run_name.startswith("eval-mlp-digits-")
    # same data as training's validation split: same accuracy
    assert ev.data.metrics["eval_accuracy"] == pytest.approx(run.data.metrics["val_accuracy"], abs=1e-6)  # the latest: the last epoch's
    assert ev.data.metrics["eval_samples"] == 360
    linked = work.client().get_run(ev.info.run_id).inputs.model_inputs  # search_runs leaves model inputs out
    assert [m.model_id for m in linked] == [run.outputs.model_outputs[0].model_id]
    assert [i.tags[0].value for i in ev.inputs.dataset_inputs] == ["validation"]
    assert "figures/confusion_matrix.png" in {a.path for a in work.client().list_artifacts(ev.info.run_id, "figures")}

    # a registered version on other data: dataset overrides on the training recipe
    r = work.cli("eval", f"models:/{REGISTERED}/1", "dataset.val_fraction=0.5", helper=None)
    assert r.exit_code == 0, r.output
    ev2 = work.runs("digits_mlp")[-1]
    assert ev2.data.metrics["eval_samples"] == 899
    assert ev2.data.tags["mpsrun.eval.model_uri"] == f"models:/{REGISTERED}/1"


def test_eval_bad_input_exits_2_with_a_message(trained) -> None:
    work, run = trained
    cases = [
        (("eval", "0" * 32), "no run"),
        (("eval", "models:/digits-mpl/1"), "registered models: digits-mlp"),
        (("eval", run.info.run_id, "epochs=3"), "dataset overrides"),
        (("eval", run.info.run_id, "dataset.val_fractio=0.5"), "did you mean 'val_fraction'"),
        (("eval", run.info.run_id, "--split", "tset"), "--split"),
    ]
    for args, message in cases:
        r = work.cli(*args)
        assert r.exit_code == 2, (args, r.output)
        assert message in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.output
