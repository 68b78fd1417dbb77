"""Figures on the run's artifacts page: learning curves, and what the model gets wrong.

- `figures/learning_curves.png`: loss and the task's metric per epoch, train vs
  validation (rewritten every few epochs on long runs, so a run in progress has one);
- classification: `figures/confusion_matrix.png` (rows: true class, normalised per
  row, counts written in) and `figures/per_class_accuracy.png`, with the numbers as
  the table `tables/per_class_accuracy.json` (MLflow's table viewer);
- regression: `figures/predicted_vs_true.png`, a scatter against the diagonal.

Same look as the parity and bench plots: object-oriented matplotlib on the Agg
canvas (no pyplot state, safe off the main thread), tab10 colours, light grid,
small titles that say what ran.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

LEARNING_CURVES = "figures/learning_curves.png"
# Per task: metric names (without train_/val_) tried in order for the second panel.
TASK_METRICS = ("accuracy", "r2", "mae", "rmse", "mse")


def _figure(size: tuple[float, float]) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _series(history: Sequence[dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    xs = [i for i, h in enumerate(history) if key in h and h[key] == h[key]]
    return [x + 1 for x in xs], [float(history[x][key]) for x in xs]


def task_metric(history: Sequence[dict[str, float]]) -> str | None:
    """The metric the second panel shows: the first of TASK_METRICS the run logs."""
    keys = set().union(*history) if history else set()
    for base in TASK_METRICS:
        if f"val_{base}" in keys or f"train_{base}" in keys:
            return base
    return None


def learning_curves(history: Sequence[dict[str, float]], title: str) -> Any:
    """Two panels: loss, then the task metric; train solid, validation dashed; x = epoch (1-based)."""
    metric = task_metric(history)
    fig = _figure((8, 3.6))
    axes = fig.subplots(1, 2 if metric else 1, squeeze=False)[0]
    for ax, base in zip(axes, ["loss"] + ([metric] if metric else [])):
        for split, style, color in (("train", "o-", "tab:blue"), ("val", "s--", "tab:orange")):
            xs, ys = _series(history, f"{split}_{base}")
            if xs:
                ax.plot(xs, ys, style, color=color, label=f"{split}_{base}", markersize=4)
        ax.set_xlabel("epoch")
        ax.set_ylabel(base)
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return fig


def confusion(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts: rows are true classes, columns predicted classes."""
    m = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(m, (y_true.astype(np.int64), y_pred.astype(np.int64)), 1)
    return m


def confusion_figure(m: np.ndarray, classes: Sequence[str], title: str) -> Any:
    n = len(classes)
    size = min(4 + 0.45 * n, 14)
    fig = _figure((size, size * 0.85))
    ax = fig.subplots()
    share = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    if n <= 30:
        for i in range(n):
            for j in range(n):
                if m[i, j]:
                    ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if share[i, j] > 0.5 else "black")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xticklabels(classes, fontsize=7, rotation=90 if n > 12 else 0)
    ax.set_yticklabels(classes, fontsize=7)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    fig.colorbar(im, ax=ax, label="share of the true class", shrink=0.8)
    ax.set_title(title, fontsize=9)
    return fig


def per_class(m: np.ndarray, classes: Sequence[str]) -> dict[str, list]:
    """Per-class support, correct and accuracy, as columns (MLflow's log_table format)."""
    support = m.sum(axis=1)
    correct = np.diag(m)
    acc = np.where(support > 0, correct / np.maximum(support, 1), np.nan)
    return {
        "class": list(classes),
        "support": [int(v) for v in support],
        "correct": [int(v) for v in correct],
        "accuracy": [round(float(v), 4) for v in acc],
    }


def per_class_figure(table: dict[str, list], title: str) -> Any:
    fig = _figure((max(6, 0.4 * len(table["class"]) + 2), 3.4))
    ax = fig.subplots()
    ax.bar(range(len(table["class"])), table["accuracy"], color="tab:blue")
    ax.set_xticks(range(len(table["class"])))
    ax.set_xticklabels(table["class"], fontsize=7, rotation=90 if len(table["class"]) > 12 else 0)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.set_xlabel("true class")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=9)
    return fig


def scatter_figure(y_true: np.ndarray, y_pred: np.ndarray, title: str) -> Any:
    fig = _figure((4.8, 4.5))
    ax = fig.subplots()
    t, p = y_true.reshape(-1), y_pred.reshape(-1)
    ax.scatter(t, p, s=6, alpha=0.5, color="tab:blue")
    lo, hi = float(min(t.min(), p.min())), float(max(t.max(), p.max()))
    ax.plot([lo, hi], [lo, hi], ":", color="red", label="predicted = true")
    ax.set_xlabel("true value")
    ax.set_ylabel("predicted value")
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return fig


def log_learning_curves(c: Any, run_id: str, history: Sequence[dict[str, float]], title: str) -> str:
    c.log_figure(run_id, learning_curves(history, title), LEARNING_CURVES)
    return LEARNING_CURVES


def prediction_figures(
    y_true: np.ndarray, outputs: np.ndarray, title: str, classes: Sequence[str] | None = None, split: str = "validation",
) -> tuple[list[tuple[Any, str]], list[tuple[dict[str, list], str]]]:
    """The figures (with their artifact files) and tables from the model's validation outputs; the task is
    read from the data. Integer targets with one output per class: classification. Anything else: regression.
    """
    y_true = np.asarray(y_true)
    outputs = np.asarray(outputs)
    figs: list[tuple[Any, str]] = []
    tables: list[tuple[dict[str, list], str]] = []
    classification = np.issubdtype(y_true.dtype, np.integer) and outputs.ndim == 2 and outputs.shape[1] > 1
    if classification:
        n = outputs.shape[1]
        names = [str(c_) for c_ in (classes or range(n))]
        m = confusion(y_true, outputs.argmax(axis=1), n)
        acc = float(np.trace(m) / max(m.sum(), 1))
        figs.append((confusion_figure(m, names, f"{title}: confusion matrix ({split}, accuracy {acc:.4f})"), "figures/confusion_matrix.png"))
        table = per_class(m, names)
        tables.append((table, "tables/per_class_accuracy.json"))
        figs.append((per_class_figure(table, f"{title}: accuracy per class ({split})"), "figures/per_class_accuracy.png"))
    else:
        pred = outputs.reshape(len(y_true), -1)
        if pred.shape[1] == 1:
            figs.append((scatter_figure(y_true.astype(np.float64), pred[:, 0].astype(np.float64), f"{title}: predicted vs true ({split})"),
                         "figures/predicted_vs_true.png"))
    return figs, tables


def log_predictions(
    c: Any, run_id: str, y_true: np.ndarray, outputs: np.ndarray, title: str, classes: Sequence[str] | None = None,
    split: str = "validation",
) -> list[str]:
    """`prediction_figures` logged on the run; the artifact files written."""
    figs, tables = prediction_figures(y_true, outputs, title, classes, split)
    logged: list[str] = []
    for fig, name in figs[:1]:
        c.log_figure(run_id, fig, name)
        logged.append(name)
    for table, name in tables:
        c.log_table(run_id, data=table, artifact_file=name)
        logged.append(name)
    for fig, name in figs[1:]:
        c.log_figure(run_id, fig, name)
        logged.append(name)
    return logged


def draw_end(history: Sequence[dict[str, float]], title: str, predictions: Any, classes: Sequence[str] | None,
             folder: str, curves: bool = True) -> dict[str, Any]:
    """The end-of-run figures as PNG files in `folder`, without MLflow (the exporter process draws them
    while the MLflow helper logs the model: track/helper/exporter.py); `log_drawn` logs them.

    `predictions`: (y_true, outputs), or the text of the error that kept them from being computed.
    `curves=False`: the learning curves are drawn elsewhere (by the helper, once it has written the model).
    Returns {"files": [(file, artifact_dir)], "tables": [(data, artifact_file)], "notes": [...]}.
    """
    import os

    files: list[tuple[str, str]] = []
    tables: list[tuple[dict[str, list], str]] = []

    def save(fig: Any, name: str) -> None:
        path = os.path.join(folder, os.path.basename(name))
        fig.savefig(path)  # as MlflowClient.log_figure saves it
        files.append((path, os.path.dirname(name)))

    try:
        if curves:
            save(learning_curves(history, title), LEARNING_CURVES)
        if isinstance(predictions, str):
            raise RuntimeError(predictions)
        figs, tables = prediction_figures(predictions[0], predictions[1], title, classes)
        for fig, name in figs:
            save(fig, name)
    except Exception as e:
        return {"files": files, "tables": tables, "notes": [f"figures: not logged ({type(e).__name__}: {e})"]}
    return {"files": files, "tables": tables, "notes": []}


def log_drawn(c: Any, run_id: str, drawn: dict[str, Any]) -> list[str]:
    """Log what `draw_end` drew; its notes, and any failure, as notes."""
    try:
        for path, folder in drawn["files"]:
            c.log_artifact(run_id, path, folder or None)
        for table, name in drawn["tables"]:
            c.log_table(run_id, data=table, artifact_file=name)
    except Exception as e:
        return [*drawn["notes"], f"figures: not logged ({type(e).__name__}: {e})"]
    return list(drawn["notes"])
