"""The sweep's MLflow side: one parent run per study, found again on every re-run; trial states on child runs.

The parent's id is kept in the study itself (a study user attribute), so any worker, on
any machine, that joins the study finds the same parent; the parent carries the study's
name and storage as tags, and `mpsrun resume PARENT_ID` reads them back.

One owner per parent, as for any run (track/store/owner.py): the command that opens the parent
claims it (param `mpsrun.owner.N`), and only the owner writes the parent's status, liveness tags
and results. A second `mpsrun sweep` (or `mpsrun resume PARENT_ID`) of the study while the owner
lives is a guest: its workers join the study and their trials are child runs of the same parent,
as the design wants, but it leaves the parent alone; when it ends it claims the parent once more,
and if the owner has let go by then (the last command out) it publishes the results and closes it.
An owner that is gone (kill -9, a lost machine) is taken over, said on screen and tagged.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from mpsrun.recipe.load import Resolved
from mpsrun.sweep import storage
from mpsrun.track.store import client as store
from mpsrun.track.store import liveness, owner

ROLE = "mpsrun.sweep"  # "parent" or "trial"
STATE_TAG, TRIAL_TAG = "mpsrun.sweep.state", "mpsrun.sweep.trial"  # on each trial's run: COMPLETE/PRUNED/FAILED, its number
STUDY, STORAGE, TARGET = "mpsrun.sweep.study", "mpsrun.sweep.storage", "mpsrun.sweep.trials"
OVERRIDES = "mpsrun.sweep.overrides"  # JSON list: `mpsrun resume PARENT_ID` resolves the recipe again with them
PROGRESS = "mpsrun.sweep.progress"  # "done/target", refreshed after each trial
COUNTED, WHY = "mpsrun.sweep.counted", "mpsrun.sweep.why"  # on a lost trial's run: "false", and why it was lost


PROGRESS_EVERY_S = 1.0  # the parent's progress tag, through a worker's helper, at most this often


class Pace:
    """A rate limit for posts to the MLflow helper: `due()` is true at most once every `every_s` seconds.

    `at_once`: the first call is due (else the first `every_s` after creation is not). Used for the parent's
    progress tag (here) and a fused group's epoch metrics (fused/record.py)."""

    def __init__(self, every_s: float, at_once: bool = False) -> None:
        self.every_s = every_s
        self.last = float("-inf") if at_once else time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return False
        self.last = now
        return True


class Via:
    """MLflow's client for the parent, its calls made in worker 0's MLflow helper process (track/apart.client_calls).

    Why: the command that runs a sweep then never imports mlflow and opens no store itself (3-4 s on 2
    cores, serial before the first trial could start, while the helper had imported both on its own
    core). A call waits for its answer, after every call sent before it; `post` sends without waiting.
    An MLflow error comes back as MlflowException (an owner's claim race reads it); the helper being
    gone is the tracker's to handle (it opens the store in this process and goes on there).
    """

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.progress_pace = Pace(PROGRESS_EVERY_S, at_once=True)  # when `progress` next posts

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return self.tracker.hook("client_calls", [(name, args, kwargs)])[0]
            except Exception as e:
                if getattr(e, "type_name", "") in ("MlflowException", "RestException"):
                    from mlflow.exceptions import MlflowException

                    raise MlflowException(str(e)) from None
                raise
        return call

    def post(self, name: str, *args: Any) -> None:
        """A call whose answer nobody waits for; its failure is skipped in the helper, never raised later."""
        self.tracker.hook_later("client_calls", [(name, args, {})], True)


def client_for(tracking_uri: str | None, c: Any = None) -> Any:
    """`c` (a Via, or a client) where given, else a client of this process (mlflow imported here)."""
    if c is not None:
        return c
    uri, _ = store.resolve_uri(tracking_uri)
    return store.client(uri)


def _set_tag(c: Any, run_id: str, key: str, value: str) -> None:
    """A tag posted without waiting through a Via, else written at once."""
    if isinstance(c, Via):
        c.post("set_tag", run_id, key, value)
    else:
        c.set_tag(run_id, key, value)


class RunMarker:
    """Tags on finished child runs (state, counted) and the end of runs whose worker died, through one client."""

    def __init__(self, tracking_uri: str | None, tracker: Any = None, client: Any = None) -> None:
        self.uri, _ = store.resolve_uri(tracking_uri)
        self._c: Any = client  # made on first use when not given
        self.tracker = tracker  # a worker's MLflow helper: trial states are handed to it without waiting (no mlflow import here)

    @property
    def c(self) -> Any:
        if self._c is None:
            self._c = store.client(self.uri)
        return self._c

    def state(self, run_id: str, state: str, counted: bool = True, why: str = "") -> None:
        if self.tracker is not None:
            from mpsrun.train.record import hook_later

            tags = {STATE_TAG: state, **({COUNTED: "false"} if not counted else {}), **({WHY: why} if why else {})}
            try:
                hook_later(self.tracker, "tag_run", run_id, tags)  # written after the run's own records, in order
                return
            except Exception:  # noqa: BLE001 - the helper is gone: through a client of this process
                pass
        try:
            self.c.set_tag(run_id, STATE_TAG, state)
            if not counted:
                self.c.set_tag(run_id, COUNTED, "false")
            if why:
                self.c.set_tag(run_id, WHY, why)
        except Exception:  # noqa: BLE001 - a tag is not worth a failed sweep; the study holds the truth
            pass

    def lost(self, run_id: str, why: str, run: Any = None) -> None:
        """A trial failed because its worker died: its run is no longer RUNNING (KILLED), and not counted.
        `run`: the run as already read, if it was."""
        try:
            run = run if run is not None else self.c.get_run(run_id)
            self.state(run_id, "FAILED", counted=False, why=why)
            if run.info.status == "RUNNING":
                self.c.set_tag(run_id, "mpsrun.error", f"trial lost: {why}")
                self.c.set_terminated(run_id, "KILLED")
        except Exception:  # noqa: BLE001
            pass


def settle_lost(tracking_uri: str | None, study: Any, client: Any = None) -> int:
    """Every lost trial's run ended (KILLED where still RUNNING) and tagged not counted; returns how many needed it.

    Why: the worker that sees a trial lost (interrupted, or another worker's death found) hands
    the tag to its MLflow helper without waiting, and a worker stopped at the wrong instant can
    leave that run untagged (seen once in CI, under load: a sweep's child runs then counted one
    trial too many against the study). The study is the truth; the owner makes the runs agree
    with it each time it publishes the results.
    """
    from optuna.trial import TrialState

    marker = RunMarker(tracking_uri, client=client)
    lost = storage.lost_trials(study)
    n = 0
    unknown: dict[int, str] = {}  # lost trials that never kept their run's id: found by the run's trial tag
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        why, run_id = storage.why_lost(t, lost), t.user_attrs.get(storage.RUN_ID)
        if why is None:
            continue
        if not run_id:
            unknown[t.number] = why
            continue
        try:
            run = marker.c.get_run(run_id)
        except Exception:  # noqa: BLE001 - a run that was never created or was deleted: nothing to agree with
            continue
        if run.data.tags.get(COUNTED) == "false" and run.info.status != "RUNNING":
            continue
        marker.lost(run_id, why, run)
        n += 1
    return n + _settle_untold(marker, study.user_attrs.get(storage.PARENT), unknown)


def _settle_untold(marker: RunMarker, parent_run_id: str | None, unknown: dict[int, str]) -> int:
    """The RUNNING child runs of lost trials whose id the study never got, found by their trial tag; returns how many.

    Why: a trial's run is created before its id is kept on the trial (a fused group's runs in one
    call to the worker's MLflow helper, which finishes the call even when its worker is killed).
    A worker killed in between left those runs RUNNING for good (seen in CI: a kill -9 mid-way
    through a fused group's start). Every trial's run carries its number (TRIAL_TAG) and its
    parent, so the parent's RUNNING children name the lost trials they belong to.
    """
    if not unknown or not parent_run_id:
        return 0
    try:
        exp = marker.c.get_run(parent_run_id).info.experiment_id
        runs = marker.c.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and attributes.status = 'RUNNING'",
                                    max_results=5000)
    except Exception:  # noqa: BLE001 - the parent is gone: nothing to agree with
        return 0
    n = 0
    for run in runs:
        number = run.data.tags.get(TRIAL_TAG, "")
        if number.isdigit() and int(number) in unknown:
            marker.lost(run.info.run_id, unknown[int(number)], run)
            n += 1
    return n


@dataclass
class Opened:
    """The study's parent run as this command holds it."""

    run_id: str
    new: bool
    generation: int | None  # this command's owner claim; None: a guest (another live command owns the parent)
    message: str = ""  # who owns it (a guest), or the takeover of a gone owner


def claim(tracking_uri: str | None, run_id: str, c: Any = None) -> dict[str, Any]:
    """Claim the parent for this process (owner.try_claim): {"ok", "generation", "took_over"} or {"ok": False, "message"}.
    `c`: the client to use (a Via: through worker 0's helper); else one of this process."""
    c = client_for(tracking_uri, c)
    got = owner.try_claim(c, run_id, None, owner.me())
    if not got["ok"]:  # said to a guest, which goes on: who holds the parent, not "stop that one first"
        top = owner.latest(c.get_run(run_id).data.params)
        if top is not None:
            got["message"] = f"the sweep's parent run {run_id} is owned by {top.who()}"
    return got


def take(tracking_uri: str | None, run_id: str, got: dict[str, Any], target: int | None = None, c: Any = None) -> None:
    """This process owns the parent now: RUNNING, its liveness and owner tags."""
    c = client_for(tracking_uri, c)
    c.update_run(run_id, status="RUNNING")
    tags = {**liveness.identity(), **owner.tags_for(int(got["generation"]), got["owner"], got["took_over"])}
    if target is not None:
        tags[TARGET] = str(target)
    for k, v in tags.items():
        c.set_tag(run_id, k, v)


def open_parent(resolved: Resolved, study: Any, storage_url: str, target: int, tracking_uri: str | None, c: Any = None) -> Opened:
    """The study's parent run (the one the study names when the store still has it, else a new one), claimed when free.
    `c`: the client to use (a Via: through worker 0's helper, this process never imports mlflow); else one of this process."""
    uri, artifact_root = store.resolve_uri(tracking_uri)
    c = client_for(tracking_uri, c)
    known = study.user_attrs.get(storage.PARENT)
    ident = liveness.identity()
    if known:
        try:
            run = c.get_run(known)
        except Exception:  # noqa: BLE001 - another store, or deleted: start a new parent
            run = None
        if run is not None:
            got = claim(tracking_uri, known, c)
            if not got["ok"]:  # a live owner: this command adds workers and leaves the parent to it
                return Opened(known, False, None, got["message"])
            take(tracking_uri, known, got, target, c)
            return Opened(known, False, int(got["generation"]), got["took_over"] or "")
    experiment = resolved.recipe.tracking.experiment or resolved.path.stem
    exp_id = store.ensure_experiment(c, experiment, artifact_root)
    tags = {
        ROLE: "parent", STUDY: study.study_name, STORAGE: storage.shown(storage_url), TARGET: str(target),
        "mpsrun.recipe": str(resolved.path.resolve()), "mpsrun.overrides": " ".join(resolved.overrides),
        OVERRIDES: json.dumps(resolved.overrides),
        "mpsrun.sweep.metric": resolved.recipe.sweep.metric if resolved.recipe.sweep else "",
        **ident, **resolved.recipe.tracking.tags,
    }
    mine = owner.me(0)  # a new parent: claim 0 goes in with it
    tags.update(owner.tags_for(0, mine.who(), None))
    run = c.create_run(exp_id, run_name=resolved.recipe.tracking.run_name or f"sweep {study.study_name}", tags=tags)
    run_id = run.info.run_id
    c.log_param(run_id, mine.key, mine.value())
    study.set_user_attr(storage.PARENT, run_id)
    sweep = resolved.recipe.sweep
    assert sweep is not None
    c.log_text(run_id, resolved.source.path.read_text() if resolved.source.path.exists() else resolved.as_yaml(), "sweep_recipe.yaml")
    c.log_text(run_id, json.dumps({k: v.model_dump(mode="json", exclude_none=True) for k, v in sweep.params.items()}, indent=2), "search_space.json")
    for k, v in (("sweep.metric", sweep.metric), ("sweep.mode", sweep.direction()), ("sweep.sampler", sweep.sampler), ("sweep.pruner", sweep.pruner)):
        c.log_param(run_id, k, v)
    return Opened(run_id, True, 0)


def notes(tracking_uri: str | None, run_id: str, said: list[str], c: Any = None) -> None:
    """What the sweep said before its workers started (`mpsrun.notes`, as a run's), kept on the parent."""
    if not said:
        return
    try:
        _set_tag(client_for(tracking_uri, c), run_id, "mpsrun.notes", "; ".join(said)[:5000])
    except Exception:  # noqa: BLE001 - said on screen already
        pass


def progress(tracking_uri: str | None, run_id: str, done: int, target: int, c: Any = None) -> None:
    """The parent's `mpsrun.sweep.progress` ("done/target"). Through a Via at most every PROGRESS_EVERY_S: a fused
    group's members end together (16 tags written one after another, behind their runs' records, for one that
    counts); the results' publish writes the last one."""
    if isinstance(c, Via) and not c.progress_pace.due():
        return
    try:
        _set_tag(client_for(tracking_uri, c), run_id, PROGRESS, f"{done}/{target}")
    except Exception:  # noqa: BLE001
        pass


def close(tracking_uri: str | None, run_id: str, status: str, generation: int | None = None, c: Any = None) -> None:
    """The owner lets go (the tag first: the next owner waits for both), then the parent's status (waited for)."""
    c = client_for(tracking_uri, c)
    if generation is not None:
        c.set_tag(run_id, owner.RELEASED, str(generation))
    c.set_terminated(run_id, status)
