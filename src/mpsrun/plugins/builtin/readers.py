"""Reading the built-in datasets' files with numpy alone.

Why: importing torchvision to read four IDX files pulled in its model zoo (7.4 s of
a 19 s run on the H100 machine), and importing scikit-learn to read its bundled
digits costs as much as importing torch on a 2-core CPU. The formats are simple
and fixed, so they are read here directly; torchvision stays for downloads and
torchvision models, scikit-learn is not needed at run time at all.
`tests/test_startup.py` checks that these readers give arrays identical to
torchvision's and to `sklearn.datasets.load_digits` + `train_test_split`.

Nothing here imports torch: the caller turns arrays into tensors (zero copy).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path

import numpy as np

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"), big-endian.
_IDX_TYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


class IdxFormatError(ValueError):
    """A file that is not a well-formed IDX file (bad input: names the file)."""


def idx_path(raw: Path, stem: str) -> Path | None:
    """The uncompressed file if present (what a finished torchvision download leaves), else the .gz, else None."""
    for p in (raw / stem, raw / f"{stem}.gz"):
        if p.exists():
            return p
    return None


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (optionally gzip'd) as a native-endian numpy array of its declared shape."""
    path = Path(path)
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        data = gzip.decompress(data)
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise IdxFormatError(f"{path}: not an IDX file (header {data[:4].hex() or 'empty'})")
    dtype, ndim = _IDX_TYPES[data[2]], data[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    count = math.prod(shape)
    if len(data) - header != count * dtype.itemsize:
        raise IdxFormatError(f"{path}: header says shape {shape} ({count * dtype.itemsize} bytes), file has {len(data) - header}")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=False) if dtype.byteorder == ">" else arr.copy()


def sklearn_data_file(name: str) -> Path:
    """A data file bundled with scikit-learn, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")  # a top-level find does not import the package
    if spec is None or spec.origin is None:
        raise FileNotFoundError("scikit-learn is not installed; the digits dataset ships with it (pip install scikit-learn)")
    path = Path(spec.origin).parent / "datasets" / "data" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: this scikit-learn does not bundle {name}")
    return path


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images float64 [1797, 8, 8] with values 0..16, targets int) exactly as `load_digits()` gives them."""
    with gzip.open(sklearn_data_file("digits.csv.gz"), "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)


def stratified_split(y: np.ndarray, test_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices identical to `train_test_split(range(n), test_size=..., random_state=seed, stratify=y)`.

    scikit-learn's StratifiedShuffleSplit, step for step (same random draws in the same
    order), so runs keep the split they had when digits was read through scikit-learn.
    """
    n = len(y)
    n_test = math.ceil(test_size * n)
    n_train = n - n_test
    classes, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    if np.min(class_counts) < 2:
        raise ValueError(f"classes with fewer than 2 members cannot be stratified: {classes[class_counts < 2].tolist()}")
    if n_train < len(classes) or n_test < len(classes):
        raise ValueError(f"a split of {n_train} / {n_test} samples cannot hold all {len(classes)} classes")
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i in range(len(classes)):
        perm = class_indices[i].take(rng.permutation(class_counts[i]), mode="clip")
        train.extend(perm[: n_i[i]])
        test.extend(perm[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's `utils.extmath._approximate_mode`: per-class draws, ties broken by `rng`."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            inds = rng.choice(inds, size=add_now, replace=False)
            floored[inds] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)
