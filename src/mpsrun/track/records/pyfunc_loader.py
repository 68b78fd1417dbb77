"""How a logged model (MLflow's pt2 format) loads on whatever device the loading machine has.

Why not MLflow's own loader: a model is exported on the CPU (so it loads anywhere), and
`torch.export` bakes the devices into the program: its weights, its constants and the
device of every tensor it creates. MLflow's pyfunc picks CUDA wherever CUDA is available
and then refuses a program exported on the CPU; moving the program's module with `.to()`
leaves the baked devices behind ("Tensor device mismatch! Expected: cpu, Got: cuda:0").
`torch.export.passes.move_to_device_pass` rewrites the program itself, so the same model
evaluates and serves on the GPU it was trained on and on a CPU-only machine alike.

This file is copied into each logged model's `code/` folder as `mpsrun_pyfunc.py` and named
as the pyfunc flavor's loader module: MLflow imports it in a process without mpsrun, so it
imports only what the model's requirements hold (mlflow, torch; numpy and pandas through
the classifier's table). `mpsrun eval` calls `load_program` from here too.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

LOADER_MODULE = "mpsrun_pyfunc"  # the name this file has inside a logged model
CLASSIFIER_MODULE = "mpsrun_classifier"  # track/records/classifier.py, copied beside it for a classifier
PT2_FILE = "model.pt2"  # in the model's data folder (mlflow.pytorch's name for it)
CLASSES_FILE = "classes.json"  # a classifier's class names, in the data folder


def default_device() -> str:
    """MLflow's own choice for pyfunc: $MLFLOW_DEFAULT_PREDICTION_DEVICE, else CUDA where there is one, else the CPU."""
    import torch

    env = os.environ.get("MLFLOW_DEFAULT_PREDICTION_DEVICE")
    if env:
        return env
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_program(pt2_file: str, device: Any = "cpu") -> tuple[Any, str]:
    """The exported program in `pt2_file` as a module on `device`; (module, the device it is on).

    A program that cannot be moved (a torch without `move_to_device_pass`, an operator the
    pass cannot rewrite) stays on the CPU, with a warning that says why: slower, never wrong.
    """
    import torch

    ep = torch.export.load(pt2_file)
    dev = torch.device(device)
    if dev.type == "cpu":
        return ep.module(), "cpu"
    try:
        from torch.export.passes import move_to_device_pass

        moved = move_to_device_pass(ep, dev)
        return moved.module(), str(dev)
    except Exception as e:  # ImportError on an old torch, or a program the pass cannot move
        warnings.warn(f"mpsrun: the logged model could not be moved to {dev} ({type(e).__name__}: {e}); it runs on the CPU", stacklevel=2)
        return ep.module(), "cpu"


def validate(pt2_file: str) -> None:
    """MLflow's own check that the archive holds no pickle, where this MLflow has it and asks for it."""
    try:
        from mlflow import pytorch as mp

        allowed = getattr(mp, "_is_pickle_deserialization_allowed", lambda: True)()
        check = getattr(mp, "_validate_pt2_archive_is_pickle_free", None)
    except Exception:
        return
    if check is not None and not allowed:
        check(pt2_file)


def _load_pyfunc(path: str, model_config: Any = None) -> Any:
    """MLflow's entry point: `path` is the model's data folder (the pt2 program, classes.json for a classifier)."""
    from mlflow.pytorch import _PyTorchWrapper

    wanted = (model_config or {}).get("device") or default_device()
    pt2 = os.path.join(path, PT2_FILE)
    validate(pt2)
    module, device = load_program(pt2, wanted)
    scores = _PyTorchWrapper(module, device=device)
    classes_file = os.path.join(path, CLASSES_FILE)
    if not os.path.exists(classes_file):
        return scores
    import importlib
    import json

    with open(classes_file) as f:
        classes = json.load(f)["classes"]
    return importlib.import_module(CLASSIFIER_MODULE).Classifier(scores, classes)
