"""What a logged classifier answers through `mlflow.pyfunc` and `mlflow models serve`: named columns.

Why: the network's output is one raw score (logit) per class; served as is, a client
needs the training code to know which column is which class and how to turn scores
into a decision. Through pyfunc a classifier answers, per input row:

    class        the predicted class's name (the dataset's class names, e.g. FashionMNIST's
                 "Ankle boot"; the index as text where the dataset names none)
    class_index  its index (int)
    probability  its softmax probability
    score_<name> the raw score of each class (what the network outputs)

`mlflow.pytorch.load_model` still gives the plain module (raw scores as a tensor).

This file is copied into each logged classifier's `code/` folder as `mpsrun_classifier.py`,
beside the pyfunc loader `mpsrun_pyfunc.py` (track/records/pyfunc_loader.py), which wraps the
model in `Classifier`: MLflow imports both from there in a process without mpsrun, so this
file imports only numpy and pandas. The class names sit beside the weights in
`data/classes.json`. (Models logged before that loader carry their own older copy of this
file, with its own `_load_pyfunc`.)
"""

from __future__ import annotations

from typing import Any


def class_names(num_classes: int, info: dict[str, Any] | None) -> list[str]:
    """The dataset's class names (`info["classes"]`) when there are `num_classes` of them, else "0", "1", ..."""
    names = (info or {}).get("classes")
    if isinstance(names, (list, tuple)) and len(names) == num_classes:
        return [str(n) for n in names]
    return [str(i) for i in range(num_classes)]


def table(scores: Any, classes: list[str]) -> Any:
    """Raw scores (N, K) as the answer's columns: class, class_index, probability, score_<name> per class."""
    import numpy as np
    import pandas as pd

    s = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    z = np.exp(s - s.max(axis=1, keepdims=True))  # softmax, stable for large scores
    p = z / z.sum(axis=1, keepdims=True)
    idx = p.argmax(axis=1)
    out = pd.DataFrame({
        "class": [classes[i] for i in idx],
        "class_index": idx.astype(np.int64),
        "probability": p[np.arange(len(idx)), idx],
    })
    for j, name in enumerate(classes):
        out[f"score_{name}"] = s[:, j]
    return out


class Classifier:
    """The pyfunc model: MLflow's PyTorch pyfunc (raw scores) with the named columns on top."""

    def __init__(self, scores: Any, classes: list[str]) -> None:
        self.scores = scores
        self.classes = classes

    def get_raw_model(self) -> Any:
        return self.scores.get_raw_model()

    def predict(self, data: Any, params: dict[str, Any] | None = None) -> Any:
        import numpy as np

        return table(np.asarray(self.scores.predict(data, params)), self.classes)
