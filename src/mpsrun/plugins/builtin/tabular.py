"""Built-in `tabular` dataset and `tabular_mlp` model: CSV files with categorical and numeric columns.

Layout of one sample (documented in docs/plugins.md): a float32 vector of the
categorical columns' integer codes first, then the standardised numeric columns.
One packed tensor keeps the data a two-tensor `TensorDataset`, so the runner's
device-resident fast path applies unchanged, and float32 holds integer codes
exactly up to 2**24 categories per column. The model learns the column split and
the cardinalities from `DataSplits.info`, which the runner hands to any model
that declares a `data_info` parameter.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from mpsrun.plugins.contract import DataSplits
from mpsrun.recipe.problems import did_you_mean

UNKNOWN = 0  # code of a category not seen in the training split, or of an empty cell


def _read(path: Path, what: str) -> Any:
    import pandas as pd

    if not path.is_file():
        raise FileNotFoundError(f"tabular: {what} {path} does not exist (relative paths are read from the recipe's folder)")
    # Everything as text first: categories stay exactly as written ("01" is not 1),
    # and numeric columns are parsed below with an error that names the column.
    return pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)


def _check_columns(df: Any, path: Path, wanted: list[str]) -> None:
    have = list(df.columns)
    for col in wanted:
        if col not in have:
            raise ValueError(f"tabular: column '{col}' is not in {path}{did_you_mean(col, have)}; columns: {', '.join(have)}")


def _numbers(df: Any, col: str, path: Path) -> Any:
    import pandas as pd

    text = df[col].str.strip()
    values = pd.to_numeric(text.where(text != ""), errors="coerce")
    bad = values.isna() & (text != "")
    if bad.any():
        row = int(bad.to_numpy().nonzero()[0][0])
        raise ValueError(f"tabular: numeric column '{col}' of {path} holds '{text.iloc[row]}' (data row {row + 1})")
    return values.to_numpy(dtype="float64")  # empty cells are NaN here


def _label_order(labels: set[str]) -> list[str]:
    """Numeric labels in numeric order (so '10' follows '9'), anything else alphabetically."""
    try:
        return sorted(labels, key=float)
    except ValueError:
        return sorted(labels)


def tabular(
    path: str,
    target: str,
    categorical: list[str] = [],  # noqa: B006 - shown as the default in `mpsrun plugins`
    numeric: list[str] = [],  # noqa: B006
    val_path: Optional[str] = None,
    val_fraction: float = 0.2,
    task: Literal["classification", "regression"] = "classification",
    seed: int = 0,
    recipe_dir: str = ".",
) -> DataSplits:
    """A CSV file with a class column (or, with task regression, a numeric target), named categorical and numeric columns.

    path and val_path are read relative to the recipe file's folder (absolute paths
    work too). Without val_path, a seeded val_fraction of the rows is held out.
    Categories become integer codes 1..K in sorted order of the training split;
    code 0 is reserved for a category the training split never saw and for empty
    cells. Numeric columns are standardised with the training split's mean and
    standard deviation only; empty numeric cells get the training mean (0 after
    standardising). Columns not named are ignored. Each sample is one float32
    vector: codes first, then numbers; models read the column split and the
    cardinalities from data_info (see tabular_mlp). With task: regression the target
    is a number: standardised with the training split's mean and standard deviation
    for training (data_info target_mean, target_std), and the run reports its
    metrics (val_mae, val_rmse, val_r2) in the target's own units.
    """
    import numpy as np

    if not categorical and not numeric:
        raise ValueError("tabular: name at least one column under categorical or numeric")
    named = [target, *categorical, *numeric]
    dupes = sorted({c for c in named if named.count(c) > 1})
    if dupes:
        raise ValueError(f"tabular: column(s) {', '.join(dupes)} named more than once among target, categorical and numeric")
    if val_path is None and not 0.0 < val_fraction < 1.0:
        raise ValueError(f"tabular: val_fraction must be between 0 and 1, got {val_fraction}")

    base = Path(recipe_dir)
    train_file = base / Path(path).expanduser()
    train_df = _read(train_file, "path")
    _check_columns(train_df, train_file, named)
    if val_path is not None:
        val_file = base / Path(val_path).expanduser()
        val_df = _read(val_file, "val_path")
        _check_columns(val_df, val_file, named)
    else:
        val_file = train_file
        n = len(train_df)
        n_val = max(1, round(n * val_fraction))
        if n - n_val < 1:
            raise ValueError(f"tabular: {train_file} has {n} rows, too few to hold out a validation split")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
        val_df = train_df.iloc[np.sort(perm[:n_val])].reset_index(drop=True)
        train_df = train_df.iloc[np.sort(perm[n_val:])].reset_index(drop=True)

    if (train_df[target].str.strip() == "").any() or (val_df[target].str.strip() == "").any():
        raise ValueError(f"tabular: target column '{target}' has empty cells")
    if task == "regression":
        t_train = _numbers(train_df, target, train_file)
        t_mean, t_std = float(t_train.mean()), float(t_train.std())
        t_std = t_std if t_std > 0 else 1.0
        classes: list[str] = []
        class_index: dict[str, int] = {}
    else:
        classes, class_index = _classes(train_df, val_df, target)
    regression = task == "regression"

    def labels(df: Any, file: Path) -> torch.Tensor:
        if regression:
            return torch.from_numpy(((_numbers(df, target, file) - t_mean) / t_std).astype("float32"))
        return torch.tensor([class_index[v] for v in df[target].str.strip()], dtype=torch.long)

    vocab = {}
    for col in categorical:
        seen = sorted(set(train_df[col].str.strip()) - {""})
        vocab[col] = {v: i + 1 for i, v in enumerate(seen)}  # 0 is UNKNOWN

    return _encode_all(train_df, val_df, train_file, val_file, categorical, numeric, vocab, classes, target, labels, task, (t_mean, t_std) if regression else None)


def _classes(train_df: Any, val_df: Any, target: str) -> tuple[list[str], dict[str, int]]:
    classes = _label_order(set(train_df[target].str.strip()) | set(val_df[target].str.strip()))
    if len(classes) < 2:
        raise ValueError(f"tabular: target column '{target}' has a single class ({classes[0]!r})")
    return classes, {c: i for i, c in enumerate(classes)}


def _encode_all(train_df: Any, val_df: Any, train_file: Path, val_file: Path, categorical: list[str], numeric: list[str], vocab: dict, classes: list[str], target: str, labels: Any, task: str, scale: Optional[tuple[float, float]]) -> DataSplits:
    import numpy as np

    mean, std = [], []
    for col in numeric:
        v = _numbers(train_df, col, train_file)
        if np.isnan(v).all():
            raise ValueError(f"tabular: numeric column '{col}' is empty in the training split")
        m, s = float(np.nanmean(v)), float(np.nanstd(v))
        mean.append(m)
        std.append(s if s > 0 else 1.0)  # a constant column becomes all zeros, not NaN

    def encode(df: Any, file: Path) -> TensorDataset:
        cols = [df[c].str.strip().map(vocab[c]).fillna(UNKNOWN).to_numpy(dtype="float32") for c in categorical]
        for j, c in enumerate(numeric):
            v = (_numbers(df, c, file) - mean[j]) / std[j]
            cols.append(np.nan_to_num(v, nan=0.0).astype("float32"))
        x = torch.from_numpy(np.stack(cols, axis=1).astype("float32"))
        return TensorDataset(x, labels(df, file))

    info = {
        "layout": "float32 vector: categorical codes first, then standardised numeric columns",
        "categorical": list(categorical),
        "cardinalities": [len(vocab[c]) + 1 for c in categorical],  # + the reserved unknown code 0
        "vocabulary": {c: list(vocab[c]) for c in categorical},  # value of code i + 1 at index i
        "numeric": list(numeric),
        "numeric_mean": mean,
        "numeric_std": std,
        "classes": classes,
        "target": target,
        "task": task,
    }
    if scale is not None:
        info["target_mean"], info["target_std"] = scale
    return DataSplits(
        train=encode(train_df, train_file),
        val=encode(val_df, val_file),
        num_classes=len(classes),
        input_shape=(len(categorical) + len(numeric),),
        info=info,
        task=task,
    )


class TabularMLP(nn.Module):
    """Embeddings for the categorical codes, concatenated with the numeric columns, then an MLP."""

    def __init__(self, cardinalities: list[int], n_numeric: int, num_classes: int, hidden: list[int], embedding_dim: Optional[int], dropout: float) -> None:
        super().__init__()
        self.n_cat = len(cardinalities)
        dims = [embedding_dim or min(50, (k + 1) // 2) for k in cardinalities]
        self.embeddings = nn.ModuleList(nn.Embedding(k, d) for k, d in zip(cardinalities, dims))
        layers: list[nn.Module] = []
        width = sum(dims) + n_numeric
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.head = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = x[:, : self.n_cat].long()
        parts = [emb(codes[:, i]) for i, emb in enumerate(self.embeddings)]
        parts.append(x[:, self.n_cat :])
        return self.head(torch.cat(parts, dim=1))


def tabular_mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    data_info: dict[str, Any],
    num_outputs: Optional[int] = None,
    hidden: list[int] = [128, 64],  # noqa: B006 - shown as the default in `mpsrun plugins`
    embedding_dim: Optional[int] = None,
    dropout: float = 0.1,
) -> nn.Module:
    """MLP for the tabular dataset: one embedding per categorical column, numeric columns passed through.

    Cardinalities and the column split come from the dataset's data_info (filled in
    by the runner), so recipes name only the architecture. embedding_dim None sizes
    each embedding as min(50, (cardinality + 1) // 2).
    """
    cards = data_info.get("cardinalities")
    if cards is None:
        raise ValueError(
            "tabular_mlp needs a dataset that reports data_info['cardinalities'] "
            "(the built-in tabular dataset does); this dataset reports none, use mlp instead"
        )
    if embedding_dim is not None and embedding_dim < 1:
        raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
    width = math.prod(input_shape)
    n_numeric = width - len(cards)
    if len(input_shape) != 1 or n_numeric < 0:
        raise ValueError(f"tabular_mlp: input_shape {tuple(input_shape)} does not fit {len(cards)} categorical columns")
    return TabularMLP(list(cards), n_numeric, num_outputs or num_classes, list(hidden), embedding_dim, dropout)
