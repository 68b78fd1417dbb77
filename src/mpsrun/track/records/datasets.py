"""Datasets as run inputs (`mlflow.data`): the UI's Datasets column and the run page show them.

Each split is logged once, with its source (the data's folder or file where the
plugin read one, else the plugin that made it), a digest (MLflow's, over the raw
tensors: two runs on the same data show the same digest), a schema (dtype and
shape of inputs and targets) and its context: `training`, `validation`, `test`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Split:
    context: str  # training | validation | test
    features: Any  # a tensor or array of raw inputs, as the dataset yields them
    targets: Any


DIGEST_VALUES = 10_000  # mlflow.data.digest_utils.MAX_ROWS: the digest reads this many values of the flattened array


@dataclass
class Head:
    """The first values of a large array and its shape and dtype: all that MLflow's dataset input reads
    (its digest hashes the first 10,000 values of the flattened array and the shape; its profile and
    schema are shape, size, bytes and dtype). Sent to the helper instead of 50 MB of images, which the
    training process spent a sixth of a second pickling into the pipe before its first step."""

    values: np.ndarray  # the flattened array's first values (at least DIGEST_VALUES of them)
    shape: tuple[int, ...]

    @staticmethod
    def of(a: Any) -> "np.ndarray | Head":
        """A Head of a large array or tensor (its first values copied to the host, not the rest); small ones whole."""
        if hasattr(a, "detach"):  # a tensor (duck-typed: the helper never imports torch)
            if a.numel() <= 4 * DIGEST_VALUES:
                return _numpy(a)
            return Head(_numpy(a.reshape(-1)[:DIGEST_VALUES]).copy(), tuple(a.shape))
        a = np.asarray(a)
        if a.dtype == object or a.size <= 4 * DIGEST_VALUES:
            return a
        return Head(np.ascontiguousarray(a).reshape(-1)[:DIGEST_VALUES].copy(), tuple(a.shape))

    def expand(self) -> np.ndarray:
        """An array of the real shape and dtype whose first values are the real ones (the rest zeros, never read)."""
        out = np.zeros(self.shape, dtype=self.values.dtype)
        out.reshape(-1)[: self.values.size] = self.values
        return out


def _numpy(a: Any) -> np.ndarray:
    if isinstance(a, Head):
        return a.expand()
    if hasattr(a, "detach"):
        a = a.detach().to("cpu").numpy()
    return np.asarray(a)


def _source(path: str | None, tags: dict[str, str]) -> Any:
    """A local path when the data came from one; otherwise the code (plugin) that made it."""
    from mlflow.data.code_dataset_source import CodeDatasetSource

    if path and Path(path).exists():
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        try:
            with warnings.catch_warnings():  # "can be interpreted in multiple ways": a local path, either way
                warnings.simplefilter("ignore", UserWarning)
                return resolve_dataset_source(str(Path(path).resolve()))
        except Exception:  # no source type claims it: fall back to the code source below
            pass
    return CodeDatasetSource(tags=tags)


def datasets_for(name: str, splits: list[Split], source_path: str | None, source_tags: dict[str, str]) -> list[tuple[Any, str]]:
    """(mlflow.data dataset, context) per split; no MLflow call is made here."""
    import mlflow.data

    src = _source(source_path, source_tags)
    return [
        (mlflow.data.from_numpy(_numpy(s.features), source=src, targets=_numpy(s.targets), name=name), s.context)
        for s in splits
    ]


def log_datasets(c: Any, run_id: str, name: str, splits: list[Split], source_path: str | None = None, source_tags: dict[str, str] | None = None) -> int:
    """Log every split as an input of the run; returns how many were logged."""
    from mlflow.entities import DatasetInput, InputTag

    items = datasets_for(name, splits, source_path, source_tags or {})
    inputs = [
        DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(key="mlflow.data.context", value=ctx)])
        for ds, ctx in items
    ]
    if inputs:
        c.log_inputs(run_id, datasets=inputs)
    return len(inputs)
