"""What the parent run holds once trials end: the best value and params, best_recipe.yaml, a CSV, figures.

`best_recipe.yaml` is the trial's own recipe (the searched values set, the `sweep:`
section gone), so `mpsrun run best_recipe.yaml` trains the best trial again: same
seed, same data order, the same metric on the CPU. Written after every command (a
re-run with more trials rewrites them); params are immutable in MLflow, so the
`best.<path>` params are logged once, and tags of the same names follow the best.
"""

from __future__ import annotations

import csv
import io
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpsrun.recipe.load import Resolved
from mpsrun.sweep import space, storage


@dataclass
class Summary:
    complete: int
    pruned: int
    failed: int
    lost: int
    best_value: float | None
    best_number: int | None
    best_values: dict[str, Any]
    best_run_id: str | None

    @property
    def done(self) -> int:
        return self.complete + self.pruned + self.failed


def summarise(resolved: Resolved, study: Any) -> Summary:
    from optuna.trial import TrialState

    sweep = resolved.recipe.sweep
    assert sweep is not None
    trials, lost = study.get_trials(deepcopy=False), storage.lost_trials(study)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None and math.isfinite(t.value)]
    best = None
    if complete:
        best = (min if sweep.direction() == "min" else max)(complete, key=lambda t: (t.value, -t.number))
    return Summary(
        complete=sum(1 for t in trials if t.state == TrialState.COMPLETE),
        pruned=sum(1 for t in trials if t.state == TrialState.PRUNED),
        failed=sum(1 for t in trials if t.state == TrialState.FAIL and storage.counted(t, lost)),
        lost=sum(1 for t in trials if t.state == TrialState.FAIL and storage.why_lost(t, lost) is not None),
        best_value=best.value if best else None,
        best_number=best.number if best else None,
        best_values=space.decode_params(sweep, best.params) if best else {},
        best_run_id=best.user_attrs.get(storage.RUN_ID) if best else None,
    )


def trials_csv(resolved: Resolved, study: Any) -> str:
    sweep = resolved.recipe.sweep
    assert sweep is not None
    keys = list(sweep.params)
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["number", "state", "counted", sweep.metric, *keys, "run_id", "duration_s", "note"])
    lost = storage.lost_trials(study)
    for t in study.get_trials(deepcopy=False):
        values = space.decode_params(sweep, t.params)
        dur = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and t.datetime_start else ""
        note = storage.why_lost(t, lost) or t.user_attrs.get(storage.SURPLUS) or t.user_attrs.get("mpsrun.message", "")
        w.writerow([t.number, t.state.name, storage.counted(t, lost), "" if t.value is None else t.value,
                    *[json.dumps(values[k]) if k in values else "" for k in keys], t.user_attrs.get(storage.RUN_ID, ""), dur, note])
    return out.getvalue()


def best_recipe(resolved: Resolved, s: Summary) -> str:
    """The recipe as the user wrote it (overrides applied), the best values set, no `sweep:` section."""
    import yaml

    from mpsrun.recipe.sweep import trial_recipe

    best = trial_recipe(resolved, s.best_values)  # validated: `mpsrun run` takes it as it is
    head = f"# The best trial ({s.best_number}) of an mpsrun sweep of {resolved.path.name}: {resolved.recipe.sweep.metric if resolved.recipe.sweep else ''} {s.best_value}\n"
    return head + yaml.safe_dump(best.source.data, sort_keys=False)


def publish(resolved: Resolved, study: Any, parent_run_id: str, tracking_uri: str | None, target: int, c: Any = None) -> tuple[Summary, list[str]]:
    """Log the summary, best recipe, CSV and figures on the parent; returns the summary and notes (skipped figures).

    `c`: the client to use (parent.Via: the writes go through worker 0's MLflow helper, in one batch); else one
    of this process. The figures are drawn first, here, while that helper still writes the last trials' records
    (on the 2-core machine about 1.3 s of matplotlib that used to follow them).
    """
    from mpsrun.sweep import figures, parent

    c = parent.client_for(tracking_uri, c)
    with tempfile.TemporaryDirectory() as d:
        made, skipped = figures.draw(resolved, study, Path(d))  # from the study alone: no MLflow call waits before it
        from mpsrun.sweep import trace

        trace.mark("figures_drawn")
        parent.settle_lost(tracking_uri, study, c)  # the child runs agree with the study before the parent says what it holds
        s = summarise(resolved, study)
        notes: list[str] = list(skipped)
        calls: list[tuple[str, tuple, dict]] = []
        metrics = {"trials_complete": s.complete, "trials_pruned": s.pruned, "trials_failed": s.failed, "trials_lost": s.lost}
        if s.best_value is not None:
            metrics["best_value"] = s.best_value
        calls += [("log_metric", (parent_run_id, k, float(v)), {}) for k, v in metrics.items()]
        tags = {"mpsrun.sweep.progress": f"{s.done}/{target}"}
        if s.best_number is not None:
            tags.update({"mpsrun.sweep.best_trial": str(s.best_number), "mpsrun.sweep.best_run_id": s.best_run_id or ""})
            tags.update({f"best.{k}": json.dumps(v) for k, v in s.best_values.items()})
            logged = c.get_run(parent_run_id).data.params
            for k, v in s.best_values.items():
                text = json.dumps(v) if not isinstance(v, str) else v
                if f"best.{k}" not in logged:
                    calls.append(("log_param", (parent_run_id, f"best.{k}", text), {}))
                elif logged[f"best.{k}"] != text[:6000]:
                    notes.append(f"param best.{k} keeps its first value (MLflow params are immutable); the tag best.{k} has the new best")
            calls.append(("log_text", (parent_run_id, best_recipe(resolved, s), "best_recipe.yaml"), {}))
        calls += [("set_tag", (parent_run_id, k, v), {}) for k, v in tags.items()]
        calls.append(("log_text", (parent_run_id, trials_csv(resolved, study), "trials.csv"), {}))
        calls += [("log_artifact", (parent_run_id, str(f), "figures"), {}) for f in made]
        if isinstance(c, parent.Via):  # one round trip, answered before the folder of figures goes
            c.tracker.hook("client_calls", calls)
        else:
            for method, args, kwargs in calls:
                getattr(c, method)(*args, **kwargs)
    return s, notes
