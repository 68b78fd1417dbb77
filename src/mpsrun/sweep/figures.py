"""The parent run's PNG figures, with matplotlib (Agg): optimization history, importances, each param vs the metric.

Drawn here rather than with optuna.visualization.matplotlib (experimental, and one style per
Optuna release); the importances are a one-way effect size per parameter (see `importances`),
which needs two finished trials whose values differ: otherwise the figure is skipped and said so.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from mpsrun.recipe.load import Resolved
from mpsrun.sweep import space


def _finished(study: Any) -> list[Any]:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)]


def draw(resolved: Resolved, study: Any, folder: Path) -> tuple[list[Path], list[str]]:
    """(files written, notes on figures skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = resolved.recipe.sweep
    assert sweep is not None
    done = _finished(study)
    if not done:
        return [], ["figures: no COMPLETE trial to draw"]
    made: list[Path] = []
    notes: list[str] = []
    better = min if sweep.direction() == "min" else max

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [t.number for t in done]
    ys = [t.value for t in done]
    best, run = [], None
    for y in ys:
        run = y if run is None else better(run, y)
        best.append(run)
    ax.scatter(xs, ys, s=14, label=sweep.metric)
    ax.step(xs, best, where="post", color="C3", label=f"best so far ({sweep.direction()})")
    ax.set_xlabel("trial")
    ax.set_ylabel(sweep.metric)
    ax.set_title("optimization history")
    ax.legend()
    made.append(_save(fig, folder / "optimization_history.png"))

    imp = importances(sweep, done)
    if imp:
        fig, ax = plt.subplots(figsize=(6, 1.2 + 0.4 * len(imp)))
        names = sorted(imp, key=imp.get)
        ax.barh(names, [imp[n] for n in names])
        ax.set_xlabel("share of the metric's variance explained (one-way, eta squared)")
        ax.set_title(f"parameter importances for {sweep.metric}")
        made.append(_save(fig, folder / "param_importances.png"))
    else:
        notes.append("figures: parameter importances need two COMPLETE trials whose values differ")

    for key, p in sweep.params.items():
        pts = [(space.decode(p, t.params[key]), t.value) for t in done if key in t.params]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        if p.choices is not None:
            labels = [json.dumps(c) if not isinstance(c, str) else c for c in p.choices]
            index = {lab: i for i, lab in enumerate(labels)}
            ax.scatter([index.get(json.dumps(v) if not isinstance(v, str) else v, 0) for v, _ in pts], [y for _, y in pts], s=14)
            ax.set_xticks(range(len(labels)), labels, rotation=30 if max(len(x) for x in labels) > 8 else 0)
        else:
            ax.scatter([v for v, _ in pts], [y for _, y in pts], s=14)
            if p.log:
                ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(sweep.metric)
        ax.set_title(f"{sweep.metric} against {key}")
        made.append(_save(fig, folder / f"param_{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.png"))
    return made, notes


def importances(sweep: Any, done: list[Any], bins: int = 4) -> dict[str, float]:
    """Each parameter's one-way effect size (eta squared): the share of the metric's variance between its groups.

    Choices group by value; ranges by quantile bins. Computed here with numpy rather than
    `optuna.importance` (fANOVA), whose import alone pulls in scikit-learn (~3 s on 2 cores).
    """
    import numpy as np

    ys = np.array([t.value for t in done], dtype=float)
    if len(ys) < 2 or float(ys.var()) == 0.0:
        return {}
    out: dict[str, float] = {}
    for key, p in sweep.params.items():
        rows = [(t.params[key], y) for t, y in zip(done, ys) if key in t.params]
        if len(rows) < 2:
            continue
        xs = [x for x, _ in rows]
        y = np.array([v for _, v in rows])
        if p.choices is not None:
            groups = [str(x) for x in xs]
        else:
            edges = np.quantile(np.array(xs, dtype=float), np.linspace(0, 1, bins + 1)[1:-1])
            groups = [str(int(np.searchsorted(edges, x, side="right"))) for x in xs]
        total = float(((y - y.mean()) ** 2).sum())
        if total == 0.0:
            continue
        between = sum(len(idx) * (float(y[idx].mean()) - float(y.mean())) ** 2 for idx in _by_group(groups))
        out[key] = between / total
    return out


def _by_group(groups: list[str]) -> list[list[int]]:
    index: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    return list(index.values())


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
