"""Log the trained model the MLflow way: a LoggedModel a fresh process can load.

The model folder `mlflow.pytorch.log_model(name="model")` (MLflow 3) would write, with:
- MLflow's `pt2` format (torch.export): a traced graph with the weights, no pickle,
  so `mlflow.pytorch.load_model` and `mlflow.pyfunc.load_model` work in a process
  that never imports mpsrun or the plugin (MLflow 3.17 refuses to unpickle models
  unless told to). A model torch.export cannot trace falls back to pickle, said
  and tagged; the logged module is then the plain one (`served.unwrap`), never a
  compiled or DDP wrapper, and plugin classes load by their module path;
- for a classifier, a pyfunc that answers named columns (class, class_index,
  probability, score_<class>; `classifier`); a pickled model's answers raw scores;
- a signature and an input example taken from the validation data (raw, as the
  dataset yields it: the logged module carries the input transform, see `served`);
- explicit pip requirements (torch, mlflow, and the distributions that shipped
  the model and dataset plugins), which also spares MLflow's requirement
  inference: it loads the model in a subprocess, seconds on a small machine;
- the dataset's `info` (e.g. tabular vocabularies) in the MLmodel metadata and as
  `data_info.json` beside the weights, since the weights are useless without it;
- optionally a new version of a registered model (`tracking.register: NAME`).

Why no separate `model.pt` state_dict any more: the logged model holds the same
weights with the architecture, the transform and the data info;
`mlflow.pytorch.load_model(uri).net.state_dict()` gives the bare state_dict back,
and checkpoints (`resume`) hold the weights for continuing a run. A second copy
cost disk and upload time and could not be loaded without the plugin's code and
arguments anyway.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from mpsrun.track.records.served import ServedModel, unwrap

ARTIFACT = "model"


@dataclass
class ModelLogResult:
    model_uri: str  # runs:/ID/model
    model_id: str | None
    seconds: float
    registered: str | None = None  # models:/NAME/VERSION
    notes: list[str] = field(default_factory=list)


def _plain_version(v: str) -> str:
    return re.sub(r"\+.*$", "", v)  # 2.11.0+cu130 -> 2.11.0: pip cannot find local builds by their label


def requirements(distributions: dict[str, str]) -> list[str]:
    """torch, mlflow, numpy pinned to what ran, plus each plugin distribution (name -> version)."""
    import mlflow

    reqs = {
        "torch": f"torch=={_plain_version(torch.__version__)}",
        "mlflow": f"mlflow=={_plain_version(mlflow.__version__)}",
        "numpy": f"numpy=={np.__version__}",
    }
    for name, version in distributions.items():
        if name and name != "unknown":
            reqs.setdefault(name.lower(), f"{name}=={version}" if version and version != "?" else name)
    return list(reqs.values())


def _fresh_transform(t: Any) -> Any:
    """A copy without per-device caches (ImageTransform keeps device tensors once used)."""
    if t is not None and dataclasses.is_dataclass(t) and not isinstance(t, type):
        return dataclasses.replace(t)
    return copy.deepcopy(t)


def served_copy(model: nn.Module, transform: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> ServedModel:
    """A CPU, eval-mode copy of the plain module with its transform: loads on any machine."""
    net = copy.deepcopy(unwrap(model)).to("cpu").eval()
    return ServedModel(net, _fresh_transform(transform)).eval()


def export_program(served: ServedModel, example: Any) -> Any:
    """`torch.export` the served module on `example`, the batch dimension dynamic (as MLflow's pt2 does)."""
    from torch.export import Dim

    x = torch.as_tensor(np.ascontiguousarray(example))
    dynamic = [{0: Dim.AUTO}] if hasattr(Dim, "AUTO") else [{0: Dim("dim_0")} if x.shape[0] > 1 else None]
    return torch.export.export(served, (x,), dynamic_shapes=dynamic)


def example_outputs(served: ServedModel, example: Any) -> np.ndarray:
    """The served module's outputs on the example (for the signature), float numpy."""
    x = torch.as_tensor(np.ascontiguousarray(example))
    with torch.no_grad():
        y = served(x)
    return y.detach().float().numpy() if y.dtype not in (torch.float32, torch.float64) else y.detach().numpy()


def export_pt2(served: ServedModel, example: np.ndarray, folder: str | Path) -> tuple[str, np.ndarray]:
    """`export_program` into `folder/model.pt2`; returns the file and the example's outputs.

    Run in the training process, which has torch._dynamo loaded already, so that the MLflow
    helper need not import torch at all (track/model_pt2.py writes the MLflow model around it),
    unless the exporter process exported it ahead (track/helper/exporter.py).
    """
    y = example_outputs(served, example)
    program = export_program(served, example)
    path = Path(folder) / "model.pt2"
    torch.export.save(program, str(path))
    return str(path), y


def log_model(
    uri: str,
    experiment_id: str,
    run_id: str,
    model: nn.Module,
    transform: Optional[Callable[[torch.Tensor], torch.Tensor]],
    example: torch.Tensor,
    distributions: dict[str, str],
    info: dict[str, Any],
    metadata: dict[str, Any],
    register: str | None = None,
    step: int = 0,
) -> ModelLogResult:
    """Log `model` (with `transform`) under the run; `example` is a few raw validation inputs.

    `step` is the last epoch: MLflow links the run's metrics at that step (the final
    epoch's losses and accuracy) to the LoggedModel.
    """
    t0 = time.perf_counter()
    res = log_served(uri, experiment_id, run_id, served_copy(model, transform), example, distributions, info, metadata, register, step)
    res.seconds = time.perf_counter() - t0
    return res


def log_served(
    uri: str,
    experiment_id: str,
    run_id: str,
    served: ServedModel,
    example: Any,
    distributions: dict[str, str],
    info: dict[str, Any],
    metadata: dict[str, Any],
    register: str | None = None,
    step: int = 0,
) -> ModelLogResult:
    """`log_model` for a `served_copy` made already (in the MLflow helper: made by the training process).

    Exported with torch.export and written as `model_pt2` writes it (a classifier's pyfunc answers
    named columns: track/records/classifier.py); a model torch.export cannot trace is pickled.
    """
    import mlflow
    from mlflow.models import infer_signature

    t0 = time.perf_counter()
    x = torch.as_tensor(example).detach().to("cpu")
    x_np = x.numpy()
    with tempfile.TemporaryDirectory() as d:  # the same model folder the MLflow helper writes (model_pt2)
        try:
            pt2, outputs = export_pt2(served, x_np, d)
        except Exception as e:  # a model torch.export cannot trace (data-dependent control flow, ...)
            export_error: Exception | None = e
        else:
            from mpsrun.track.records import model_pt2

            out = model_pt2.log_exported(uri, experiment_id, run_id, pt2, x_np, outputs, str(torch.__version__), ARTIFACT,
                                         distributions, info, metadata, register=register, step=step)
            return ModelLogResult(out["model_uri"], out["model_id"], time.perf_counter() - t0, out["registered"], out["notes"])
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=experiment_id)  # the LoggedModel's experiment is the run's
    with torch.no_grad():
        y = served(x)
    from mpsrun.track.records.model_pt2 import integer_inputs_expected

    with integer_inputs_expected():
        signature = infer_signature(x_np, y.numpy())
    meta = {**metadata, "data_info": info}
    notes: list[str] = [
        f"model: torch.export failed ({type(export_error).__name__}: {str(export_error).splitlines()[0][:200] if str(export_error) else ''}); "
        "logged with pickle instead: loading it needs the plugin's package and MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true; "
        "pyfunc answers raw scores"
    ]
    with tempfile.TemporaryDirectory() as d, integer_inputs_expected():
        info_file = Path(d) / "data_info.json"
        info_file.write_text(json.dumps(info, indent=2, default=str))

        def _log(fmt: str) -> Any:
            return mlflow.pytorch.log_model(
                served,
                name=ARTIFACT,
                run_id=run_id,
                signature=signature,
                input_example=x_np,
                pip_requirements=requirements(distributions),
                extra_files=[str(info_file)],
                metadata=json.loads(json.dumps({**meta, "serialization": fmt}, default=str)),
                registered_model_name=register,
                step=step,
                serialization_format=fmt,
                # MLflow would reload the saved model through pyfunc and predict the example
                # again: seconds at the end of every run, and on a CUDA machine a failure
                # (pyfunc loads on CUDA, the exported weights are on the CPU). `served(x)`
                # above already ran the example; tests load the model with pyfunc afresh.
                validate_serving_input=False,
            )

        logged = _log("pickle")
    registered = None
    if register and getattr(logged, "registered_model_version", None) is not None:
        registered = f"models:/{register}/{logged.registered_model_version}"
    return ModelLogResult(
        model_uri=f"runs:/{run_id}/{ARTIFACT}",
        model_id=getattr(logged, "model_id", None),
        seconds=time.perf_counter() - t0,
        registered=registered,
        notes=notes,
    )
