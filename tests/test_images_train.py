"""Training on your own images: per-sample seeded augmentation on the device, the cached run,
the logged model (uint8 images in, class names in its metadata), `mpsrun eval`, and the model
served by `mlflow models serve` answering a real HTTP request.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from mpsrun.plugins.contract import ImageTransform
from mpsrun.recipe.augment import AugmentStep
from mpsrun.testing.images import write
from mpsrun.train.loop import augment

from .conftest import RECIPES


def _aug(steps: list[dict], shape=(3, 32, 32), base=None):  # type: ignore[no-untyped-def]
    return augment.build([AugmentStep(**s) for s in steps], base or ImageTransform(), shape)


def _images(n: int = 8, shape=(3, 32, 32), same: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if same:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).expand(n, *shape).contiguous()
    return torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)


CROP_FLIP = [{"name": "random_resized_crop", "size": 24}, {"name": "random_horizontal_flip"}, {"name": "color_jitter", "brightness": 0.3, "contrast": 0.3, "saturation": 0.3}]


def test_ranks_draw_the_global_batch_s_augmentation_and_keep_their_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP each rank augments its share of every global batch as one process would (the shards' real plan and
    iterator, two ranks simulated in this process by setting the job's context): the same seed on every rank, the
    parameters drawn for the global batch, each rank's slice kept; the full batches and the shared tail (3 + 3 of 6)."""
    from mpsrun.train.loop import shards, steps
    from mpsrun.train.loop.data import plan_batches
    from mpsrun.train.ranks import distributed

    x, y = _images(22, shape=(3, 16, 16)), torch.arange(22) % 2
    ds = torch.utils.data.TensorDataset(x, y)

    graph_path = False

    def batches(world: int, rank: int) -> list[torch.Tensor]:
        a = _aug(CROP_FLIP, shape=(3, 16, 16))
        plan = plan_batches(ds, ds, batch_size=8, device=torch.device("cpu"), seed=0, transform=a.eval, train_transform=a.train,
                            resident=True, max_bytes=2**30, free_bytes=None)
        if world > 1:
            monkeypatch.setattr(distributed, "_ctx", distributed.Context(rank, rank, world, world, 1))
            plan, _ = shards.share(plan, 8, 0)
            monkeypatch.setattr(distributed, "_ctx", None)
        torch.manual_seed(0)  # every rank seeds the same
        if not graph_path:
            return [plan.train_transform(xb) for xb, _ in plan.train]
        # as CUDA graphs run a rank's epoch (train/loop/steps.py): no iterator, the share placed per step before capture
        x_epoch, _ = plan.train.epoch_tensors()
        out, i = [], 0
        for size, w in zip(plan.train.lay.steps, plan.train.lay.weights):
            steps._place_share(plan.train, size, w)
            out.append(plan.train_transform(x_epoch[i : i + size]))
            i += size
        return out

    one = batches(1, 0)
    for graph_path in (False, True):
        ranks = [batches(2, r) for r in range(2)]
        assert [len(b) for b in one] == [8, 8, 6] and [len(b) for b in ranks[0]] == [4, 4, 3]
        for k, whole in enumerate(one):
            assert torch.allclose(torch.cat([ranks[0][k], ranks[1][k]]), whole, atol=1e-5), (graph_path, k)
        assert not torch.allclose(ranks[0][0], ranks[1][0])  # the ranks' samples are not augmented alike


def test_augmentation_is_seeded_and_drawn_per_sample() -> None:
    a = _aug(CROP_FLIP)
    x = _images(same=True)  # eight copies of one image
    torch.manual_seed(0)
    first = a.train(x)
    torch.manual_seed(0)
    again = a.train(x)
    torch.manual_seed(1)
    other = a.train(x)
    assert first.shape == (8, 3, 24, 24)
    assert torch.equal(first, again)  # same seed, same batch
    assert not torch.equal(first, other)
    distinct = {tuple(first[i].flatten()[:64].tolist()) for i in range(8)}
    assert len(distinct) == 8  # identical inputs, each with its own crop, flip and jitter
    assert a.input_shape == (3, 24, 24) and a.eval.output_shape((3, 32, 32)) == (3, 24, 24)
    assert a.eval(x).shape == (8, 3, 24, 24)
    assert set(a.params) == {"augment.0", "augment.1", "augment.2"} and a.params["augment.1"] == "random_horizontal_flip(p=0.5)"


def test_flip_and_padded_crop_are_exact_pixel_moves() -> None:
    x = _images(4)
    flip = _aug([{"name": "random_horizontal_flip", "p": 1.0}])
    assert torch.allclose(flip.train(x), torch.flip(x.float() / 255, dims=[3]), atol=1e-5)
    crop = _aug([{"name": "random_crop", "padding": 3}])
    out = crop.train(x) * 255
    padded = torch.nn.functional.pad(x.float(), (3, 3, 3, 3))
    for i in range(4):  # each sample is some whole-pixel window of its own zero-padded image
        hits = [(dy, dx) for dy in range(7) for dx in range(7) if torch.allclose(out[i], padded[i, :, dy : dy + 32, dx : dx + 32], atol=1e-3)]
        assert len(hits) >= 1, i


def test_normalize_defaults_to_the_datasets_own_and_can_be_set() -> None:
    base = ImageTransform(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    own = _aug([{"name": "random_horizontal_flip", "p": 0.0}], base=base)
    x = _images(2)
    assert torch.allclose(own.train(x), base(x), atol=1e-5)  # no geometric change: the eval transform's values
    set_ = _aug([{"name": "normalize", "mean": [0.0], "std": [1.0]}], base=base)
    assert torch.allclose(set_.train(x), x.float() / 255, atol=1e-6) and set_.eval.mean == (0.0,)


def test_augment_refuses_non_images_with_a_reason() -> None:
    with pytest.raises(augment.AugmentError, match="image samples"):
        _aug(CROP_FLIP, shape=(8,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_augmentation_replays_in_a_cuda_graph_with_new_draws_cuda() -> None:
    a = _aug(CROP_FLIP)
    x = _images(16).cuda()
    static = x.clone()
    a.train(static)  # first call outside capture: per-device constants
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = a.train(static)
    g.replay()
    one = out.clone()
    g.replay()
    assert not torch.equal(one, out)  # each replay draws new parameters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_engine_captures_augmented_steps_as_cuda_graphs_cuda() -> None:
    """The engine's default on CUDA: whole augmented training steps captured and replayed, no eager fallback."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from mpsrun.train.loop.data import plan_batches
    from mpsrun.train.loop.engine import Listener, Options, train

    a = _aug(CROP_FLIP)
    x, y = _images(256), torch.arange(256) % 4
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)).to(dev)
    plan = plan_batches(TensorDataset(x, y), TensorDataset(x[:64], y[:64]), batch_size=32, device=dev, seed=0, transform=a.eval,
                        train_transform=a.train, resident=True, max_bytes=2**30, free_bytes=None)
    options = Options(graphs=True)
    result = train(model, torch.optim.SGD(model.parameters(), lr=0.05), plan, dev, 2, options, Listener())
    assert options.graphs and not options.notes, options.notes
    assert all(math.isfinite(e.train_loss) for e in result.epochs)


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, template_db: Path):  # type: ignore[no-untyped-def]
    """Two runs of the shipped recipe on a written folder: the first builds the cache, the second reuses it."""
    import shutil

    from .conftest import Workdir

    d = tmp_path_factory.mktemp("imgrun")
    (d / "mlruns").mkdir()
    shutil.copy(template_db, d / "mlruns" / "mlflow.db")
    root = write(d / "shapes", classes=3, per_class=16, size=40)
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.chdir(d)
    os.environ["MPSRUN_CACHE"] = str(d / "cache")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    w = Workdir(d)
    args = ["run", RECIPES / "images_folder.yaml", f"dataset.root={root}", "dataset.size=32", "epochs=2", "batch_size=16",
            "augment=[{name: random_resized_crop, size: 28, scale: [0.5, 1.0]}, {name: random_horizontal_flip}]", "-q"]
    from mpsrun.train import record

    limit = record.INPUT_SAMPLE_BYTES
    record.INPUT_SAMPLE_BYTES = 10 * 3 * 32 * 32  # so the first run's dataset inputs take the large-data branch
    try:
        runs = [w.cli(*args), w.cli(*args, "tracking.log_model=false")]
    finally:
        record.INPUT_SAMPLE_BYTES = limit
    try:
        yield w, runs, root
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)


def test_runs_build_then_reuse_the_cache_and_train_alike(trained) -> None:  # type: ignore[no-untyped-def]
    w, results, root = trained
    for r in results:
        assert r.exit_code == 0, r.output
    a, b = w.runs("images_folder")
    assert a.data.tags["mpsrun.data.cache"] == "built" and b.data.tags["mpsrun.data.cache"] == "reused"
    assert a.data.tags["mpsrun.data.skipped"] == "0"
    assert a.data.params["augment.0"].startswith("random_resized_crop(size=28, scale=(0.5, 1.0)")
    assert a.data.tags["data.path"] == "resident"
    assert "the training split's MLflow dataset input describes its first 10 of" in a.data.tags["mpsrun.notes"]
    inputs = w.client().get_run(a.info.run_id).inputs.dataset_inputs
    assert {i.dataset.source_type for i in inputs} == {"local"} and str(root) in inputs[0].dataset.source
    ha, hb = w.history(a.info.run_id, "train_loss"), w.history(b.info.run_id, "train_loss")
    assert [s for s, _ in ha] == [s for s, _ in hb]  # seeded augmentation: the same losses (CUDA's reductions: to rounding)
    assert [v for _, v in ha] == pytest.approx([v for _, v in hb], rel=1e-6)


def test_logged_model_takes_uint8_images_and_names_its_classes(trained) -> None:  # type: ignore[no-untyped-def]
    import mlflow

    w, _, _ = trained
    run = w.runs("images_folder")[0]
    mlflow.set_tracking_uri(w.uri)
    info = mlflow.models.get_model_info(f"runs:/{run.info.run_id}/model")
    spec = info.signature.inputs.inputs[0]
    assert str(spec.type) == "uint8" and tuple(spec.shape) == (-1, 3, 32, 32)  # the cache's size, not the crop's
    meta = info.metadata or {}
    assert json.dumps(meta).count("class_names") >= 1 and "square" in json.dumps(meta)
    r = w.cli("eval", run.info.run_id)
    assert r.exit_code == 0, r.output
    ev = [x for x in w.runs("images_folder") if x.data.tags.get("mpsrun.eval.source_run") == run.info.run_id]
    assert ev and ev[0].data.metrics["eval_accuracy"] >= 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_model_answers_an_http_request(trained) -> None:  # type: ignore[no-untyped-def]
    """`mlflow models serve` on the logged model; a POST of two uint8 images gets each one's class by name and scores."""
    w, _, root = trained
    run = w.runs("images_folder")[0]
    port = _free_port()
    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    env = {**os.environ, "MLFLOW_TRACKING_URI": w.uri, "MLFLOW_DEFAULT_PREDICTION_DEVICE": "cpu",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # mlflow starts uvicorn by name
    proc = subprocess.Popen([mlflow_bin, "models", "serve", "-m", f"runs:/{run.info.run_id}/model", "--env-manager", "local",
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            cwd=w.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                time.sleep(0.5)
        x = _images(2, (3, 32, 32)).tolist()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps({"inputs": x}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.loads(r.read())
        preds = body["predictions"]
        classes = ["cross", "disc", "square"]
        assert len(preds) == 2  # two images, each answered by name with every class's score
        assert all(p["class"] in classes and p["class"] == classes[p["class_index"]] for p in preds), preds
        assert all({f"score_{c}" for c in classes} <= set(p) and 0 <= p["probability"] <= 1 for p in preds), preds
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_data_too_big_for_the_device_is_sliced_from_host_memory_like_resident(work) -> None:
    """resident: false (what a cache over the limit gets): batches gathered from the host tensors, same trajectory."""
    for extra in ("resident=true", "resident=false"):
        r = work.cli("run", RECIPES / "digits_mlp.yaml", "epochs=2", extra, "tracking.log_model=false", "-q")
        assert r.exit_code == 0, r.output
    a, b = work.runs("digits_mlp")
    assert a.data.tags["data.path"] == "resident" and b.data.tags["data.path"] == "host slices"
    for (_, va), (_, vb) in zip(work.history(a.info.run_id, "val_loss"), work.history(b.info.run_id, "val_loss")):
        assert abs(va - vb) < 1e-4


def test_unknown_augmentation_or_argument_is_exit_2_with_did_you_mean(work) -> None:
    r = work.cli("validate", RECIPES / "images_folder.yaml", "augment=[{name: random_flip}, {name: random_crop, pading: 4}]")
    assert r.exit_code == 2
    out = " ".join(r.output.split())
    assert "augment.0.name: unknown augmentation 'random_flip' (did you mean" in out and "'random_horizontal_flip'" in out
    assert "augment.1: random_crop: unknown argument 'pading' (did you mean 'padding'?)" in out
