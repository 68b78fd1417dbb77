"""Fast checks of the plugins themselves; `mpsrun run recipes/spirals.yaml` is the real test."""

from __future__ import annotations

import torch

from mpsrun_plugin_example.callbacks import BestMetric
from mpsrun_plugin_example.datasets import spirals
from mpsrun_plugin_example.models import residual_mlp


def test_dataset_is_seeded_and_shaped() -> None:
    a, b = spirals(seed=1), spirals(seed=1)
    x, y = a.train.tensors
    assert x.shape[1:] == a.input_shape and y.dtype == torch.int64
    assert torch.equal(x, b.train.tensors[0])
    assert set(y.tolist()) == set(range(a.num_classes))


def test_model_maps_inputs_to_class_scores() -> None:
    splits = spirals()
    model = residual_mlp(input_shape=splits.input_shape, num_classes=splits.num_classes)
    x, _ = splits.val.tensors
    assert model(x[:8]).shape == (8, splits.num_classes)


def test_callback_logs_the_best_value_and_stops_at_the_target() -> None:
    from mpsrun import RunState

    model = torch.nn.Linear(2, 2)
    run = RunState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), epochs=5)
    cb = BestMetric(stop_at=0.9)
    for epoch, acc in enumerate([0.5, 0.7, 0.6]):
        cb.on_epoch_end(run, epoch, {"val_accuracy": acc})
    assert cb.best == 0.7 and not run.should_stop
    cb.on_epoch_end(run, 3, {"val_accuracy": 0.95})
    assert run.should_stop
