"""The sweep's MLflow side: one parent run per study, found again on every re-run; trial states on child runs.

The parent's id is kept in the study itself (a study user attribute), so any worker, on
any machine, that joins the study finds the same parent; the parent carries the study's
name and storage as tags, and `mpsrun resume PARENT_ID` reads them back.
"""

from __future__ import annotations

import json
from typing import Any

from mpsrun.recipe.load import Resolved
from mpsrun.sweep import storage
from mpsrun.track.store import client as store
from mpsrun.track.store import liveness

ROLE = "mpsrun.sweep"  # "parent" or "trial"
STATE_TAG, TRIAL_TAG = "mpsrun.sweep.state", "mpsrun.sweep.trial"  # on each trial's run: COMPLETE/PRUNED/FAILED, its number
STUDY, STORAGE, TARGET = "mpsrun.sweep.study", "mpsrun.sweep.storage", "mpsrun.sweep.trials"
OVERRIDES = "mpsrun.sweep.overrides"  # JSON list: `mpsrun resume PARENT_ID` resolves the recipe again with them
PROGRESS = "mpsrun.sweep.progress"  # "done/target", refreshed after each trial


class RunMarker:
    """Tags on finished child runs (state, counted) and the end of runs whose worker died, through one client."""

    def __init__(self, tracking_uri: str | None) -> None:
        self.uri, _ = store.resolve_uri(tracking_uri)
        self._c: Any = None

    @property
    def c(self) -> Any:
        if self._c is None:
            self._c = store.client(self.uri)
        return self._c

    def state(self, run_id: str, state: str, counted: bool = True, why: str = "") -> None:
        try:
            self.c.set_tag(run_id, STATE_TAG, state)
            if not counted:
                self.c.set_tag(run_id, "mpsrun.sweep.counted", "false")
            if why:
                self.c.set_tag(run_id, "mpsrun.sweep.why", why)
        except Exception:  # noqa: BLE001 - a tag is not worth a failed sweep; the study holds the truth
            pass

    def lost(self, run_id: str, why: str) -> None:
        """A trial failed because its worker died: its run is no longer RUNNING (KILLED), and not counted."""
        try:
            run = self.c.get_run(run_id)
            self.state(run_id, "FAILED", counted=False, why=why)
            if run.info.status == "RUNNING":
                self.c.set_tag(run_id, "mpsrun.error", f"trial lost: {why}")
                self.c.set_terminated(run_id, "KILLED")
        except Exception:  # noqa: BLE001
            pass


def open_parent(resolved: Resolved, study: Any, storage_url: str, target: int, tracking_uri: str | None) -> tuple[str, bool]:
    """(the study's parent run id, whether it is new): the one the study names when the store still has it."""
    uri, artifact_root = store.resolve_uri(tracking_uri)
    c = store.client(uri)
    known = study.user_attrs.get(storage.PARENT)
    ident = liveness.identity()
    if known:
        try:
            run = c.get_run(known)
        except Exception:  # noqa: BLE001 - another store, or deleted: start a new parent
            run = None
        if run is not None:
            c.update_run(known, status="RUNNING")
            for k, v in {**ident, TARGET: str(target)}.items():
                c.set_tag(known, k, v)
            return known, False
    experiment = resolved.recipe.tracking.experiment or resolved.path.stem
    exp_id = store.ensure_experiment(c, experiment, artifact_root)
    tags = {
        ROLE: "parent", STUDY: study.study_name, STORAGE: storage.shown(storage_url), TARGET: str(target),
        "mpsrun.recipe": str(resolved.path.resolve()), "mpsrun.overrides": " ".join(resolved.overrides),
        OVERRIDES: json.dumps(resolved.overrides),
        "mpsrun.sweep.metric": resolved.recipe.sweep.metric if resolved.recipe.sweep else "",
        **ident, **resolved.recipe.tracking.tags,
    }
    run = c.create_run(exp_id, run_name=resolved.recipe.tracking.run_name or f"sweep {study.study_name}", tags=tags)
    run_id = run.info.run_id
    study.set_user_attr(storage.PARENT, run_id)
    sweep = resolved.recipe.sweep
    assert sweep is not None
    c.log_text(run_id, resolved.source.path.read_text() if resolved.source.path.exists() else resolved.as_yaml(), "sweep_recipe.yaml")
    c.log_text(run_id, json.dumps({k: v.model_dump(mode="json", exclude_none=True) for k, v in sweep.params.items()}, indent=2), "search_space.json")
    for k, v in (("sweep.metric", sweep.metric), ("sweep.mode", sweep.direction()), ("sweep.sampler", sweep.sampler), ("sweep.pruner", sweep.pruner)):
        c.log_param(run_id, k, v)
    return run_id, True


def progress(tracking_uri: str | None, run_id: str, done: int, target: int) -> None:
    try:
        RunMarker(tracking_uri).c.set_tag(run_id, PROGRESS, f"{done}/{target}")
    except Exception:  # noqa: BLE001
        pass


def close(tracking_uri: str | None, run_id: str, status: str) -> None:
    uri, _ = store.resolve_uri(tracking_uri)
    store.client(uri).set_terminated(run_id, status)
