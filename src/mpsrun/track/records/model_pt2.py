"""Log a model the training process exported (pt2), from a process that never imports torch.

Why: in the MLflow helper (track/helper/process.py), `mlflow.pytorch.log_model` would import torch
and, for the pt2 export, torch._dynamo: seconds of a short run, on the core the training
process is not using only while it trains. The training process has both loaded already
(every torch optimizer imports torch._dynamo), so it exports there (`model_log.export_pt2`:
`torch.export.export` with a dynamic batch dimension and `torch.export.save`, as
`mlflow.pytorch.save_model` does), and the helper writes the same MLflow model folder
around the file: `MLmodel` with the `pytorch` and `python_function` flavors, the input
example, the signature, requirements, `extra_files/`, through `mlflow.models.Model.log`
(LoggedModel, linked metrics, registry), as `mlflow.pytorch.log_model` would.
`mlflow.pytorch.load_model` and `mlflow.pyfunc.load_model` read it as their own
(tests/test_mlflow_depth.py loads it in a fresh process).
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mpsrun.track.records import classifier, pyfunc_loader

FLAVOR = "pytorch"  # mlflow.pytorch.FLAVOR_NAME
DATA = "data"  # mlflow.pytorch._MODEL_DATA_SUBPATH
PT2_FILE = pyfunc_loader.PT2_FILE  # mlflow.pytorch._EXPORTED_TORCH_MODEL_FILE_NAME
PICKLE_MODULE = "mlflow.pytorch.pickle_module"  # recorded by mlflow.pytorch for pyfunc, pt2 or not
CODE = "code"  # the model folder's code directory (pyfunc puts it on sys.path): mpsrun's pyfunc loader


def _plain_version(v: str) -> str:
    return re.sub(r"\+.*$", "", v)  # 2.11.0+cu130 -> 2.11.0: pip cannot find local builds by their label


def requirements(torch_version: str, distributions: dict[str, str]) -> list[str]:
    """torch (the training process's), mlflow, numpy pinned to what ran, plus each plugin distribution."""
    import mlflow
    import numpy as np

    reqs = {
        "torch": f"torch=={_plain_version(torch_version)}",
        "mlflow": f"mlflow=={_plain_version(mlflow.__version__)}",
        "numpy": f"numpy=={np.__version__}",
    }
    for name, version in distributions.items():
        if name and name != "unknown":
            reqs.setdefault(name.lower(), f"{name}=={version}" if version and version != "?" else name)
    return list(reqs.values())


class _Flavor:
    """What `Model.log` calls to write the model folder: `mlflow.pytorch.save_model`'s pt2 branch,
    given the exported file instead of the module."""

    def __init__(self, pt2_file: str, torch_version: str, classes: list[str] | None = None) -> None:
        self.__name__ = "mlflow.pytorch"  # the LoggedModel's flavor, as mlflow.pytorch.log_model records it
        self.pt2_file, self.torch_version, self.classes = pt2_file, torch_version, classes

    def save_model(self, path: str, mlflow_model: Any, signature: Any = None, input_example: Any = None,
                   pip_requirements: list[str] | None = None, extra_files: list[str] | None = None, metadata: Any = None, **_: Any) -> None:
        from mlflow import pyfunc
        from mlflow.models.model import MLMODEL_FILE_NAME
        from mlflow.models.utils import _save_example
        from mlflow.utils.environment import (
            _CONDA_ENV_FILE_NAME,
            _CONSTRAINTS_FILE_NAME,
            _PYTHON_ENV_FILE_NAME,
            _REQUIREMENTS_FILE_NAME,
            _process_pip_requirements,
            _PythonEnv,
        )
        from mlflow.utils.file_utils import get_total_file_size, write_to
        from mlflow.utils.model_utils import _copy_extra_files, _validate_and_prepare_target_save_path
        import yaml

        path = os.path.abspath(path)
        _validate_and_prepare_target_save_path(path)
        _save_example(mlflow_model, input_example, path)
        if signature is not None:
            mlflow_model.signature = signature
        if metadata is not None:
            mlflow_model.metadata = metadata
        os.makedirs(os.path.join(path, DATA))
        shutil.copyfile(self.pt2_file, os.path.join(path, DATA, PT2_FILE))
        extra = _copy_extra_files(extra_files, path)
        mlflow_model.add_flavor(FLAVOR, model_data=DATA, pytorch_version=self.torch_version, code=None, **extra)
        # pyfunc loads through mpsrun's loader, which moves the program to the loading machine's
        # device (track/records/pyfunc_loader.py); a classifier answers class, class_index,
        # probability, score_<class> (track/records/classifier.py, copied beside it)
        os.makedirs(os.path.join(path, CODE))
        shutil.copyfile(pyfunc_loader.__file__, os.path.join(path, CODE, f"{pyfunc_loader.LOADER_MODULE}.py"))
        if self.classes is not None:
            import json

            with open(os.path.join(path, DATA, pyfunc_loader.CLASSES_FILE), "w") as f:
                json.dump({"classes": self.classes}, f, indent=2)
            shutil.copyfile(classifier.__file__, os.path.join(path, CODE, f"{pyfunc_loader.CLASSIFIER_MODULE}.py"))
        pyfunc.add_to_model(
            mlflow_model,
            loader_module=pyfunc_loader.LOADER_MODULE,
            data=DATA,
            pickle_module_name=PICKLE_MODULE,
            code=CODE,
            conda_env=_CONDA_ENV_FILE_NAME,
            python_env=_PYTHON_ENV_FILE_NAME,
            model_config={"device": None},
        )
        if size := get_total_file_size(path):
            mlflow_model.model_size_bytes = size
        mlflow_model.save(os.path.join(path, MLMODEL_FILE_NAME))
        conda_env, pip_reqs, constraints = _process_pip_requirements(None, pip_requirements, None)
        with open(os.path.join(path, _CONDA_ENV_FILE_NAME), "w") as f:
            yaml.safe_dump(conda_env, stream=f, default_flow_style=False)
        if constraints:
            write_to(os.path.join(path, _CONSTRAINTS_FILE_NAME), "\n".join(constraints))
        write_to(os.path.join(path, _REQUIREMENTS_FILE_NAME), "\n".join(pip_reqs))
        _PythonEnv.current().to_yaml(os.path.join(path, _PYTHON_ENV_FILE_NAME))


def log_exported(uri: str, experiment_id: str, run_id: str, pt2_file: str, example: Any, outputs: Any, torch_version: str,
                 artifact: str, distributions: dict[str, str], info: dict[str, Any], metadata: dict[str, Any],
                 register: str | None = None, step: int = 0) -> dict[str, Any]:
    """The model in `pt2_file` (exported from `example`, which gave `outputs`) logged under the run as `artifact`."""
    import json
    import tempfile

    import mlflow
    from mlflow.models import Model, infer_signature

    t0 = time.perf_counter()
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=experiment_id)  # the LoggedModel's experiment is the run's
    k = int(metadata.get("num_classes") or 0)
    classes = classifier.class_names(k, info) if k >= 2 and getattr(outputs, "ndim", 0) == 2 and outputs.shape[1] == k else None
    pyfunc_output = outputs
    if classes is not None:
        pyfunc_output = classifier.table(outputs, classes)  # the signature describes what pyfunc answers
        metadata = {**metadata, "pyfunc_output": "class, class_index, probability, score_<class> per class"}
    meta = json.loads(json.dumps({**metadata, "data_info": info, "serialization": "pt2"}, default=str))
    with tempfile.TemporaryDirectory() as d, integer_inputs_expected():
        info_file = Path(d) / "data_info.json"
        info_file.write_text(json.dumps(info, indent=2, default=str))
        logged = Model.log(
            artifact_path=None,
            name=artifact,
            flavor=_Flavor(pt2_file, torch_version, classes),
            registered_model_name=register,
            metadata=meta,
            run_id=run_id,
            step=step,
            signature=infer_signature(example, pyfunc_output),
            input_example=example,
            pip_requirements=requirements(torch_version, distributions),
            extra_files=[str(info_file)],
            serialization_format="pt2",
            validate_serving_input=False,  # as model_log: no reload through pyfunc at the end of every run
        )
    registered = None
    if register and getattr(logged, "registered_model_version", None) is not None:
        registered = f"models:/{register}/{logged.registered_model_version}"
    return {"model_uri": f"runs:/{run_id}/{artifact}", "model_id": getattr(logged, "model_id", None),
            "seconds": time.perf_counter() - t0, "registered": registered, "notes": []}


@contextmanager
def integer_inputs_expected() -> Iterator[None]:
    """MLflow's schema inference warns that integer columns cannot hold missing values; an image model's input
    is uint8 pixels by design (what a client has at serving time), so the hint is noise on the user's screen."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Hint: Inferred schema contains integer column", category=UserWarning)
        yield

