"""Plain-PyTorch reference loops for benchmarking mpsrun's flagship recipe.

Why this exists: a claim like "mpsrun trains FashionMNIST N x faster" is only
meaningful against code people actually write.  This file holds two honest
baselines for the same task (FashionMNIST, MLP 784-512-512-10, SGD lr 1e-3,
batch 64, cross-entropy, train then evaluate on the test split each epoch):

(a) ``tutorial_loop``: the official PyTorch quickstart tutorial, as users copy it
    (DataLoader over the torchvision dataset with ``ToTensor()``, no shuffle, per
    batch ``.to(device)``, ``loss.item()`` every 100 batches, ``.item()`` per test
    batch).
(b) ``resident_loop``: what a careful user writes by hand: the whole dataset
    moved to the device once as a float tensor, per-epoch ``torch.randperm`` on
    the device, slicing batches, and no host sync inside the step loop (metrics
    accumulate as device tensors and are read once per epoch).

Both loops synchronise the device before every clock read so the epoch times
measure finished work, not queued kernels.  They are deliberately written top to
bottom like scripts; only the model definition and the small sync/seed helpers
are shared.

CLI::

    python benchmarks/baselines.py --root DIR --device cpu --epochs 2 --which a,b
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import ToTensor

BATCH_SIZE = 64
LR = 1e-3


def make_model() -> nn.Module:
    """The quickstart tutorial's network: Flatten, 784-512-ReLU-512-ReLU-10."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def sync(device: torch.device) -> None:
    """Wait for queued device work, so perf_counter() reads measure completed work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (torch.manual_seed also seeds CUDA and MPS)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _summary(epoch_times: list[float], val_accuracy: float, val_loss: float) -> dict[str, Any]:
    steady = statistics.median(epoch_times[1:]) if len(epoch_times) > 1 else epoch_times[0]
    return {
        "epoch_times_s": epoch_times,
        "first_epoch_s": epoch_times[0],
        "steady_epoch_s": steady,
        "val_accuracy": val_accuracy,
        "val_loss": val_loss,
    }


def tutorial_loop(root: str | Path, device: str | torch.device, epochs: int, seed: int = 0) -> dict[str, Any]:
    """Baseline (a): the PyTorch quickstart tutorial, verbatim in structure.

    val_loss is the tutorial's definition: the mean over test batches of the
    per-batch mean loss.
    """
    device = torch.device(device)
    seed_everything(seed)
    sink = open(os.devnull, "w")  # the tutorial prints; we keep the f-string work but drop the output

    training_data = datasets.FashionMNIST(root=root, train=True, download=False, transform=ToTensor())
    test_data = datasets.FashionMNIST(root=root, train=False, download=False, transform=ToTensor())
    train_dataloader = DataLoader(training_data, batch_size=BATCH_SIZE)
    test_dataloader = DataLoader(test_data, batch_size=BATCH_SIZE)

    model = make_model().to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def train(dataloader: DataLoader, model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        size = len(dataloader.dataset)
        model.train()
        for batch, (X, y) in enumerate(dataloader):
            X, y = X.to(device), y.to(device)

            # Compute prediction error
            pred = model(X)
            loss = loss_fn(pred, y)

            # Backpropagation
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

            if batch % 100 == 0:
                loss, current = loss.item(), (batch + 1) * len(X)
                print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]", file=sink)

    def test(dataloader: DataLoader, model: nn.Module, loss_fn: nn.Module) -> tuple[float, float]:
        size = len(dataloader.dataset)
        num_batches = len(dataloader)
        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for X, y in dataloader:
                X, y = X.to(device), y.to(device)
                pred = model(X)
                test_loss += loss_fn(pred, y).item()
                correct += (pred.argmax(1) == y).type(torch.float).sum().item()
        test_loss /= num_batches
        correct /= size
        print(f"Test Error: \n Accuracy: {(100*correct):>0.1f}%, Avg loss: {test_loss:>8f} \n", file=sink)
        return correct, test_loss

    epoch_times: list[float] = []
    val_accuracy, val_loss = float("nan"), float("nan")
    for t in range(epochs):
        print(f"Epoch {t+1}\n-------------------------------", file=sink)
        sync(device)
        t0 = time.perf_counter()
        train(train_dataloader, model, loss_fn, optimizer)
        val_accuracy, val_loss = test(test_dataloader, model, loss_fn)
        sync(device)
        epoch_times.append(time.perf_counter() - t0)
    sink.close()
    return _summary(epoch_times, val_accuracy, val_loss)


def resident_loop(root: str | Path, device: str | torch.device, epochs: int, seed: int = 0) -> dict[str, Any]:
    """Baseline (b): device-resident data, on-device shuffling, no per-step host sync.

    val_loss is the exact per-sample mean over the test split (the tutorial's
    batch-mean average differs only through the smaller last batch).  The
    result also carries "train_loss" (per-sample mean of the last epoch).
    """
    device = torch.device(device)
    seed_everything(seed)

    # Load the same IDX files through torchvision once; keep only the raw tensors.
    train_set = datasets.FashionMNIST(root=root, train=True, download=False)
    test_set = datasets.FashionMNIST(root=root, train=False, download=False)
    # uint8 over the bus (4x less than float32), then convert on the device; /255 matches ToTensor().
    x_train = train_set.data.to(device).float().div_(255)
    y_train = train_set.targets.to(device)
    x_test = test_set.data.to(device).float().div_(255)
    y_test = test_set.targets.to(device)
    n_train, n_test = len(y_train), len(y_test)

    model = make_model().to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    epoch_times: list[float] = []
    val_accuracy, val_loss, train_loss = float("nan"), float("nan"), float("nan")
    for _ in range(epochs):
        sync(device)
        t0 = time.perf_counter()

        # Train: shuffle on the device, slice batches, accumulate the loss without .item().
        model.train()
        perm = torch.randperm(n_train, device=device)
        train_loss_sum = torch.zeros((), device=device)
        for i in range(0, n_train, BATCH_SIZE):
            idx = perm[i : i + BATCH_SIZE]
            X, y = x_train[idx], y_train[idx]
            loss = loss_fn(model(X), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            train_loss_sum += loss.detach() * len(idx)

        # Evaluate: same batch size, metrics stay on the device until the end of the epoch.
        model.eval()
        test_loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        with torch.no_grad():
            for i in range(0, n_test, BATCH_SIZE):
                X, y = x_test[i : i + BATCH_SIZE], y_test[i : i + BATCH_SIZE]
                pred = model(X)
                test_loss_sum += loss_fn(pred, y) * len(y)
                correct += (pred.argmax(1) == y).sum()

        # One host read per epoch (this also waits for the device).
        train_loss = train_loss_sum.item() / n_train
        val_loss = test_loss_sum.item() / n_test
        val_accuracy = correct.item() / n_test
        sync(device)
        epoch_times.append(time.perf_counter() - t0)

    result = _summary(epoch_times, val_accuracy, val_loss)
    result["train_loss"] = train_loss
    return result


LOOPS = {"a": ("tutorial", tutorial_loop), "b": ("resident", resident_loop)}


def _ensure_data(root: str) -> None:
    """Write the synthetic dataset (mpsrun.testing.idx) if the raw files are missing."""
    if (Path(root) / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").exists():
        return
    try:
        from mpsrun.testing.idx import write_idx_dataset
    except ImportError:  # running from a checkout without the package installed
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from mpsrun.testing.idx import write_idx_dataset
    print(f"writing synthetic FashionMNIST to {root} ...", file=sys.stderr)
    write_idx_dataset(root, "FashionMNIST")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Plain-PyTorch FashionMNIST reference loops (a: tutorial, b: resident).")
    p.add_argument("--root", required=True, help="torchvision root holding FashionMNIST/raw/")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--which", default="a,b", help="comma-separated subset of: a (tutorial), b (resident)")
    p.add_argument("--synthetic-if-missing", action="store_true",
                   help="write a synthetic dataset with mpsrun.testing.idx when the files are absent")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    a = p.parse_args(argv)

    which = [w.strip() for w in a.which.split(",") if w.strip()]
    unknown = [w for w in which if w not in LOOPS]
    if unknown:
        p.error(f"unknown loop(s) {unknown}; choose from {sorted(LOOPS)}")
    if a.synthetic_if_missing:
        _ensure_data(a.root)

    results: dict[str, dict[str, Any]] = {}
    for w in which:
        name, fn = LOOPS[w]
        results[name] = fn(a.root, a.device, a.epochs, a.seed)

    print(f"device={a.device} epochs={a.epochs} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'loop':<10} {'first_s':>8} {'steady_s':>9} {'val_acc':>8} {'val_loss':>9}  epoch_times_s")
    for name, r in results.items():
        times = " ".join(f"{t:.2f}" for t in r["epoch_times_s"])
        print(f"{name:<10} {r['first_epoch_s']:>8.2f} {r['steady_epoch_s']:>9.2f} "
              f"{r['val_accuracy']:>8.4f} {r['val_loss']:>9.4f}  {times}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": a.device, "epochs": a.epochs, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
