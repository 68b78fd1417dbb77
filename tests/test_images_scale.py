"""Own images at real size (issue 44): where the data lives (`resident_max_gb: auto`), host batches that
match resident ones, a cache larger than its host memory budget streamed from disk in shuffled blocks
(the bound and every sample once an epoch), one stat per file for listing and key, and fine-tuning a
pretrained torchvision model with its own normalisation, logged with the model.

The CUDA tests at the end (host batches under CUDA graphs, the measured placement) skip without CUDA.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mpsrun.train.loop.data import HostBatches, ResidentBatches, plan_batches
from mpsrun.train.loop.feed.host import PINNED_SLOTS, MemoryRows
from mpsrun.train.loop.feed.order import block_order
from mpsrun.train.loop.feed.stream import DiskRows

from .conftest import RECIPES

MiB = 2**20
CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------- order and host batches


def test_block_order_serves_every_row_once_blocks_whole_and_seeded() -> None:
    o = block_order(1000, 64, 3, torch.Generator().manual_seed(0))
    rows = o.all_rows()
    assert sorted(rows.tolist()) == list(range(1000))  # every row, once
    for w, blocks in enumerate(o.windows):  # a window holds whole blocks of consecutive rows
        want = set().union(*(range(*o.block_range(b)) for b in blocks))
        assert set(o.rows(w).tolist()) == want
    assert o.windows[0] != [0, 1, 2] and rows[:64].tolist() != sorted(rows[:64].tolist())  # blocks permuted, rows mixed
    assert torch.equal(block_order(1000, 64, 3, torch.Generator().manual_seed(0)).all_rows(), rows)  # seeded
    assert not torch.equal(block_order(1000, 64, 3, torch.Generator().manual_seed(1)).all_rows(), rows)


def test_host_batches_are_the_resident_batches_in_the_same_order() -> None:
    """Gathered on a thread from host memory, batch for batch what the resident path slices (so the same results)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 256, (203, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(203)
    for shuffle in (True, False):
        res = ResidentBatches(x, y, 16, torch.device("cpu"), shuffle, seed=5)
        host = HostBatches(MemoryRows(x, y), 16, torch.device("cpu"), shuffle, seed=5)
        host.gather_threads = 3  # each batch gathered in three parts on a pool, as on a 16-core host
        for epoch in (0, 1):
            res.set_epoch(epoch)
            host.set_epoch(epoch)
            a, b = list(res), [(xb.clone(), yb.clone()) for xb, yb in host]
            assert len(a) == len(b) == len(host) == 13
            assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    # the graphs' feed: k batches copied into a static input of (k, b, ...)
    host.set_epoch(0)
    feed, sx, sy = host.feeder(), torch.zeros(4, 16, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, 16, dtype=torch.long)
    feed.into(sx, sy)
    feed.close()
    assert torch.equal(sy.reshape(-1), y[:64]) and torch.equal(sx.reshape(64, 3, 8, 8), x[:64])


def test_resident_max_gb_auto_is_the_default_and_a_number_still_wins() -> None:
    x, y = torch.zeros(64, 3, 4, 4, dtype=torch.uint8), torch.zeros(64, dtype=torch.long)
    ds = torch.utils.data.TensorDataset(x, y)
    common = dict(batch_size=8, device=torch.device("cpu"), seed=0, transform=None, resident="auto", free_bytes=None)
    auto = plan_batches(ds, ds, max_bytes="auto", **common)
    assert auto.resident and auto.reason.startswith("resident_max_gb auto:") and "available" in auto.reason
    capped = plan_batches(ds, ds, max_bytes=100, **common)  # a number in the recipe: the cap, as before
    assert not capped.resident and isinstance(capped.train, HostBatches) and "exceeds the resident limit" in capped.reason
    assert capped.graphable and auto.graphable  # both feed CUDA graphs' static input (on a CUDA device)
    from mpsrun.recipe.model import Recipe

    assert Recipe.model_fields["resident_max_gb"].default == "auto"


def test_auto_room_on_mps_is_a_share_of_the_recommended_working_set_mps_mock(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MPS here: its two memory figures are stood in for; the rule is the real one."""
    from mpsrun.train.loop.feed import place

    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 * 2**30)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 2**30)
    room, how = place.plan_time_room(torch.device("mps"), None)
    assert room == int(place.MPS_SHARE * 16 * 2**30) - 2**30
    assert "recommended working set" in how
    room, how = place.plan_time_room(torch.device("cuda"), 10**9)
    assert room is None and "measured step" in how  # CUDA: decided after a step, in the engine


def test_auto_on_cuda_places_after_a_measured_step_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA rule with no GPU here: the driver's and the allocator's figures are stood in for; the plan, the
    measured step's hand-over and the decision are the real ones (on the CPU device)."""
    from mpsrun.train.loop.data import BatchPlan, Pending

    x, y = torch.zeros(100, 3, 8, 8, dtype=torch.uint8), torch.zeros(100, dtype=torch.long)  # 19,200 + 800 bytes
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 3000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 1000)  # 2,000 cached, free for the data too
    seen = []

    def plan() -> BatchPlan:
        cpu = torch.device("cpu")
        p = BatchPlan(HostBatches(MemoryRows(x, y), 10, cpu, True, 0), HostBatches(MemoryRows(x, y), 10, cpu, False, 0), False, "pending")
        p.pending = Pending((x, y), (x, y), 40_000, 10, 0)
        return p

    def measure(xb: torch.Tensor, yb: torch.Tensor) -> int:
        seen.append(len(xb))
        return 5_000  # the step's peak

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (60_000, 10**9))
    p = plan()
    note = p.settle(measure, graph_steps=0)  # eager: 0.8 * (62,000 - 5,000) = 45,600 >= 40,000
    assert p.resident and isinstance(p.train, ResidentBatches) and p.pending is None and seen == [10]
    assert "on the device (room 0.00 GiB: 80% of 0.00 GiB free after the model, optimizer state and a measured step" in note
    p = plan()
    note = p.settle(measure, graph_steps=16)  # graphs: a second peak and 2 x 16 x 10 x 192 B of static input come off
    assert not p.resident and isinstance(p.train, HostBatches) and "exceed the room" in note and "pinned buffers" in note


# ----------------------------------------------------------------------------- streaming from disk


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _cache_file(path: Path, n: int, shape: tuple[int, ...]) -> int:
    """A raw uint8 cache whose every row starts with its own row number (so a sample says where it came from)."""
    row = int(np.prod(shape))
    a = np.random.default_rng(0).integers(0, 256, (n, row), dtype=np.uint8)
    a[:, :4] = np.arange(n, dtype="<u4").view(np.uint8).reshape(n, 4)
    a.tofile(path)
    return row


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="resident memory is read from /proc (Linux)")
def test_a_cache_five_times_its_budget_streams_within_it_each_byte_once_every_sample_once(tmp_path: Path) -> None:
    n, shape, batch = 3000, (3, 48, 48), 32
    path = tmp_path / "images.u8"
    row = _cache_file(path, n, shape)  # 20.7 MB
    budget = 4 * MiB
    rows = np.asarray([r for r in range(n) if r % 10 != 3], dtype=np.int64)  # a training split: held-out rows break the runs
    labels = torch.arange(len(rows))  # the split's own index: which sample each is
    reserve = PINNED_SLOTS * batch * row
    src = DiskRows(str(path), n, shape, rows, labels, budget, reserve)
    assert len(rows) * row > 4 * budget  # several times the budget
    hb = HostBatches(src, batch, torch.device("cpu"), True, seed=0)
    assert src.peak_buffer_bytes + hb.buffer_bytes() <= budget
    orders = []
    for epoch in (0, 1):
        hb.set_epoch(epoch)
        hb.gather_threads = 1 + epoch  # the second epoch copies out of the window on two threads
        src.bytes_read = 0
        base = peak = _rss()
        seen = []
        for xb, yb in hb:
            first = xb.reshape(len(xb), -1)[:, :4].contiguous().numpy().view("<u4").reshape(-1)
            assert np.array_equal(first, rows[yb.numpy()])  # each sample's pixels came with its own label
            seen.append(yb.clone())
            peak = max(peak, _rss())
        order = torch.cat(seen)
        assert sorted(order.tolist()) == list(range(len(rows)))  # every sample once an epoch
        assert src.bytes_read == len(rows) * row  # each byte read once an epoch
        assert peak - base <= budget + 3 * MiB, f"resident memory grew {(peak - base) / MiB:.1f} MiB over a {budget / MiB:.0f} MiB budget"
        orders.append(order)
    assert not torch.equal(orders[0], orders[1])  # a new order each epoch
    assert orders[0][: batch].tolist() != sorted(orders[0][: batch].tolist())  # shuffled within the window


def test_a_budget_too_small_for_a_batch_is_said_with_what_to_change(tmp_path: Path) -> None:
    path = tmp_path / "images.u8"
    row = _cache_file(path, 100, (3, 16, 16))
    with pytest.raises(ValueError, match="host_max_gb"):
        DiskRows(str(path), 100, (3, 16, 16), np.arange(100), torch.zeros(100, dtype=torch.long), budget=PINNED_SLOTS * 8 * row, reserve=PINNED_SLOTS * 8 * row)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("MPSRUN_CACHE", str(d))
    return d


def _recipe(work, root: Path, extra: str = "") -> Path:  # type: ignore[no-untyped-def]
    return work.write("imgs.yaml", f"""
        device: cpu
        epochs: 2
        batch_size: 8
        seed: 0
        dataset: {{name: image_folder, root: {root}, size: 32, val_fraction: 0.2{extra}}}
        model: {{name: cnn, channels: [8, 16]}}
        optimizer: {{name: adam, lr: 0.003}}
        tracking: {{experiment: imgs, log_model: false}}
        """)


def test_image_folder_over_the_host_budget_trains_from_disk_and_says_so(work, cache_dir: Path, tmp_path: Path) -> None:
    from mpsrun.testing.images import write

    root = write(tmp_path / "shapes", classes=3, per_class=200, size=32)  # 600 images, 1.8 MB decoded
    r = work.cli("run", _recipe(work, root, ", host_max_gb: 0.0006"), "-q")  # a 0.64 MB budget
    assert r.exit_code == 0, r.output
    run = work.runs("imgs")[0]
    assert run.data.tags["data.path"] == "disk stream", run.data.tags["data.path_reason"]
    assert "exceed the host memory budget of 0.00 GiB (dataset.host_max_gb 0.0006)" in run.data.tags["mpsrun.data.host_budget"]
    assert "read from disk in shuffled blocks" in run.data.tags["mpsrun.notes"]
    assert run.data.params["data.train_size"] == "480" and run.data.params["data.val_size"] == "120"
    assert run.data.metrics["val_accuracy"] > 0.5  # it learns from what it streams (3 classes)


# ----------------------------------------------------------------------------- 100,000 files: one stat each


def test_listing_and_cache_key_stat_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing's `DirEntry.stat()` is the one stat a file costs; the key reuses it (no `os.stat` per file)."""
    from mpsrun.plugins.builtin.images import cache, scan

    for c in ("a", "b"):
        (tmp_path / "d" / c / "sub").mkdir(parents=True)
        for i in range(300):
            (tmp_path / "d" / c / ("sub" if i % 3 == 0 else "") / f"{i:04d}.jpg").write_bytes(b"x" * i)
    calls = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (calls.append(str(p)), real(p, *a, **k))[1])
    listing = scan.scan_folder(tmp_path / "d")
    files = listing.all_files()
    k = cache.key(files, 32, 32, "rgb", listing.stats)
    assert len(files) == 600 and not [c for c in calls if c.endswith(".jpg")]  # folders are stat-ed, no image file
    monkeypatch.setattr(os, "stat", real)
    assert k == cache.key(files, 32, 32, "rgb")  # the same key as stat-ing every file (a cache built before is found)
    assert [p.name for p in listing.files["train"][:3]] == ["0001.jpg", "0002.jpg", "0004.jpg"]  # sorted, files then sub-folders


# ----------------------------------------------------------------------------- fine-tuning a pretrained model


def test_pretrained_torchvision_model_uses_its_weights_normalisation_offline_and_logs_it(work, cache_dir: Path, tmp_path: Path,
                                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """image_folder + torchvision resnet18 with weights DEFAULT from a local torch cache (weights we made, in
    torchvision's format): the head is sized to the classes, the weights' mean and std are applied in the model's
    first layer (so the logged model, `mpsrun eval` and serving apply them), the trained size is said."""
    from torchvision.models import ResNet18_Weights, get_model

    from mpsrun.plugins.builtin.zoo import WeightsNorm, cached_weights_path
    from mpsrun.testing.images import write

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    root = write(tmp_path / "shapes", classes=3, per_class=16, size=32)
    recipe = work.write("ft.yaml", f"""
        device: cpu
        epochs: 1
        batch_size: 16
        dataset: {{name: image_folder, root: {root}, size: 32, val_fraction: 0.25}}
        model: {{name: torchvision, arch: resnet18, weights: DEFAULT}}
        optimizer: {{name: sgd, lr: 0.01}}
        tracking: {{experiment: ft}}
        """)
    r = work.cli("run", recipe, "-q")
    assert r.exit_code == 2 and "place the file resnet18-f37072fd.pth" in r.output  # offline: the file to place, and where
    w = ResNet18_Weights.DEFAULT
    path = Path(cached_weights_path(w))
    path.parent.mkdir(parents=True)
    torch.manual_seed(1)
    torch.save(get_model("resnet18").state_dict(), path)
    r = work.cli("run", recipe, "-q")
    assert r.exit_code == 0, r.output
    run = work.runs("ft")[0]
    notes = run.data.tags["mpsrun.notes"]
    assert "IMAGENET1K_V1 were trained on 224 px crops (resized to 256, centre-cropped)" in notes, notes
    assert "mean [0.485, 0.456, 0.406] and std [0.229, 0.224, 0.225]" in notes and "head replaced: 1000 -> 3 classes" in notes
    import mlflow

    mlflow.set_tracking_uri(work.uri)
    served = mlflow.pytorch.load_model(f"runs:/{run.info.run_id}/model")
    info = json.loads(Path(work.client().download_artifacts(run.info.run_id, "data_info.json", str(work.path))).read_text())
    state = served.net.state_dict()
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    dm, ds = torch.tensor(info["mean"]), torch.tensor(info["std"])
    assert torch.allclose(state["norm.scale"].flatten(), ds / std) and torch.allclose(state["norm.shift"].flatten(), (dm - mean) / std)
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        assert served(x).shape == (2, 3)  # raw uint8 in: the dataset's transform, then the weights' normalisation, then the net
    got = WeightsNorm([0.5] * 3, [0.25] * 3, mean.tolist(), std.tolist())(torch.zeros(1, 3, 1, 1)).flatten()
    assert torch.allclose(got, (0.5 - mean) / std)  # a pixel at the data's mean is the weights' (mean_data - mean_w) / std_w


# ----------------------------------------------------------------------------- CUDA (skipped without)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs over host batches and the measured placement need a CUDA GPU")
def test_host_batches_replay_under_cuda_graphs_as_resident_cuda(work) -> None:
    """resident_max_gb=0.000001 forces the data onto the host: the same CUDA graphs replay, fed from pinned
    buffers on a side stream, and the losses are the resident run's (the same batches in the same order)."""
    for extra in ("resident_max_gb=8", "resident_max_gb=0.000001"):
        r = work.cli("run", RECIPES / "digits_mlp.yaml", "device=cuda", "epochs=3", extra, "tracking.log_model=false", "-q")
        assert r.exit_code == 0, r.output
    a, b = work.runs("digits_mlp")
    assert a.data.tags["data.path"] == "resident" and b.data.tags["data.path"] == "host slices"
    assert a.data.params["resolved.graphs"] == b.data.params["resolved.graphs"] == "true", b.data.tags.get("mpsrun.notes")
    assert "capture failed" not in b.data.tags.get("mpsrun.notes", "") and "not the fused ones" not in b.data.tags.get("mpsrun.notes", "")
    for (_, va), (_, vb) in zip(work.history(a.info.run_id, "val_loss"), work.history(b.info.run_id, "val_loss")):
        assert abs(va - vb) < 1e-4


@pytest.mark.skipif(not CUDA, reason="the measured placement needs a CUDA GPU")
def test_auto_places_the_data_after_a_measured_step_cuda(work) -> None:
    r = work.cli("run", RECIPES / "digits_mlp.yaml", "device=cuda", "epochs=2", "tracking.log_model=false")
    assert r.exit_code == 0, r.output
    run = work.runs("digits_mlp")[0]
    assert run.data.tags["data.path"] == "resident"
    assert "free after the model, optimizer state and a measured step" in run.data.tags["data.path_reason"]
    assert "data: resident_max_gb auto" in " ".join(r.output.split())  # said on screen


@pytest.mark.skipif(not CUDA, reason="pinned buffers and the side stream need a CUDA GPU")
def test_host_batches_on_cuda_are_the_resident_batches_cuda() -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 256, (1000, 3, 16, 16), dtype=torch.uint8, generator=g), torch.arange(1000)
    dev = torch.device("cuda")
    res = ResidentBatches(x, y, 64, dev, True, seed=5)
    host = HostBatches(MemoryRows(x, y), 64, dev, True, seed=5)
    for epoch in (0, 1):
        res.set_epoch(epoch)
        host.set_epoch(epoch)
        out = [(xb.clone(), yb.clone()) for xb, yb in host]  # cloned on the loop's stream, after the copy's event
        assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(res, out))
        assert out[0][0].is_cuda


@pytest.mark.skipif(not CUDA, reason="pinned buffers and the side stream need a CUDA GPU")
def test_a_disk_stream_feeds_the_gpu_every_sample_once_cuda(tmp_path: Path) -> None:
    n, shape, batch = 1500, (3, 32, 32), 64
    path = tmp_path / "images.u8"
    row = _cache_file(path, n, shape)
    rows = np.arange(0, n, 2)
    src = DiskRows(str(path), n, shape, rows, torch.arange(len(rows)), 2 * MiB, PINNED_SLOTS * batch * row)
    hb = HostBatches(src, batch, torch.device("cuda"), True, seed=0)
    hb.ahead = 34  # as the graphs ask
    hb.set_epoch(0)
    seen = []
    for xb, yb in hb:
        first = xb.reshape(len(xb), -1)[:, :4].cpu().contiguous().numpy().view("<u4").reshape(-1)
        assert xb.is_cuda and np.array_equal(first, rows[yb.cpu().numpy()])
        seen.append(yb.cpu())
    assert sorted(torch.cat(seen).tolist()) == list(range(len(rows)))
