"""Each member of a fused group its own MLflow child run: params, tags, recipe, dataset inputs, per-epoch metrics, end.

Through the worker's MLflow helper (track/apart.py): one call creates the group's runs, one
posted call fills in their params, recipes and dataset inputs, posted calls log the members'
epoch metrics (every few seconds: Pace), one posted call ends the members that ended.
A member's run carries what an unfused trial's carries (its recipe's params, `recipe.yaml`,
device and version tags, the trial's tags) plus `mpsrun.sweep.group` (the group's id) and
`mpsrun.sweep.group_size`, and liveness tags, so `mpsrun runs` shows a run whose worker is gone
as interrupted.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from mpsrun.sweep.fused.members import Built, Member
from mpsrun.sweep.parent import Pace  # noqa: F401 - the group's epoch metrics' rate limit (work.py), the sweep's one

GROUP, GROUP_SIZE, FUSED = "mpsrun.sweep.group", "mpsrun.sweep.group_size", "mpsrun.sweep.fused"
# The members' epoch metrics posted at most this often (a run's own: every 5 s, store.Tracker's interval), or when a
# member ends (work.py, with a Pace). Why: each post writes one batch to every member's run, a few SQLite commits
# each; 16 digits members' epochs of 0.25 s each took the helper 0.7-1.3 s to write on 2 cores (the sweep's end
# waited for them). Epochs longer than EVERY_S are posted one by one. A signal posts what is left (stop.abandon).
EVERY_S = 1.0


def _hook(tracker: Any, name: str, *args: Any) -> Any:
    from mpsrun.train import record

    return record.hook(tracker, name, *args)


def _post(tracker: Any, name: str, *args: Any) -> None:
    from mpsrun.train import record

    record.hook_later(tracker, name, *args)


def begin(tracker: Any, b: Built, group_id: str, parent_run_id: str, notes: list[str]) -> None:
    """Every member's child run created (ids on the members and on their Optuna trials)."""
    from mpsrun import __version__
    from mpsrun.devices import resolve as devices
    from mpsrun.plugins import registry as plugins
    from mpsrun.recipe.load import flatten
    from mpsrun.sweep import storage
    from mpsrun.track.store import liveness
    from mpsrun.train import record

    base = {**devices.choice_tags(b.choice), **liveness.identity(), "mpsrun.version": __version__, "mpsrun.command": " ".join(sys.argv),
            "data.path": "resident", "data.path_reason": "the fused group's data lives on the device",
            "memory.kind": devices.memory_kind(b.device), GROUP: group_id, GROUP_SIZE: str(len(b.members)), FUSED: "true",
            "mpsrun.mlflow_helper": "fused group: the worker's helper writes every member's run", "mpsrun.model_artifact": "skipped (tracking.log_model: false)"}
    for kind in ("dataset", "model"):
        try:
            ref = plugins.find(kind, getattr(b.members[0].resolved.recipe, kind).name)
            base[f"plugin.{kind}"] = f"{ref.distribution} {ref.version} ({ref.value})"
        except Exception:  # noqa: BLE001
            pass
    options = {"resolved.precision": "bf16" if getattr(b, "amp", None) is not None else "fp32", "resolved.channels_last": "false", "resolved.compile": "false",
               "resolved.graphs": str(bool(getattr(b, "graphs", False))).lower(), "resolved.cudnn_benchmark": "false"}
    specs = []
    for m in b.members:
        r = m.resolved
        tags = {**base, **m.tags, "mpsrun.recipe": str(r.path), "mpsrun.overrides": " ".join(r.overrides), **r.recipe.tracking.tags}
        for i, note in enumerate(notes):
            tags[f"mpsrun.note.{i}"] = note
        params = {**flatten(r.as_dict()), **options, "data.train_size": int(b.sources[0][1].shape[0]), "data.val_size": int(b.sources[0][3].shape[0])}
        specs.append({"run_name": r.recipe.tracking.run_name or f"trial {m.number}", "tags": tags, "parent": parent_run_id,
                      "params": params, "texts": {"recipe.yaml": r.as_yaml()}})
    data = None
    try:
        fake = types.SimpleNamespace(splits=b.splits, resolved=b.members[0].resolved)
        splits, _ = record.input_splits(fake)  # the same inputs a trial's run gets
        source, source_tags = record.dataset_source(fake)
        data = (b.members[0].resolved.recipe.dataset.name, splits, source, source_tags)
    except Exception:  # noqa: BLE001 - the runs go on without dataset inputs
        data = None
    ids = _hook(tracker, "runs_begin", specs, None, False)  # the runs, waited for (their ids go on the trials)
    _post(tracker, "runs_fill", ids, specs, data)  # their params, recipes and dataset inputs while the group trains
    for m, rid in zip(b.members, ids):
        m.run_id = rid
        try:
            m.trial.set_user_attr(storage.RUN_ID, rid)
        except Exception:  # noqa: BLE001 - a trial already finished elsewhere (lost): its run is settled from the study
            pass


def epoch(tracker: Any, rows: list[tuple[Member, int, dict[str, float]]]) -> None:
    """The members' epoch metrics, as `mpsrun run` names them in MLflow (system/... for the machine's figures)."""
    from mpsrun.track.records import names
    from mpsrun.track.store.runs import EPOCHS_DONE_TAG

    out = [(m.run_id, names.to_mlflow(metrics), e, {EPOCHS_DONE_TAG: str(e + 1)}) for m, e, metrics in rows if m.run_id]
    if out:
        _post(tracker, "runs_epoch", out)


def end(tracker: Any, members: list[Member], notes: list[str], wait: bool = False) -> None:
    """The members that ended: their run's status (FINISHED, or FAILED with the error), notes, summary tags, the tags
    their controls set (`mpsrun.stopped_early` and its reason, as a run's EarlyStopping sets them) and the trial's
    state (`mpsrun.sweep.state`, in the same batch: the worker then does not tag it again, worker._finish).

    A member whose state is KILLED was stopped by a signal (its group interrupted): its run ends KILLED, as
    an interrupted `mpsrun run` does, tagged as a lost trial's is (state FAILED, not counted, why); the
    study has it failed, not counted and queued again (storage.mark_lost).
    """
    from mpsrun.sweep.parent import COUNTED, STATE_TAG, WHY

    rows = []
    for m in members:
        if not m.run_id:
            continue
        status = {"FAILED": "FAILED", "KILLED": "KILLED"}.get(m.state, "FINISHED")
        tags = {**m.end_tags, "mpsrun.notes": " | ".join(notes) or "none", STATE_TAG: m.state}  # end_tags: early stopping's
        if m.state == "PRUNED":
            tags["mpsrun.sweep.pruned"] = m.message
        if m.state == "FAILED" and "non-finite" in m.message:
            tags["mpsrun.nonfinite"] = m.message
        if m.state == "KILLED":
            tags.update({STATE_TAG: "FAILED", COUNTED: "false", WHY: m.message})
        rows.append((m.run_id, status, tags, m.message if m.state == "FAILED" else None, None))
    if rows:
        (_hook if wait else _post)(tracker, "runs_end", rows)
