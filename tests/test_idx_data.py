"""The synthetic IDX writer must produce files the *real* torchvision loaders accept,
and the benchmark baselines must run on them (CI has no internet for real downloads)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torchvision import datasets

from mpsrun.testing.idx import write_idx_dataset

REPO = Path(__file__).resolve().parents[1]
N_TRAIN, N_TEST = 600, 100


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    r = tmp_path_factory.mktemp("idx")
    write_idx_dataset(r, "FashionMNIST", n_train=N_TRAIN, n_test=N_TEST, seed=0)
    write_idx_dataset(r, "MNIST", n_train=N_TRAIN, n_test=N_TEST, seed=1)
    return r


@pytest.fixture(scope="module")
def baselines() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mpsrun_bench_baselines", REPO / "benchmarks" / "baselines.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_layout(root: Path) -> None:
    raw = root / "FashionMNIST" / "raw"
    for split in ("train", "t10k"):
        for kind, magic in (("images-idx3", 2051), ("labels-idx1", 2049)):
            stem = raw / f"{split}-{kind}-ubyte"
            assert stem.is_file() and (raw / f"{stem.name}.gz").is_file()
            assert int.from_bytes(stem.read_bytes()[:4], "big") == magic


@pytest.mark.parametrize("cls", [datasets.FashionMNIST, datasets.MNIST])
@pytest.mark.parametrize("train,n", [(True, N_TRAIN), (False, N_TEST)])
def test_torchvision_loads(root: Path, cls: type, train: bool, n: int) -> None:
    ds = cls(root=str(root), train=train, download=False)
    assert ds.data.shape == (n, 28, 28) and ds.data.dtype == torch.uint8
    assert ds.targets.shape == (n,) and ds.targets.dtype == torch.int64
    assert int(ds.targets.min()) >= 0 and int(ds.targets.max()) <= 9
    counts = torch.bincount(ds.targets, minlength=10)
    assert int(counts.min()) >= n // 10 - 1 and int(counts.max()) <= n // 10 + 1
    # Not blank, not saturated: real-looking pixel statistics.
    assert 20 < ds.data.float().mean() < 150 and int(ds.data.max()) == 255
    img, label = ds[0]  # the PIL path users hit with transforms
    assert img.size == (28, 28) and isinstance(label, int)


def test_deterministic(tmp_path: Path, root: Path) -> None:
    write_idx_dataset(tmp_path, "FashionMNIST", n_train=N_TRAIN, n_test=N_TEST, seed=0)
    for f in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert (tmp_path / "FashionMNIST" / "raw" / f).read_bytes() == (root / "FashionMNIST" / "raw" / f).read_bytes()


def test_cli(tmp_path: Path) -> None:
    from mpsrun.testing.idx import main

    assert main([str(tmp_path), "--name", "MNIST", "--n-train", "20", "--n-test", "10"]) == 0
    assert len(datasets.MNIST(str(tmp_path), train=False, download=False)) == 10


@pytest.mark.parametrize("loop", ["tutorial_loop", "resident_loop"])
def test_baseline_runs(root: Path, baselines: ModuleType, loop: str) -> None:
    r = getattr(baselines, loop)(root, "cpu", 1, 0)
    assert len(r["epoch_times_s"]) == 1 and r["epoch_times_s"][0] > 0
    assert r["first_epoch_s"] == r["steady_epoch_s"] == r["epoch_times_s"][0]
    assert 0.0 <= r["val_accuracy"] <= 1.0
    assert math.isfinite(r["val_loss"]) and r["val_loss"] > 0
